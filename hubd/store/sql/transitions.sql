-- The fenced transitions of a claim on hubd_allocations, each one statement (architecture §1
-- names which follows what). The table's other statements are in allocations.sql (requests,
-- reads), sweeps.sql (deadlines, repair) and claims.sql (claims and leases).
-- Every transition appends its ledger row in the same statement (a data-modifying CTE), so a
-- transition and its evidence commit or vanish together.
-- Claim-owned writes are fenced on :allocation_id, :lease_id and :generation, and a lease still
-- live by the database clock ({fence}, or, in a set form, the same per row); :instance_id is the
-- hub written to the ledger. The fence reads clock_timestamp(), not now(): a write that waited on
-- a row lock is re-checked at the moment it proceeds, not at the moment its statement started.
-- The fragments below are put in where a statement names them, at load time (hubd.store.queries).
-- A transition that brackets a plugin call also writes the call's ledger rows (:effects, a JSON
-- array; see EffectRow): the intent with the bind that makes the call due, the outcome with the
-- transition that follows from it. hubd_ledger_rows (schema.sql) puts them in order around the
-- transition's own row.

-- fragment: fence
-- A claim's fence (architecture §2): the row it leased, under its lease, still live by the
-- database clock, at its generation. Each statement adds the status it moves from.
id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()

-- fragment: log_updated
-- The head of a transition's ledger insert: the rows of the hubd_ledger_rows call that follows
-- it (the transition's own row, kind and statuses, around the plugin call's :effects) for the
-- updated row, under the claim's lease and written by this hub.
INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,

-- name: bind_initial_sidecar
-- pending → provisioning: bind the provisioner if unbound (:api_version, :binding_fingerprint)
-- and a new sidecar identity (:sidecar_id, :token_hash) with a connect deadline :connect_timeout
-- seconds away; a row that did not ask how it becomes ready gets :ready_when, the provisioner's
-- default.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'provisioning',
        provisioner_api_version = COALESCE(provisioner_api_version, :api_version),
        provisioner_binding_fingerprint =
            COALESCE(provisioner_binding_fingerprint, :binding_fingerprint),
        sidecar_id = :sidecar_id,
        token_hash = :token_hash,
        external_ref = NULL,
        exit_message = NULL,
        exited_at = NULL,
        connect_deadline = now() + make_interval(secs => :connect_timeout),
        connection_ready = false,
        ready_when = COALESCE(ready_when, :ready_when::text),
        updated_at = now()
    WHERE {fence}
      AND status = 'pending'
    RETURNING *
), logged AS (
    {log_updated}
        hubd_ledger_rows(:effects::text::jsonb, 'bind_sidecar', 'pending', status) AS r
)
SELECT * FROM updated;

-- name: bind_replacement_sidecar
-- replacing → provisioning once the old sidecar is destroyed: a new identity for this generation.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'provisioning',
        sidecar_id = :sidecar_id,
        token_hash = :token_hash,
        external_ref = NULL,
        exit_message = NULL,
        exited_at = NULL,
        connect_deadline = now() + make_interval(secs => :connect_timeout),
        connection_ready = false,
        updated_at = now()
    WHERE {fence}
      AND status = 'replacing'
    RETURNING *
), logged AS (
    {log_updated}
        hubd_ledger_rows(:effects::text::jsonb, 'bind_replacement_sidecar', 'replacing',
            status) AS r
)
SELECT * FROM updated;

-- name: mark_allocated
-- provisioning → allocated: the provisioner accepted ensure (:external_ref), with what it knows
-- of the sidecar (:endpoint, :metadata as JSON text; NULL: nothing). A sidecar may connect and
-- publish before the acceptance is written, and its own word is the later one: the endpoint
-- fills only what the generation's sidecar has not published, and the metadata is the
-- provisioner's with the sidecar's keys over it, keys it removed staying removed
-- (hubd_accepted_metadata, from the patch its publishes kept, which the acceptance clears).
WITH updated AS (
    UPDATE hubd_allocations
    SET status = 'allocated', external_ref = :external_ref,
        endpoint = COALESCE(endpoint, :endpoint::text),
        metadata = hubd_accepted_metadata(:metadata::text::jsonb, sidecar_patch, metadata),
        sidecar_patch = NULL,
        updated_at = now()
    WHERE {fence}
      AND status = 'provisioning'
    RETURNING *
), logged AS (
    {log_updated}
        hubd_ledger_rows(:effects::text::jsonb, 'mark_allocated', 'provisioning', status) AS r
)
SELECT * FROM updated;

