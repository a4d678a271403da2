-- The sweeps over hubd_allocations, which any replica may run and none owns: the deadline sweep
-- (lifetimes, idle and provisioning deadlines), the repair sweep (rows that read ready with no
-- live connection, the reconnect windows of a lost instance's sidecars), orphan collection (which
-- reported sidecars are still ours), a provisioner's report of dead sidecars, and the row locks
-- that elect one sweeper per provisioner. Each decides in its own statement, so two replicas
-- sweeping at once move each row once.

-- name: report_exits
-- The sidecars :sidecar_ids[i] of generation :generations[i] of :allocation_ids[i] died, as their
-- provisioner reported (:messages[i] says how, with the tail of their output). Each row is
-- written only while that generation and sidecar are current, provisioning or allocated, and
-- not yet reported: the report of a sidecar hubd itself destroyed (the generation moved on, or
-- the row is releasing) matches nothing. A matched row keeps the message (exit_message), reads
-- not connected from now on (hubd_sidecar_live), has its connect deadline passed and its
-- connection number bumped (a claim that looked before decides again), is due at once unless a
-- claim holds it, and gets a committed ledger row 'sidecar_exited' by :instance_id. The rows
-- are locked one by one in allocation id order before any is written, as every multi-row
-- statement takes them. Returns the rows written (id, generation).
WITH input AS (
    SELECT *
    FROM unnest(:allocation_ids::text[], :generations::integer[], :sidecar_ids::text[],
                :messages::text[]) AS i (allocation_id, generation, sidecar_id, message)
    ORDER BY allocation_id
), locked AS (
    SELECT a.id, i.message
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT id FROM hubd_allocations
        WHERE id = i.allocation_id AND generation = i.generation AND sidecar_id = i.sidecar_id
          AND status IN ('provisioning', 'allocated') AND exited_at IS NULL
        LIMIT 1
        FOR NO KEY UPDATE
    ) AS a
), updated AS (
    UPDATE hubd_allocations AS a SET
        exit_message = l.message,
        exited_at = now(),
        connection_seq = a.connection_seq + 1,
        connection_ready = false,
        connect_deadline = now(),
        next_attempt_at = CASE WHEN a.lease_expires_at IS NULL
                                    OR a.lease_expires_at <= clock_timestamp()
                               THEN now() ELSE a.next_attempt_at END,
        updated_at = now()
    FROM locked AS l
    WHERE a.id = l.id AND a.id = ANY (:allocation_ids::text[])
    RETURNING a.id, a.generation, a.status, a.provisioner_id, l.message
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, error_code,
         message)
    SELECT id, generation, :instance_id, 'sidecar_exited', status, status, 'committed',
           'sidecar_exited', message
    FROM updated
), notified AS (
    SELECT pg_notify('hubd_wake', d.provisioner_id)
    FROM (SELECT DISTINCT provisioner_id FROM updated) AS d
)
SELECT u.id, u.generation, (SELECT count(*) FROM notified) AS notified FROM updated AS u;

