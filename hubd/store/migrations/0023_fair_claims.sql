-- 0023_fair_claims: a claim shares the due work among the tenants that have some, so a burst
-- of one tenant no longer queues every other tenant's requests behind it (architecture §2).

DROP INDEX hubd_allocations_due_idx;

-- Serves the claim: only active, scheduled rows, by tenant (no tenant: ''), oldest due first
-- within each. Terminal rows never enter it, so the claim's cost does not grow with history.
CREATE INDEX hubd_allocations_due_idx ON hubd_allocations
    ((coalesce(tenant_id, '')), next_attempt_at, id)
    WHERE next_attempt_at IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

-- The due rows a claim takes, shared among the tenants with due work: every such tenant's oldest
-- due row comes before any tenant's second, each turn in due order, so a burst of one tenant
-- delays another's request by at most a turn, not by the burst. The tenants are found by a walk
-- that skips from one to the next in the due index (one descent each: the cost grows with the
-- tenants that have scheduled rows, not with the rows), each with its earliest scheduled time;
-- of those with something due, the `wanted` earliest take part, and each locks its share of the
-- claim (at least one row) in its own due order, skipping rows another claimer holds, so
-- concurrent claimers on several replicas take different rows. The turns are then taken in
-- order; a share a tenant could not fill leaves its slots to the next statement of the
-- dispatcher, which claims again at once while slots are free. A row locked beyond `wanted`
-- (fewer than one share per tenant's worth) is released with the statement.
-- Statistics lag a burst: a table analyzed while nearly empty makes "few rows are due" look
-- true, and the planner then fetches every due row and sorts them; the settings leave the index
-- walks the only plan, in this function alone.
-- The lock is FOR NO KEY UPDATE, what the claim's own UPDATE takes (it changes no key): two
-- claimers still exclude each other, but a row is no longer skipped while another transaction
-- merely references it (a ledger row, a connection record or a secret written for it holds FOR
-- KEY SHARE until its commit), which left a row due with nothing to announce it until the poll.
CREATE OR REPLACE FUNCTION hubd_due_allocations(exclude text[], wanted integer)
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
        SELECT t.tenant FROM tenants AS t
        WHERE t.earliest <= now()
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
            LIMIT s.n
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

-- CREATE OR REPLACE sets a function's settings anew: the fixed path of 0016 again.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION hubd_due_allocations(text[], integer) '
                   'SET search_path = pg_catalog, %I, pg_temp', current_schema());
END;
$$;