-- name: begin_initialization
-- Record, before the on-ready hook runs, that this lease is initializing the sidecar; a crash
-- before mark_connection_ready leaves the marker for the next claim to find.
WITH updated AS (
    UPDATE hubd_allocations SET initialization_lease_id = :lease_id, updated_at = now()
    WHERE {fence}
      AND status = 'allocated' AND initialization_lease_id IS NULL
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase)
    SELECT id, generation, :lease_id, :instance_id, 'begin_initialization', 'allocated', status,
        'committed'
    FROM updated
)
SELECT * FROM updated;

-- name: mark_connection_ready
-- Finish initialization. Ready only if no connection was recorded or cleared since the claim looked
-- (:connection_seq, the allocation's connection number then): a connect that landed meanwhile, on
-- any replica, may be a restarted sidecar whose takeover hid its disconnect, and a disconnect means
-- it is gone. Then the write becomes an immediate follow-up instead (due now, ledger kind
-- 'follow_up'), so the next claim looks again. Either way the initialization marker is settled and
-- the lease dropped; on ready, attempt counters and the last failure are reset.
WITH updated AS (
    UPDATE hubd_allocations SET
        connection_ready = (connection_seq = :connection_seq),
        initialization_lease_id = NULL,
        connect_deadline =
            CASE WHEN connection_seq = :connection_seq THEN NULL ELSE connect_deadline END,
        next_attempt_at = CASE WHEN connection_seq = :connection_seq THEN NULL ELSE now() END,
        lease_id = NULL,
        lease_expires_at = NULL,
        ensure_attempts =
            CASE WHEN connection_seq = :connection_seq THEN 0 ELSE ensure_attempts END,
        destroy_attempts =
            CASE WHEN connection_seq = :connection_seq THEN 0 ELSE destroy_attempts END,
        failure_code = CASE WHEN connection_seq = :connection_seq THEN NULL ELSE failure_code END,
        failure_message =
            CASE WHEN connection_seq = :connection_seq THEN NULL ELSE failure_message END,
        updated_at = now()
    WHERE {fence}
      AND status = 'allocated'
      AND (initialization_lease_id IS NULL OR initialization_lease_id = :lease_id)
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, lease_id, instance_id, kind, from_status, to_status, phase,
         message)
    SELECT id, generation, :lease_id, :instance_id,
        CASE WHEN connection_ready THEN 'mark_ready' ELSE 'follow_up' END,
        'allocated', status, 'committed',
        CASE WHEN connection_ready THEN NULL
             ELSE 'a connection was recorded or lost during initialization' END
    FROM updated
)
SELECT * FROM updated;

-- name: schedule_retry
-- Try again after :delay seconds in status :expected_status; :attempt names the attempt counter to
-- bump ('ensure', 'destroy' or NULL); :failure_code/:failure_message record the failure that caused
-- it, when given; :clear_initialization clears an initialization marker this claim settled (the
-- hook finished or failed cleanly). Drops the lease.
WITH updated AS (
    UPDATE hubd_allocations SET
        next_attempt_at = now() + make_interval(secs => :delay),
        initialization_lease_id =
            CASE WHEN :clear_initialization THEN NULL ELSE initialization_lease_id END,
        ensure_attempts =
            ensure_attempts + CASE WHEN :attempt::text = 'ensure' THEN 1 ELSE 0 END,
        destroy_attempts =
            destroy_attempts + CASE WHEN :attempt::text = 'destroy' THEN 1 ELSE 0 END,
        failure_code = COALESCE(:failure_code, failure_code),
        failure_message =
            CASE WHEN :failure_code::text IS NULL THEN failure_message ELSE :failure_message END,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE {fence}
      AND status = :expected_status
    RETURNING *
), logged AS (
    {log_updated}
        hubd_ledger_rows(:effects::text::jsonb, 'schedule_retry', status, status,
            :failure_code, :failure_message) AS r
)
SELECT * FROM updated;

