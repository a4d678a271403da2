-- Statements on hubd_allocations that no claim owns and no sweep runs: requests and releases
-- (through the functions applications call too), extensions and touches, an operator's forget,
-- reads, and the wake-up of a connect. The table's claims and leases are in claims.sql, a
-- claim's fenced transitions in transitions.sql, the sweeps in sweeps.sql.

-- name: insert_allocation
-- A new request, due at once, through the function applications call too (hubd_v1.request):
-- one path, one set of checks. The wake-up is delivered when the caller's transaction commits.
-- The :spec arrives as JSON text, so callers' connections need no codec. A key already used
-- returns its allocation (or fails, HU409, if the request differs). :lifetime seconds (NULL:
-- the provisioner's max_lifetime, if any) bounds its life from now; :idle_timeout seconds
-- (NULL: the provisioner's idle_timeout, if any) its idleness once ready.
SELECT * FROM hubd_request_allocation(:provisioner_id, :tenant_id, :session_id,
    :spec::text::jsonb, :idempotency_key, :ready_when, :instance_id, :lifetime::float8,
    :idle_timeout::float8);

-- name: extend_allocation
-- The allocation now ends :lifetime seconds from now, within its provisioner's max_lifetime
-- (22023 beyond it); a release under way or an end is left as it is. Returns the row.
SELECT * FROM hubd_extend_allocation(:allocation_id, :lifetime::float8, :instance_id);

-- name: touch_allocation
-- The application is still using the allocation: its idle clock starts again (where it has
-- one). Returns the row; an unknown id fails (no_data_found).
SELECT * FROM hubd_touch_allocation(:allocation_id);

-- name: release_allocation
-- A user's release, through the function applications call too (hubd_v1.release): pending goes
-- straight to released (nothing was bound); any other active status becomes releasing under a
-- new generation, which fences off the current claim and sidecar. Returns the row as it stands;
-- an unknown id fails (no_data_found).
SELECT * FROM hubd_release_allocation(:allocation_id, :reason, :instance_id);

-- name: forget_allocation
-- An operator's forget (hubd alloc forget): an active allocation whose sidecar is gone for good
-- ends now, with no destroy, ever. A release that was under way ends released (what its
-- requester asked for); anything else ends failed (nobody asked it to end), both with failure
-- 'forgotten' and the operator's :reason, which the ledger keeps too. The generation is bumped
-- and the lease cleared, so a claim working on the row, and the sidecar, are fenced off: their
-- later writes match nothing. The sidecar id and external ref stay, naming what the operator may
-- have to clean up. The row's triggers retire its sockets and write the event. Returns the row;
-- none when nothing was forgotten (an unknown id, or an allocation that had ended already).
WITH prior AS (
    SELECT id, status FROM hubd_allocations
    WHERE id = :allocation_id
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
    FOR UPDATE
), updated AS (
    UPDATE hubd_allocations AS a SET
        status = CASE WHEN prior.status = 'releasing' THEN 'released' ELSE 'failed' END,
        generation = a.generation + 1,
        failure_code = 'forgotten',
        failure_message = :reason,
        connection_ready = false,
        initialization_lease_id = NULL,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    FROM prior
    WHERE a.id = prior.id AND a.id = :allocation_id
    RETURNING a.*, prior.status AS from_status
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, :instance_id, 'forget', from_status, status, 'committed', 'forgotten',
        :reason
    FROM updated
)
SELECT * FROM updated;

-- name: wake
-- Make :generation of :allocation_id due now (a sidecar connected, or a repair) and tell the
-- daemons.
WITH updated AS (
    UPDATE hubd_allocations SET next_attempt_at = now(), updated_at = now()
    WHERE id = :allocation_id AND generation = :generation
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
      AND (next_attempt_at IS NULL OR next_attempt_at > now())
    RETURNING id, provisioner_id
), woken AS (
    SELECT pg_notify('hubd_wake', provisioner_id) FROM updated
)
SELECT count(*) > 0 FROM updated, woken;

-- name: get_allocation
SELECT * FROM hubd_allocations WHERE id = :allocation_id;

-- name: list_active
-- Every active row, for start-up repair and the repair sweep.
SELECT * FROM hubd_allocations
WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
ORDER BY id;

-- name: list_allocations
-- Newest first, optionally of one status (:status, or all when NULL), at most :limit rows.
SELECT * FROM hubd_allocations
WHERE (:status::text IS NULL OR status = :status)
ORDER BY created_at DESC, id
LIMIT :limit;
