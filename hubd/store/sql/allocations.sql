-- Statements on hubd_allocations. Every transition appends its ledger row in the same statement
-- (a data-modifying CTE), so a transition and its evidence commit or vanish together.
-- Claim-owned writes are fenced: $1 id, $2 lease id, $3 generation, and a lease still live by the
-- database clock; $4 is the hub instance written to the ledger. The fence reads clock_timestamp(),
-- not now(): a write that waited on a row lock is re-checked at the moment it proceeds, not at
-- the moment its statement started.

-- name: insert_allocation
-- A new request, due at once; the wake-up is delivered when the caller's transaction commits.
-- The spec ($5) arrives as JSON text, so callers' connections need no codec.
WITH inserted AS (
    INSERT INTO hubd_allocations (id, provisioner_id, tenant_id, session_id, spec, next_attempt_at)
    VALUES ($1, $2, $3, $4, $5::text::jsonb, now())
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, instance_id, kind, to_status, phase)
    SELECT id, generation, $6, 'request', status, 'committed' FROM inserted
), woken AS (
    SELECT pg_notify('hubd_wake', $1)
)
SELECT inserted.* FROM inserted, woken;

-- name: release_allocation
-- A user's release: pending goes straight to released (nothing was bound); any other active status
-- becomes releasing under a new generation, which fences off the current claim and sidecar.
WITH prior AS (
    SELECT id, status FROM hubd_allocations
    WHERE id = $1 AND status IN ('pending', 'provisioning', 'allocated', 'replacing')
    FOR UPDATE
), updated AS (
    UPDATE hubd_allocations AS a SET
        status = CASE WHEN prior.status = 'pending' THEN 'released' ELSE 'releasing' END,
        generation = CASE WHEN prior.status = 'pending' THEN a.generation ELSE a.generation + 1 END,
        next_attempt_at = CASE WHEN prior.status = 'pending' THEN NULL ELSE now() END,
        lease_id = CASE WHEN prior.status = 'pending' THEN NULL ELSE a.lease_id END,
        lease_expires_at = CASE WHEN prior.status = 'pending' THEN NULL ELSE a.lease_expires_at END,
        finished_at = CASE WHEN prior.status = 'pending' THEN now() END,
        connection_ready = false,
        initialization_lease_id = NULL,
        updated_at = now()
    FROM prior
    WHERE a.id = prior.id
    RETURNING a.*, prior.status AS from_status
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    SELECT id, generation, $2, 'release', from_status, status, 'committed', $3 FROM updated
), woken AS (
    SELECT pg_notify('hubd_wake', $1)
)
SELECT updated.* FROM updated, woken;

-- name: claim_due
-- Lease up to one due active row per lease id in $1 (a text[]), oldest first, skipping rows not
-- in the exclusion list ($3) and rows another claimer has locked: one statement fills every free
-- claim slot. Each row gets the lease id at its position. Served by hubd_allocations_due_idx.
WITH due AS (
    SELECT id, row_number() OVER (ORDER BY next_attempt_at, id) AS slot
    FROM (
        SELECT id, next_attempt_at FROM hubd_allocations
        WHERE next_attempt_at IS NOT NULL
          AND next_attempt_at <= now()
          AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
          AND (lease_expires_at IS NULL OR lease_expires_at <= now())
          AND id <> ALL ($3::text[])
        ORDER BY next_attempt_at, id
        LIMIT cardinality($1::text[])
        FOR UPDATE SKIP LOCKED
    ) AS locked
)
UPDATE hubd_allocations AS a SET
    lease_id = leases.lease_id,
    lease_expires_at = now() + make_interval(secs => $2),
    updated_at = now()
FROM due
JOIN unnest($1::text[]) WITH ORDINALITY AS leases (lease_id, slot) ON leases.slot = due.slot
WHERE a.id = due.id
RETURNING a.*;