-- name: park
-- Nothing to do until something happens: drop the lease and come back at the connect deadline
-- (:mode = 'await_connection', falling back to :delay seconds) or after :delay seconds
-- ('retry_after_error', recording :failure_code/:failure_message as the failure). Awaiting a
-- connection is fenced on the connection number the claim last saw (:connection_seq, when given):
-- if a connection was recorded or cleared since, on any replica, the row is due now instead (ledger
-- kind 'follow_up'), so no connect is slept through.
-- With :ready_within (an instance TTL in seconds; NULL: never), an allocated row whose current
-- generation already holds a live record (on an instance heartbeating within :ready_within, or
-- on :instance_id itself) becomes ready here instead, as mark_connection_ready would make it: the
-- look at the record and the write are one statement. The look reads this statement's snapshot;
-- a record or clear that commits while this statement waits for the row lock moves the row's
-- connection number past the one the look saw (live_seq), and then the row is not made ready.
-- With :accept, a provisioning row becomes allocated first (ensure accepted, :external_ref, and
-- :endpoint and :metadata as mark_allocated records them), in the same statement: acceptance,
-- the ensure's outcome and the park or ready commit together (the caller puts the acceptance's
-- own ledger row in :effects, after the outcome).
-- In set form (hubd.store.pipeline): each parameter is an array, element i for row i, at most one
-- row per allocation; each row is fenced, looked at, written and logged on its own. The rows are
-- locked one by one in allocation id order before any is written (LIMIT 1 keeps each look-up on
-- its key), as every multi-row statement takes them. Returns the rows written; a row whose fence
-- failed is absent.
WITH input AS (
    SELECT i.*, l.seq AS live_seq, l.connected AS live_connected
    FROM unnest(:ready_within::float8[], :instance_id::text[], :allocation_id::text[],
                :mode::text[], :accept::boolean[], :lease_id::text[], :generation::integer[],
                :external_ref::text[], :endpoint::text[], :metadata::text[],
                :connection_seq::bigint[], :delay::float8[],
                :failure_code::text[], :failure_message::text[], :effects::text[])
        AS i (ready_within, instance_id, allocation_id, mode, accept, lease_id, generation,
              external_ref, endpoint, metadata, connection_seq, delay, failure_code,
              failure_message, effects)
    LEFT JOIN LATERAL (
        SELECT a.connection_seq AS seq,
               hubd_sidecar_live(a.id, a.generation, i.ready_within, i.instance_id)
               -- Ready once its sidecar says so: that record's sidecar must have (readiness).
               AND (a.ready_when IS DISTINCT FROM 'declared' OR coalesce((
                   -- By key (LIMIT 1 keeps the look-up off a scan of every record).
                   SELECT c.declared_ready AND c.generation = a.generation
                   FROM hubd_sidecar_connections AS c WHERE c.allocation_id = a.id LIMIT 1),
                   false)) AS connected
        FROM hubd_allocations AS a
        WHERE a.id = i.allocation_id AND i.ready_within IS NOT NULL
          AND i.mode = 'await_connection'
        LIMIT 1
    ) AS l ON true
    ORDER BY i.allocation_id
), prior AS (
    SELECT a.id, i.lease_id, i.instance_id, i.mode, i.accept, i.external_ref, i.endpoint,
           i.metadata, i.connection_seq, i.delay, i.failure_code, i.failure_message, i.effects,
           (i.live_connected IS TRUE AND a.connection_seq = i.live_seq
            AND (a.status = 'allocated' OR i.accept)
            AND a.initialization_lease_id IS NULL) AS ready_now
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT id, connection_seq, status, initialization_lease_id FROM hubd_allocations
        WHERE id = i.allocation_id AND lease_id = i.lease_id AND generation = i.generation
          AND lease_expires_at > clock_timestamp()
          AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
          AND (NOT i.accept OR status = 'provisioning')
        LIMIT 1
        FOR UPDATE
    ) AS a
), updated AS (
    UPDATE hubd_allocations AS a SET
        status = CASE WHEN p.accept THEN 'allocated' ELSE a.status END,
        external_ref = CASE WHEN p.accept THEN p.external_ref ELSE a.external_ref END,
        endpoint = CASE WHEN p.accept THEN COALESCE(a.endpoint, p.endpoint)
                        ELSE a.endpoint END,
        metadata = CASE WHEN p.accept
                        THEN hubd_accepted_metadata(p.metadata::jsonb, a.sidecar_patch, a.metadata)
                        ELSE a.metadata END,
        sidecar_patch = CASE WHEN p.accept THEN NULL ELSE a.sidecar_patch END,
        connection_ready = a.connection_ready OR p.ready_now,
        next_attempt_at = CASE
            WHEN p.ready_now THEN NULL
            WHEN p.mode = 'await_connection' AND a.connection_seq <> p.connection_seq
                THEN now()
            WHEN p.mode = 'await_connection'
                THEN COALESCE(a.connect_deadline, now() + make_interval(secs => p.delay))
            ELSE now() + make_interval(secs => p.delay) END,
        connect_deadline = CASE WHEN p.ready_now THEN NULL ELSE a.connect_deadline END,
        ensure_attempts = CASE WHEN p.ready_now THEN 0 ELSE a.ensure_attempts END,
        destroy_attempts = CASE WHEN p.ready_now THEN 0 ELSE a.destroy_attempts END,
        failure_code = CASE WHEN p.ready_now THEN NULL
                            ELSE COALESCE(p.failure_code, a.failure_code) END,
        failure_message = CASE WHEN p.ready_now THEN NULL
                               WHEN p.failure_code IS NULL THEN a.failure_message
                               ELSE p.failure_message END,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    FROM prior AS p
    WHERE a.id = p.id AND a.id = ANY (:allocation_id::text[])
    RETURNING a.*
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT u.id, u.generation, p.lease_id, p.instance_id, r.*
    FROM updated AS u JOIN prior AS p ON p.id = u.id,
        hubd_ledger_rows(p.effects::jsonb,
            CASE WHEN p.ready_now THEN 'mark_ready'
                 WHEN p.mode = 'await_connection' AND u.connection_seq <> p.connection_seq
                 THEN 'follow_up' ELSE 'park_' || p.mode END,
            u.status, u.status, p.failure_code, p.failure_message) AS r
)
SELECT * FROM updated;