-- name: sweep_deadlines
-- Every deadline that has come, decided here whichever replica runs it first (a row is moved
-- once: the next run finds it moved). An active allocation whose expires_at has passed, or a
-- ready-once allocated one whose idle_at has (no activity for its idle_timeout), ends as a
-- release does (pending: released at once; otherwise releasing under a new generation, due
-- now), with end_reason 'expired' or 'idle' and a ledger row 'expire'. One claimed but not
-- ready for its provisioner's provisioning_timeout since its provisioning clock started
-- (starting_since; for a taken pool member that must declare, the take, until its sidecar
-- acknowledged its session) is given up: releasing under a new generation with give_up set, so it ends
-- failed, failure and end_reason 'provisioning_timeout', ledger 'give_up'. A pending one older
-- than its provisioner's pending_timeout (else :pending_timeout seconds; 0: none) fails as
-- 'unserved', nothing having been bound. One whose nearer end is :warning seconds away or less
-- is marked expiring (an 'expiring' event). At most :batch rows of each, oldest first,
-- skipping rows another statement holds (the next run takes them). Returns how many of each
-- moved, the seconds until the next end or warning known now (NULL: none), and whether any
-- allocation is active at all (one that is not may never come due: the caller may wait for a
-- request's notification instead of running again).
WITH limits AS (
    SELECT l.provisioner_id, l.pending_timeout, l.provisioning_timeout
    FROM hubd_provisioner_limits AS l
), due_expired AS (
    SELECT a.id FROM hubd_allocations AS a
    WHERE a.expires_at IS NOT NULL AND a.expires_at <= now()
      AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing')
    ORDER BY a.expires_at
    LIMIT :batch
    FOR NO KEY UPDATE SKIP LOCKED
), due_idle AS (
    SELECT a.id FROM hubd_allocations AS a
    WHERE a.idle_at IS NOT NULL AND a.idle_at <= now() AND a.status = 'allocated'
      AND a.id <> ALL (ARRAY(SELECT id FROM due_expired))
    ORDER BY a.idle_at
    LIMIT :batch
    FOR NO KEY UPDATE SKIP LOCKED
), ended AS (
    UPDATE hubd_allocations AS a SET
        status = CASE WHEN a.status = 'pending' THEN 'released' ELSE 'releasing' END::hubd_status,
        generation = CASE WHEN a.status = 'pending' THEN a.generation ELSE a.generation + 1 END,
        next_attempt_at = CASE WHEN a.status = 'pending' THEN NULL ELSE now() END,
        lease_id = CASE WHEN a.status = 'pending' THEN NULL ELSE a.lease_id END,
        lease_expires_at = CASE WHEN a.status = 'pending' THEN NULL ELSE a.lease_expires_at END,
        finished_at = CASE WHEN a.status = 'pending' THEN now() END,
        connection_ready = false,
        initialization_lease_id = NULL,
        end_reason = coalesce(a.end_reason, CASE WHEN a.expires_at <= now() THEN 'expired'
                                                 ELSE 'idle' END),
        updated_at = now()
    WHERE a.id = ANY (ARRAY(SELECT id FROM due_expired) || ARRAY(SELECT id FROM due_idle))
    RETURNING a.id, a.generation, a.status, a.provisioner_id, a.expires_at, a.idle_at,
              a.idle_timeout
), due_starting AS (
    SELECT a.id FROM hubd_allocations AS a
    JOIN limits AS l ON l.provisioner_id = a.provisioner_id
    WHERE a.starting_since IS NOT NULL
      AND a.starting_since < now() - make_interval(secs => l.provisioning_timeout)
      AND a.status IN ('provisioning', 'allocated', 'replacing')
      AND (NOT a.connection_ready OR a.handover_pending)
      AND a.id <> ALL (ARRAY(SELECT id FROM due_expired) || ARRAY(SELECT id FROM due_idle))
    ORDER BY a.starting_since
    LIMIT :batch
    FOR NO KEY UPDATE OF a SKIP LOCKED
), gave_up AS (
    UPDATE hubd_allocations AS a SET
        status = 'releasing',
        generation = a.generation + 1,
        next_attempt_at = now(),
        give_up = true,
        connection_ready = false,
        initialization_lease_id = NULL,
        failure_code = 'provisioning_timeout',
        failure_message = format('not ready within %s s of its claim (provisioning_timeout)',
            round(extract(epoch FROM now() - a.starting_since)::numeric)),
        end_reason = coalesce(a.end_reason, 'provisioning_timeout'),
        updated_at = now()
    WHERE a.id = ANY (ARRAY(SELECT id FROM due_starting))
    RETURNING a.id, a.generation, a.provisioner_id, a.failure_message
), unserved AS (
    SELECT a.id FROM hubd_allocations AS a
    LEFT JOIN limits AS l ON l.provisioner_id = a.provisioner_id
    WHERE a.status = 'pending' AND a.created_at IS NOT NULL
      AND a.created_at < now() - make_interval(secs => coalesce(l.pending_timeout,
                                                           nullif(:pending_timeout::float8, 0)))
      AND a.id <> ALL (ARRAY(SELECT id FROM due_expired))
    ORDER BY a.created_at
    LIMIT :batch
    FOR NO KEY UPDATE OF a SKIP LOCKED
), failed AS (
    UPDATE hubd_allocations AS a SET
        status = 'failed',
        failure_code = 'unserved',
        failure_message = format('no daemon serving provisioner %s took it within %s s',
            quote_literal(a.provisioner_id),
            round(extract(epoch FROM now() - a.created_at)::numeric)),
        end_reason = 'unserved',
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    FROM unserved AS u
    WHERE a.id = u.id AND a.id = ANY (ARRAY(SELECT id FROM unserved))
    RETURNING a.id, a.generation, a.failure_message
), warn_life AS (
    SELECT w.id FROM hubd_allocations AS w
    WHERE w.expires_at IS NOT NULL
      AND w.expires_at <= now() + make_interval(secs => :warning::float8)
      AND w.expires_at > now()
      AND w.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
      AND NOT w.expiring
    ORDER BY w.expires_at
    LIMIT :batch
    FOR NO KEY UPDATE SKIP LOCKED
), warn_idle AS (
    SELECT w.id FROM hubd_allocations AS w
    WHERE w.idle_at IS NOT NULL
      AND w.idle_at <= now() + make_interval(secs => :warning::float8)
      AND w.idle_at > now()
      AND w.status = 'allocated'
      AND NOT w.expiring
      AND w.id <> ALL (ARRAY(SELECT id FROM warn_life))
    ORDER BY w.idle_at
    LIMIT :batch
    FOR NO KEY UPDATE SKIP LOCKED
), warned AS (
    UPDATE hubd_allocations AS a SET expiring = true, updated_at = now()
    WHERE a.id = ANY (ARRAY(SELECT id FROM warn_life) || ARRAY(SELECT id FROM warn_idle))
      AND a.id <> ALL (ARRAY(SELECT id FROM due_expired) || ARRAY(SELECT id FROM due_idle)
                       || ARRAY(SELECT id FROM due_starting))
    RETURNING a.id
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase,
         error_code, message)
    SELECT e.id, e.generation, :instance_id, 'expire', NULL, e.status, 'committed', NULL,
           CASE WHEN e.expires_at <= now()
                THEN 'its lifetime ended at ' || to_char(e.expires_at AT TIME ZONE 'UTC',
                                                        'YYYY-MM-DD"T"HH24:MI:SS"Z"')
                ELSE format('idle since %s (idle_timeout %s s)',
                            to_char((e.idle_at - make_interval(secs => e.idle_timeout))
                                    AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                            round(e.idle_timeout::numeric, 3)) END
    FROM ended AS e
    UNION ALL
    SELECT g.id, g.generation, :instance_id, 'give_up', NULL, 'releasing', 'committed',
           'provisioning_timeout', g.failure_message
    FROM gave_up AS g
    UNION ALL
    SELECT f.id, f.generation, :instance_id, 'fail', 'pending', 'failed', 'committed',
           'unserved', f.failure_message
    FROM failed AS f
), woken AS (
    SELECT pg_notify('hubd_wake', d.provisioner_id)
    FROM (SELECT provisioner_id FROM ended WHERE status = 'releasing'
          UNION SELECT provisioner_id FROM gave_up) AS d
)
SELECT (SELECT count(*) FROM ended WHERE expires_at <= now()) AS expired,
       (SELECT count(*) FROM ended WHERE NOT coalesce(expires_at <= now(), false)) AS idle,
       (SELECT count(*) FROM gave_up) AS provisioning_timeout,
       (SELECT count(*) FROM failed) AS unserved,
       (SELECT count(*) FROM warned) AS warned,
       (SELECT count(*) FROM woken) AS woken,
       EXISTS (SELECT 1 FROM hubd_allocations AS x
               WHERE x.status IN ('pending', 'provisioning', 'allocated', 'replacing',
                                  'releasing')) AS active,
       -- The next moment this statement has something to do, among the earliest ends: a warning
       -- not yet given, or an end.
       extract(epoch FROM least(
           (SELECT min(CASE WHEN n.expiring THEN n.expires_at
                            ELSE n.expires_at - make_interval(secs => :warning::float8) END)
            FROM (
                SELECT x.expires_at, x.expiring FROM hubd_allocations AS x
                WHERE x.expires_at IS NOT NULL
                  AND x.status IN ('pending', 'provisioning', 'allocated', 'replacing',
                                   'releasing')
                  AND x.status <> 'releasing'
                ORDER BY x.expires_at
                LIMIT 8) AS n),
           (SELECT min(CASE WHEN n.expiring THEN n.idle_at
                            ELSE n.idle_at - make_interval(secs => :warning::float8) END)
            FROM (
                SELECT x.idle_at, x.expiring FROM hubd_allocations AS x
                WHERE x.idle_at IS NOT NULL AND x.status = 'allocated'
                ORDER BY x.idle_at
                LIMIT 8) AS n)) - now())::float8 AS next_in;

-- name: mark_unconnected
-- Start-up repair and the repair sweep: allocated rows that read ready, or that nothing will ever
-- revisit (no schedule), although no live connection record exists for their generation (none, or
-- only on instances other than the caller's own, :instance_id, whose heartbeat is older than
-- :instance_ttl seconds or whose row is gone: the caller knows its own sockets are open, as park
-- and readiness do). Each gets until its connect deadline (or :connect_timeout seconds). Only
-- rows no claim holds (a claim's lease decides for itself), and fenced on the generation and
-- connection number each was found with: a record written meanwhile bumps the number, and the
-- update below then no longer matches when the row lock is taken.
-- Its plan is made once, on a daemon's first use, from whatever the statistics said then: on a
-- quiet database, that no row is allocated and no record exists. Both lookups are written so
-- that no plan can read more than the rows it needs. The record check is the function that is
-- never inlined, which reads each row's own record by key; written as a join, the planner read
-- every record for every allocated row. The candidates reach the update as one array, computed
-- once before it reads a row, and are found by key; joined back as rows, each candidate read
-- every allocated row. Together 19,900,000 pages for 3,000 rows in the test, now 33,000.
WITH candidates AS (
    SELECT a.id, a.generation, a.connection_seq FROM hubd_allocations AS a
    WHERE a.status = 'allocated'
      AND (a.connection_ready OR a.next_attempt_at IS NULL)
      AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= now())
      AND NOT hubd_sidecar_live(a.id, a.generation, :instance_ttl, :instance_id)
), found AS (
    SELECT array_agg(id) AS ids,
           jsonb_object_agg(id, jsonb_build_array(generation, connection_seq)) AS seen
    FROM candidates
), updated AS (
    UPDATE hubd_allocations AS a SET
        connection_ready = false,
        connect_deadline =
            COALESCE(a.connect_deadline, now() + make_interval(secs => :connect_timeout)),
        next_attempt_at = LEAST(
            a.next_attempt_at,
            COALESCE(a.connect_deadline, now() + make_interval(secs => :connect_timeout))),
        updated_at = now()
    WHERE a.id = ANY ((SELECT ids FROM found)::text[])
      AND (SELECT seen FROM found) -> a.id = jsonb_build_array(a.generation, a.connection_seq)
      AND a.status = 'allocated'
      AND (a.connection_ready OR a.next_attempt_at IS NULL)
      AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= clock_timestamp())
    RETURNING a.*
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    SELECT id, generation, :instance_id, 'connection_lost', 'allocated', status, 'committed',
           'no live connection record'
    FROM updated
)
SELECT * FROM updated;

