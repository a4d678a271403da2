-- 0014_claim_lock: the claim statement locks a due row FOR NO KEY UPDATE, not FOR UPDATE
-- (schema.sql says why).
CREATE OR REPLACE FUNCTION hubd_due_allocations(exclude text[], wanted integer)
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
    FOR NO KEY UPDATE OF a SKIP LOCKED
$$;