-- name: renew_leases
-- Extend, in one statement, every lease in the pairs ($1 ids, $2 lease ids) that is still held
-- and live; returns the ids renewed. Rows are locked in id order, so two renewals (or a
-- renewal and a set statement) never deadlock.
WITH held AS (
    SELECT a.id FROM hubd_allocations AS a
    JOIN unnest($1::text[], $2::text[]) AS mine (id, lease_id)
      ON a.id = mine.id AND a.lease_id = mine.lease_id
    WHERE a.lease_expires_at > clock_timestamp()
    ORDER BY a.id
    FOR UPDATE OF a
)
UPDATE hubd_allocations AS a
SET lease_expires_at = now() + make_interval(secs => $3)
FROM held
WHERE a.id = held.id AND a.lease_expires_at > clock_timestamp()
RETURNING a.id;

-- name: drop_lease
-- Give a lease back without any other change, so the row is claimable at once: a claim that
-- found local work still running on its allocation must not hold the row for a whole lease.
UPDATE hubd_allocations
SET lease_id = NULL, lease_expires_at = NULL
WHERE id = $1 AND lease_id = $2
RETURNING id;

-- name: bind_initial_sidecar
-- pending → provisioning: bind the provisioner if unbound ($8 api version, $9 fingerprint) and a
-- new sidecar identity ($5 id, $6 token hash) with a connect deadline $7 seconds away.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'provisioning',
        provisioner_api_version = COALESCE(provisioner_api_version, $8),
        provisioner_binding_fingerprint = COALESCE(provisioner_binding_fingerprint, $9),
        sidecar_id = $5,
        token_hash = $6,
        external_ref = NULL,
        connect_deadline = now() + make_interval(secs => $7),
        connection_ready = false,
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = 'pending'
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase)
    SELECT id, generation, $2, $4, 'bind_sidecar', 'pending', status, 'committed' FROM updated
)
SELECT * FROM updated;

-- name: bind_replacement_sidecar
-- replacing → provisioning once the old sidecar is destroyed: a new identity for this generation.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'provisioning',
        sidecar_id = $5,
        token_hash = $6,
        external_ref = NULL,
        connect_deadline = now() + make_interval(secs => $7),
        connection_ready = false,
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = 'replacing'
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase)
    SELECT id, generation, $2, $4, 'bind_replacement_sidecar', 'replacing', status, 'committed'
    FROM updated
)
SELECT * FROM updated;

-- name: mark_allocated
-- provisioning → allocated: the provisioner accepted ensure ($5 external reference).
WITH updated AS (
    UPDATE hubd_allocations SET status = 'allocated', external_ref = $5, updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = 'provisioning'
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase)
    SELECT id, generation, $2, $4, 'mark_allocated', 'provisioning', status, 'committed'
    FROM updated
)
SELECT * FROM updated;

-- name: begin_initialization
-- Record, before the on-ready hook runs, that this lease is initializing the sidecar; a crash
-- before mark_connection_ready leaves the marker for the next claim to find.
WITH updated AS (
    UPDATE hubd_allocations SET initialization_lease_id = $2, updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = 'allocated' AND initialization_lease_id IS NULL
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase)
    SELECT id, generation, $2, $4, 'begin_initialization', 'allocated', status, 'committed'
    FROM updated
)
SELECT * FROM updated;