-- name: sidecar_owners
-- For each sidecar a provisioner reports (:sidecar_ids[i], naming allocation :allocation_ids[i], ''
-- when it names none): whether it is the current sidecar of an active allocation, and whether the
-- allocation it names exists in this database at all (a sidecar of another deployment must not look
-- like ours).
-- Each lookup also names its rows by key (= ANY ...): a plan made on a table the statistics call
-- empty may otherwise hash every row of the table once per sweep, finished ones included.
SELECT s.sidecar_id,
       EXISTS (SELECT 1 FROM hubd_allocations AS a
               WHERE a.sidecar_id = s.sidecar_id AND a.sidecar_id = ANY (:sidecar_ids::text[])
                 AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing',
                                  'releasing')) AS current,
       EXISTS (SELECT 1 FROM hubd_allocations AS a
               WHERE a.id = s.allocation_id AND a.id = ANY (:allocation_ids::text[])) AS known
FROM unnest(:sidecar_ids::text[], :allocation_ids::text[]) AS s (sidecar_id, allocation_id);

-- name: add_sweep_lock
-- The row whose lock elects :lock_name's sweeper, made once (committed on its own, so the next
-- statement's lock finds it).
INSERT INTO hubd_sweep_locks (name) VALUES (:lock_name) ON CONFLICT (name) DO NOTHING;

