-- 0008_claim_plans: plans that do not depend on the statistics. The claim's two look-ups
-- (hubd_due_allocations and hubd_has_open_effects in schema.sql), and two indexes that only
-- the statements they serve can use: current sidecars by sidecar, statuses over a time range
-- (schema.sql says why).
DROP INDEX hubd_allocations_status_idx;
CREATE INDEX hubd_allocations_status_idx ON hubd_allocations (status, created_at)
    WHERE created_at IS NOT NULL;

DROP INDEX hubd_allocations_sidecar_idx;
CREATE INDEX hubd_allocations_sidecar_idx ON hubd_allocations (sidecar_id)
    WHERE sidecar_id IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

CREATE FUNCTION hubd_due_allocations(exclude text[], wanted integer)
RETURNS TABLE (id text, next_attempt_at timestamptz)
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
    SELECT a.id, a.next_attempt_at FROM hubd_allocations AS a
    WHERE a.next_attempt_at IS NOT NULL
      AND a.next_attempt_at <= now()
      AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
      AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= now())
      AND a.id <> ALL (exclude)
    ORDER BY a.next_attempt_at, a.id
    LIMIT wanted
    FOR UPDATE OF a SKIP LOCKED
$$;

CREATE FUNCTION hubd_has_open_effects(allocation text)
RETURNS boolean
LANGUAGE sql STABLE
SET enable_seqscan = off
AS $$
    SELECT EXISTS (
        SELECT 1 FROM hubd_allocation_ledger AS i
        WHERE i.allocation_id = allocation AND i.effect_id IS NOT NULL AND i.phase = 'intent'
          AND NOT EXISTS (
              SELECT 1 FROM hubd_allocation_ledger AS o
              WHERE o.allocation_id = i.allocation_id AND o.effect_id = i.effect_id
                AND o.phase <> 'intent'))
$$;