-- name: mark_connection_ready
-- Finish initialization. Ready only if no connection was recorded or cleared since the claim
-- looked ($5, the allocation's connection number then): a connect that landed meanwhile, on any
-- replica, may be a restarted sidecar whose takeover hid its disconnect, and a disconnect means
-- it is gone. Then the write becomes an immediate follow-up instead (due now, ledger kind
-- 'follow_up'), so the next claim looks again. Either way the initialization marker is settled
-- and the lease dropped; on ready, attempt counters and the last failure are reset.
WITH updated AS (
    UPDATE hubd_allocations SET
        connection_ready = (connection_seq = $5),
        initialization_lease_id = NULL,
        connect_deadline = CASE WHEN connection_seq = $5 THEN NULL ELSE connect_deadline END,
        next_attempt_at = CASE WHEN connection_seq = $5 THEN NULL ELSE now() END,
        lease_id = NULL,
        lease_expires_at = NULL,
        ensure_attempts = CASE WHEN connection_seq = $5 THEN 0 ELSE ensure_attempts END,
        destroy_attempts = CASE WHEN connection_seq = $5 THEN 0 ELSE destroy_attempts END,
        failure_code = CASE WHEN connection_seq = $5 THEN NULL ELSE failure_code END,
        failure_message = CASE WHEN connection_seq = $5 THEN NULL ELSE failure_message END,
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = 'allocated'
      AND (initialization_lease_id IS NULL OR initialization_lease_id = $2)
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase,
         message)
    SELECT id, generation, $2, $4, CASE WHEN connection_ready THEN 'mark_ready' ELSE 'follow_up' END,
        'allocated', status, 'committed',
        CASE WHEN connection_ready THEN NULL
             ELSE 'a connection was recorded or lost during initialization' END
    FROM updated
)
SELECT * FROM updated;

-- name: schedule_retry
-- Try again after $6 seconds in status $5; $7 names the attempt counter to bump ('ensure',
-- 'destroy' or NULL); $8/$9 record the failure that caused it, when given; $10 clears an
-- initialization marker this claim settled (the hook finished or failed cleanly). Drops the lease.
WITH updated AS (
    UPDATE hubd_allocations SET
        next_attempt_at = now() + make_interval(secs => $6),
        initialization_lease_id = CASE WHEN $10 THEN NULL ELSE initialization_lease_id END,
        ensure_attempts = ensure_attempts + CASE WHEN $7::text = 'ensure' THEN 1 ELSE 0 END,
        destroy_attempts = destroy_attempts + CASE WHEN $7::text = 'destroy' THEN 1 ELSE 0 END,
        failure_code = COALESCE($8, failure_code),
        failure_message = CASE WHEN $8::text IS NULL THEN failure_message ELSE $9 END,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = $5
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, $2, $4, 'schedule_retry', status, status, 'committed', $8, $9
    FROM updated
)
SELECT * FROM updated;

-- name: park
-- Nothing to do until something happens: drop the lease and come back at the connect deadline
-- ($5 = 'await_connection', falling back to $6 seconds) or after $6 seconds ('retry_after_error',
-- recording $7/$8 as the failure). Awaiting a connection is fenced on the connection number the
-- claim last saw ($9, when given): if a connection was recorded or cleared since, on any replica,
-- the row is due now instead (ledger kind 'follow_up'), so no connect is slept through.
WITH updated AS (
    UPDATE hubd_allocations SET
        next_attempt_at = CASE
            WHEN $5::text = 'await_connection' AND connection_seq <> $9::bigint
                THEN now()
            WHEN $5::text = 'await_connection'
                THEN COALESCE(connect_deadline, now() + make_interval(secs => $6))
            ELSE now() + make_interval(secs => $6) END,
        failure_code = COALESCE($7, failure_code),
        failure_message = CASE WHEN $7::text IS NULL THEN failure_message ELSE $8 END,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, $2, $4,
        CASE WHEN $5::text = 'await_connection' AND connection_seq <> $9::bigint
             THEN 'follow_up' ELSE 'park_' || $5::text END,
        status, status, 'committed', $7, $8
    FROM updated
)
SELECT * FROM updated;