-- name: begin_replacement
-- Abandon the current sidecar: → replacing under a new generation, due in :delay seconds, failure
-- :failure_code/:failure_message. With :only_if_initialization_incomplete, only while an
-- initialization is still recorded (and, given :expected_initialization_lease_id, by that lease).
-- Given :expected_connection_seq, only while the connection number is still that: a sidecar that
-- connected (anywhere) since the claim saw it absent is never abandoned for not connecting.
-- The sidecars abandoned within :replacement_window seconds of the first of a streak are counted;
-- past :replacement_limit (0: no limit) the allocation is given up instead: → releasing
-- at once with give_up set (mark_released then ends it 'failed'), the failure message saying so.
WITH updated AS (
    UPDATE hubd_allocations AS a SET
        (status, replacements, replacements_since, give_up, next_attempt_at, failure_message,
         end_reason) = (
            SELECT CASE WHEN d.give_up THEN 'releasing' ELSE 'replacing' END::hubd_status,
                   d.streak, d.since, d.give_up,
                   CASE WHEN d.give_up THEN now()
                        ELSE now() + make_interval(secs => :delay) END,
                   CASE WHEN d.give_up
                        THEN format('gave up: %s sidecars failed within %s s '
                                    '(replacement_limit %s); the last: %s', d.streak,
                                    :replacement_window::float8, :replacement_limit::integer,
                                    :failure_message::text)
                        ELSE :failure_message END,
                   CASE WHEN d.give_up THEN coalesce(a.end_reason, :failure_code::text)
                        ELSE a.end_reason END
            FROM (
                SELECT s.streak, s.since,
                       :replacement_limit::integer > 0
                           AND s.streak > :replacement_limit::integer AS give_up
                FROM (SELECT CASE WHEN a.replacements_since > now() - make_interval(
                                           secs => :replacement_window::float8)
                                  THEN a.replacements + 1 ELSE 1 END AS streak,
                             CASE WHEN a.replacements_since > now() - make_interval(
                                           secs => :replacement_window::float8)
                                  THEN a.replacements_since ELSE now() END AS since) AS s
            ) AS d),
        generation = generation + 1,
        ensure_attempts = ensure_attempts + 1,
        failure_code = :failure_code,
        connection_ready = false,
        initialization_lease_id = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE {fence}
      AND status = :expected_status
      AND (NOT :only_if_initialization_incomplete OR (initialization_lease_id IS NOT NULL
                      AND initialization_lease_id =
                          COALESCE(:expected_initialization_lease_id, initialization_lease_id)))
      AND (:expected_connection_seq::bigint IS NULL OR connection_seq = :expected_connection_seq)
    RETURNING *
), logged AS (
    {log_updated}
        hubd_ledger_rows(:effects::text::jsonb,
            CASE WHEN give_up THEN 'give_up' ELSE 'begin_replacement' END, :expected_status,
            status, :failure_code, failure_message) AS r
)
SELECT * FROM updated;