-- name: try_sweep_lock
-- One sweeper per provisioner across replicas: the row's lock, held by the sweeper's transaction
-- until it ends or its connection does (a crashed sweeper holds nothing). No application role
-- can lock the row, as it could an advisory key. No row: another replica sweeps.
SELECT name FROM hubd_sweep_locks WHERE name = :lock_name FOR UPDATE SKIP LOCKED;

-- name: open_reconnect_windows
-- At a start that finds no other instance that is live (heartbeated within :instance_ttl
-- seconds) and has been up for :window seconds: no hub could take a sidecar back while this one
-- was away, so each allocated row whose sidecar holds no live record gets until :window seconds
-- from now to reconnect, whenever its deadline fell. A stop is not a failure: the deadline a
-- clean stop wrote, or that start-up repair just gave, ran while the sidecars knocked on a closed
-- door. Rows a claim holds decide for themselves. A peer up for the window gave the sidecars a
-- hub to return to, and their deadlines stand; a peer that started with this one (replicas
-- restarted together) did not, and does not count.
-- Returns the rows whose deadline moved.
-- The claim that watched the old deadline is moved to the new one; one scheduled earlier for
-- something else keeps its time.
UPDATE hubd_allocations AS a SET
    connect_deadline = now() + make_interval(secs => :window),
    next_attempt_at = CASE WHEN a.next_attempt_at IS NULL
                                OR a.next_attempt_at >= a.connect_deadline
                           THEN now() + make_interval(secs => :window)
                           ELSE a.next_attempt_at END,
    updated_at = now()
WHERE a.status = 'allocated'
  AND a.connect_deadline IS NOT NULL
  AND a.connect_deadline < now() + make_interval(secs => :window)
  AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= now())
  AND a.exited_at IS NULL
  AND NOT hubd_sidecar_live(a.id, a.generation, :instance_ttl, :instance_id)
  AND NOT EXISTS (
      SELECT 1 FROM hubd_instances AS i
      WHERE i.id <> :instance_id
        AND i.heartbeat_at > now() - make_interval(secs => :instance_ttl)
        AND i.started_at <= now() - make_interval(secs => :window))
RETURNING a.id;