-- name: begin_replacement
-- Abandon the current sidecar: → replacing under a new generation, due in $6 seconds, failure
-- $7/$8. With $9, only while an initialization is still recorded (and, given $10, by that lease).
-- Given $11, only while the connection number is still $11: a sidecar that connected (anywhere)
-- since the claim saw it absent is never abandoned for not connecting.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'replacing',
        generation = generation + 1,
        ensure_attempts = ensure_attempts + 1,
        next_attempt_at = now() + make_interval(secs => $6),
        failure_code = $7,
        failure_message = $8,
        connection_ready = false,
        initialization_lease_id = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = $5
      AND (NOT $9 OR (initialization_lease_id IS NOT NULL
                      AND initialization_lease_id = COALESCE($10, initialization_lease_id)))
      AND ($11::bigint IS NULL OR connection_seq = $11)
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, $2, $4, 'begin_replacement', $5, status, 'committed', $7, $8
    FROM updated
)
SELECT * FROM updated;

-- name: begin_unrecoverable_release
-- allocated → releasing under a new generation when automatic replacement recovery is off;
-- $5/$6 the failure, $7/$8/$9 as $9/$10/$11 of begin_replacement.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'releasing',
        generation = generation + 1,
        next_attempt_at = now(),
        failure_code = $5,
        failure_message = $6,
        connection_ready = false,
        initialization_lease_id = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = 'allocated'
      AND (NOT $7 OR (initialization_lease_id IS NOT NULL
                      AND initialization_lease_id = COALESCE($8, initialization_lease_id)))
      AND ($9::bigint IS NULL OR connection_seq = $9)
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, $2, $4, 'begin_unrecoverable_release', 'allocated', status,
        'committed', $5, $6
    FROM updated
)
SELECT * FROM updated;

-- name: fail_without_infrastructure
-- $5 → failed with failure $6/$7: nothing was provisioned, so nothing needs destroying.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'failed',
        failure_code = $6,
        failure_message = $7,
        connection_ready = false,
        initialization_lease_id = NULL,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = $5
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, $2, $4, 'fail', $5, status, 'committed', $6, $7 FROM updated
)
SELECT * FROM updated;

-- name: mark_destroy_failed
-- replacing/releasing → destroy_failed ($5/$6): an operator must look, infrastructure may leak.
WITH prior AS (
    SELECT id, status FROM hubd_allocations
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status IN ('replacing', 'releasing')
    FOR UPDATE
), updated AS (
    UPDATE hubd_allocations AS a SET
        status = 'destroy_failed',
        failure_code = $5,
        failure_message = $6,
        connection_ready = false,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    FROM prior
    WHERE a.id = prior.id
    RETURNING a.*, prior.status AS from_status
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, $2, $4, 'mark_destroy_failed', from_status, status, 'committed', $5, $6
    FROM updated
)
SELECT updated.* FROM updated;

-- name: mark_released
-- releasing → released once the sidecar is destroyed.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'released',
        connection_ready = false,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
      AND status = 'releasing'
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase)
    SELECT id, generation, $2, $4, 'mark_released', 'releasing', status, 'committed' FROM updated
)
SELECT * FROM updated;

-- name: wake
-- Make generation $2 due now (a sidecar connected, or a repair) and tell the daemons.
WITH updated AS (
    UPDATE hubd_allocations SET next_attempt_at = now(), updated_at = now()
    WHERE id = $1 AND generation = $2
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
      AND (next_attempt_at IS NULL OR next_attempt_at > now())
    RETURNING id
), woken AS (
    SELECT pg_notify('hubd_wake', id) FROM updated
)
SELECT count(*) > 0 FROM updated, woken;