-- name: begin_unrecoverable_release
-- allocated → releasing under a new generation when automatic replacement recovery is off;
-- :failure_code/:failure_message the failure; :only_if_initialization_incomplete,
-- :expected_initialization_lease_id and :expected_connection_seq as in begin_replacement.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'releasing',
        generation = generation + 1,
        next_attempt_at = now(),
        failure_code = :failure_code,
        failure_message = :failure_message,
        -- What ended it, kept whatever a retried destroy writes into failure_code after it.
        end_reason = coalesce(end_reason, :failure_code),
        connection_ready = false,
        initialization_lease_id = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE {fence}
      AND status = 'allocated'
      AND (NOT :only_if_initialization_incomplete OR (initialization_lease_id IS NOT NULL
                      AND initialization_lease_id =
                          COALESCE(:expected_initialization_lease_id, initialization_lease_id)))
      AND (:expected_connection_seq::bigint IS NULL OR connection_seq = :expected_connection_seq)
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message)
    SELECT id, generation, :lease_id, :instance_id, 'begin_unrecoverable_release', 'allocated',
        status, 'committed', :failure_code, :failure_message
    FROM updated
)
SELECT * FROM updated;

-- name: fail_without_infrastructure
-- :expected_status → failed with failure :failure_code/:failure_message: nothing was
-- provisioned, so nothing needs destroying.
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'failed',
        failure_code = :failure_code,
        failure_message = :failure_message,
        end_reason = coalesce(end_reason, :failure_code),
        connection_ready = false,
        initialization_lease_id = NULL,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    WHERE {fence}
      AND status = :expected_status
    RETURNING *
), logged AS (
    {log_updated}
        hubd_ledger_rows(:effects::text::jsonb, 'fail', :expected_status, status,
            :failure_code, :failure_message) AS r
)
SELECT * FROM updated;

-- name: mark_destroy_failed
-- replacing/releasing → destroy_failed (:failure_code/:failure_message): an operator must look,
-- infrastructure may leak.
WITH prior AS (
    SELECT id, status FROM hubd_allocations
    WHERE {fence}
      AND status IN ('replacing', 'releasing')
    FOR UPDATE
), updated AS (
    UPDATE hubd_allocations AS a SET
        status = 'destroy_failed',
        failure_code = :failure_code,
        failure_message = :failure_message,
        end_reason = coalesce(a.end_reason, :failure_code),
        connection_ready = false,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    FROM prior
    WHERE a.id = prior.id AND a.id = :allocation_id
    RETURNING a.*, prior.status AS from_status
), logged AS (
    {log_updated}
        hubd_ledger_rows(:effects::text::jsonb, 'mark_destroy_failed', from_status, status,
            :failure_code, :failure_message) AS r
)
SELECT updated.* FROM updated;

-- name: mark_released
-- releasing → released once the sidecar is destroyed; → failed when the release is a give-up
-- (begin_replacement set give_up). In set form (hubd.store.pipeline): each
-- parameter is an array, element i for row i, at most one row per allocation; each row is
-- fenced, written and logged on its own. The rows are locked one by one in allocation id order
-- before any is written (LIMIT 1 keeps each look-up on its key), as every multi-row statement
-- takes them. Returns the rows written; a row whose fence failed is absent.
WITH input AS (
    SELECT *
    FROM unnest(:allocation_id::text[], :lease_id::text[], :generation::integer[],
                :instance_id::text[], :effects::text[])
        AS i (allocation_id, lease_id, generation, instance_id, effects)
    ORDER BY allocation_id
), fenced AS (
    SELECT a.id, i.lease_id, i.generation, i.instance_id, i.effects
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT id FROM hubd_allocations
        WHERE id = i.allocation_id AND lease_id = i.lease_id AND generation = i.generation
          AND lease_expires_at > clock_timestamp()
          AND status = 'releasing'
        LIMIT 1
        FOR UPDATE
    ) AS a
), updated AS (
    UPDATE hubd_allocations AS a SET
        status = CASE WHEN a.give_up THEN 'failed' ELSE 'released' END::hubd_status,
        connection_ready = false,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    FROM fenced AS f
    WHERE a.id = f.id AND a.id = ANY (:allocation_id::text[])
      AND a.lease_id = f.lease_id AND a.generation = f.generation AND a.status = 'releasing'
    RETURNING a.*
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT u.id, u.generation, f.lease_id, f.instance_id, r.*
    FROM updated AS u JOIN fenced AS f ON f.id = u.id,
        hubd_ledger_rows(f.effects::jsonb, 'mark_released', 'releasing', u.status) AS r
)
SELECT * FROM updated;

