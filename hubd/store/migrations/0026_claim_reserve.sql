-- 0026_claim_reserve: a claimer keeps some claim slots out of one tenant's reach while other
-- tenants are in sight, so a burst of one tenant no longer holds every slot when another's
-- request comes (architecture §2, "Claim"; docs/performance.md, "Fair claiming among tenants").

DROP FUNCTION hubd_due_allocations(text[], integer);

-- The due rows a claim takes, shared among the tenants with due work: every such tenant's oldest
-- due row comes before any tenant's second, each turn in due order, so a burst of one tenant
-- delays another's request by at most a turn, not by the burst. The tenants are found by a walk
-- that skips from one to the next in the due index (one descent each: the cost grows with the
-- tenants that have scheduled rows, not with the rows), each with its earliest scheduled time;
-- of those with something due and room left, the `wanted` earliest take part, and each locks
-- its share of the claim (at least one row, at most its room) in its own due order,
-- skipping rows another claimer holds, so concurrent claimers on several replicas take
-- different rows. The turns are then taken in order; a share a tenant could not fill leaves its
-- slots to the next statement of the dispatcher, which claims again at once while slots are
-- free. A row locked beyond `wanted` (fewer than one share per tenant's worth) is released with
-- the statement.
-- A tenant's room is how many more claims the claimer lets it hold: rooms[i] for listed[i] (''
-- for no tenant), `room` for any other (NULL: no bound). The claimer keeps some slots out of a
-- bursting tenant's reach, so another tenant's request finds a slot free instead of waiting for
-- one of the burst's claims to end (docs/performance.md, "Fair claiming among tenants").
-- Statistics lag a burst: a table analyzed while nearly empty makes "few rows are due" look
-- true, and the planner then fetches every due row and sorts them; the settings leave the index
-- walks the only plan, in this function alone.
-- The lock is FOR NO KEY UPDATE, what the claim's own UPDATE takes (it changes no key): two
-- claimers still exclude each other, but a row is no longer skipped while another transaction
-- merely references it (a ledger row, a connection record or a secret written for it holds FOR
-- KEY SHARE until its commit), which left a row due with nothing to announce it until the poll.
CREATE FUNCTION hubd_due_allocations(exclude text[], wanted integer, room integer DEFAULT NULL,
    listed text[] DEFAULT '{}', rooms integer[] DEFAULT '{}')
RETURNS TABLE (id text, next_attempt_at timestamptz)
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
AS $$
    WITH RECURSIVE tenants (tenant, earliest) AS (
        (SELECT coalesce(a.tenant_id, ''), a.next_attempt_at FROM hubd_allocations AS a
         WHERE a.next_attempt_at IS NOT NULL
           AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
         ORDER BY coalesce(a.tenant_id, ''), a.next_attempt_at
         LIMIT 1)
        UNION ALL
        SELECT following.tenant, following.earliest
        FROM tenants AS t
        CROSS JOIN LATERAL (
            SELECT coalesce(a.tenant_id, '') AS tenant, a.next_attempt_at AS earliest
            FROM hubd_allocations AS a
            WHERE a.next_attempt_at IS NOT NULL
              AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
              AND coalesce(a.tenant_id, '') > t.tenant
            ORDER BY coalesce(a.tenant_id, ''), a.next_attempt_at
            LIMIT 1
        ) AS following
    ), taking_part AS MATERIALIZED (
        SELECT t.tenant, r.n AS room FROM tenants AS t
        CROSS JOIN LATERAL (
            SELECT coalesce((
                SELECT l.n FROM unnest(listed, rooms) AS l (tenant, n)
                WHERE l.tenant = t.tenant LIMIT 1), room, wanted) AS n
        ) AS r
        WHERE t.earliest <= now() AND r.n > 0
        ORDER BY t.earliest, t.tenant
        LIMIT wanted
    ), share AS (
        SELECT ceil(wanted::numeric / greatest(count(*), 1))::integer AS n FROM taking_part
    ), locked AS (
        SELECT l.id, l.next_attempt_at, p.tenant
        FROM taking_part AS p
        CROSS JOIN share AS s
        CROSS JOIN LATERAL (
            SELECT a.id, a.next_attempt_at FROM hubd_allocations AS a
            WHERE coalesce(a.tenant_id, '') = p.tenant
              AND a.next_attempt_at IS NOT NULL
              AND a.next_attempt_at <= now()
              AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
              AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= now())
              AND a.id <> ALL (exclude)
            ORDER BY coalesce(a.tenant_id, ''), a.next_attempt_at, a.id
            LIMIT least(s.n, p.room)
            FOR NO KEY UPDATE OF a SKIP LOCKED
        ) AS l
    )
    SELECT l.id, l.next_attempt_at
    FROM (
        SELECT k.id, k.next_attempt_at,
               row_number() OVER (PARTITION BY k.tenant ORDER BY k.next_attempt_at, k.id)
                   AS turn
        FROM locked AS k
    ) AS l
    ORDER BY l.turn, l.next_attempt_at, l.id
    LIMIT wanted
$$;

-- The fixed path of 0016 for the function made here; not executable by PUBLIC.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION hubd_due_allocations(text[], integer, integer, text[], '
                   'integer[]) SET search_path = pg_catalog, %I, pg_temp', current_schema());
    REVOKE ALL ON FUNCTION hubd_due_allocations(text[], integer, integer, text[], integer[])
        FROM PUBLIC;
END;
$$;