-- name: mark_unconnected
-- Start-up repair and the repair sweep: allocated rows that read ready, or that nothing will ever
-- revisit (no schedule), although no live connection record exists for their generation (none,
-- or only on instances other than the caller's own, $3, whose heartbeat is older than $1
-- seconds: the caller knows its own sockets are open). Each gets until its connect
-- deadline (or $2 seconds). Only rows no claim holds (a claim's lease decides for itself), and
-- fenced on the connection number each was found with: a record written meanwhile bumps it, and
-- the join below then no longer matches when the row lock is taken.
WITH candidates AS (
    SELECT a.id, a.generation, a.connection_seq FROM hubd_allocations AS a
    WHERE a.status = 'allocated'
      AND (a.connection_ready OR a.next_attempt_at IS NULL)
      AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= now())
      AND NOT EXISTS (
          SELECT 1 FROM hubd_sidecar_connections AS c
          JOIN hubd_instances AS i ON i.id = c.instance_id
          WHERE c.allocation_id = a.id AND c.generation = a.generation
            AND (i.heartbeat_at > now() - make_interval(secs => $1) OR c.instance_id = $3))
), updated AS (
    UPDATE hubd_allocations AS a SET
        connection_ready = false,
        connect_deadline = COALESCE(a.connect_deadline, now() + make_interval(secs => $2)),
        next_attempt_at = LEAST(a.next_attempt_at,
                                COALESCE(a.connect_deadline, now() + make_interval(secs => $2))),
        updated_at = now()
    FROM candidates AS c
    WHERE a.id = c.id AND a.generation = c.generation AND a.connection_seq = c.connection_seq
      AND a.status = 'allocated'
      AND (a.connection_ready OR a.next_attempt_at IS NULL)
      AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= clock_timestamp())
    RETURNING a.*
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    SELECT id, generation, $3, 'connection_lost', 'allocated', status, 'committed',
           'no live connection record'
    FROM updated
)
SELECT * FROM updated;

-- name: sidecar_owners
-- For each sidecar a provisioner reports ($1[i], naming allocation $2[i], '' when it names none):
-- whether it is the current sidecar of an active allocation, and whether the allocation it names
-- exists in this database at all (a sidecar of another deployment must not look like ours).
SELECT s.sidecar_id,
       EXISTS (SELECT 1 FROM hubd_allocations AS a
               WHERE a.sidecar_id = s.sidecar_id
                 AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing',
                                  'releasing')) AS current,
       EXISTS (SELECT 1 FROM hubd_allocations AS a WHERE a.id = s.allocation_id) AS known
FROM unnest($1::text[], $2::text[]) AS s (sidecar_id, allocation_id);

-- name: try_sweep_lock
-- One sweeper per provisioner across replicas: a session advisory lock, released by
-- release_sweep_lock or by the session's end (a crashed sweeper holds nothing).
SELECT pg_try_advisory_lock(hashtext('hubd_orphans'), hashtext($1));

-- name: release_sweep_lock
SELECT pg_advisory_unlock(hashtext('hubd_orphans'), hashtext($1));

-- name: get_allocation
SELECT * FROM hubd_allocations WHERE id = $1;

-- name: list_active
-- Every active row, for start-up repair and the repair sweep.
SELECT * FROM hubd_allocations
WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
ORDER BY id;

-- name: list_allocations
-- Newest first, optionally of one status ($1), at most $2 rows.
SELECT * FROM hubd_allocations
WHERE ($1::text IS NULL OR status = $1)
ORDER BY created_at DESC, id
LIMIT $2;

-- name: count_active
-- Exact counts of the active statuses. Served by hubd_allocations_status_idx (an index-only range
-- over the active statuses), so the cost follows the number of active rows, not the table's.
SELECT status, count(*) AS n FROM hubd_allocations
WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
GROUP BY status;

-- name: estimate_statuses
-- Every status's share of the table as the planner's statistics last saw it (refreshed by
-- autovacuum's ANALYZE), times the table's estimated size: a flat-cost estimate for the terminal
-- statuses, whose exact count would scan every row ever finished. No row before the first ANALYZE.
SELECT vals.status, round(vals.freq * greatest(c.reltuples, 0))::bigint AS n
FROM pg_class AS c
JOIN pg_namespace AS ns ON ns.oid = c.relnamespace
JOIN pg_stats AS s
  ON s.schemaname = ns.nspname AND s.tablename = c.relname AND s.attname = 'status'
CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs)
    AS vals (status, freq)
WHERE c.oid = 'hubd_allocations'::regclass;
