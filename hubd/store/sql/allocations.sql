-- Statements on hubd_allocations. Every transition appends its ledger row in the same statement
-- (a data-modifying CTE), so a transition and its evidence commit or vanish together.
-- Claim-owned writes are fenced on :allocation_id, :lease_id and :generation, and a lease still
-- live by the database clock; :instance_id is the hub written to the ledger. The fence reads
-- clock_timestamp(), not now(): a write that waited on a row lock is re-checked at the moment it
-- proceeds, not at the moment its statement started.
-- A transition that brackets a plugin call also writes the call's ledger rows (:effects, a JSON
-- array; see EffectRow): the intent with the bind that makes the call due, the outcome with the
-- transition that follows from it. hubd_ledger_rows (schema.sql) puts them in order around the
-- transition's own row.

-- name: insert_allocation
-- A new request, due at once, through the function applications call too (hubd_v1.request):
-- one path, one set of checks. The wake-up is delivered when the caller's transaction commits.
-- The :spec arrives as JSON text, so callers' connections need no codec. A key already used
-- returns its allocation (or fails, HU409, if the request differs).
SELECT * FROM hubd_request_allocation(:provisioner_id, :tenant_id, :session_id,
    :spec::text::jsonb, :idempotency_key, :ready_when, :instance_id);

-- name: release_allocation
-- A user's release, through the function applications call too (hubd_v1.release): pending goes
-- straight to released (nothing was bound); any other active status becomes releasing under a
-- new generation, which fences off the current claim and sidecar. Returns the row as it stands;
-- an unknown id fails (no_data_found).
SELECT * FROM hubd_release_allocation(:allocation_id, :reason, :instance_id);

-- name: claim_due
-- Lease up to one due active row per lease id in :lease_ids, oldest first, skipping rows not
-- in :exclude and rows another claimer has locked: one statement fills every free
-- claim slot. Each row gets the lease id at its position. hubd_due_allocations (schema.sql)
-- picks and locks the rows, walking hubd_allocations_due_idx in order.
-- A claimed row whose step is to destroy its bound sidecar (replacing, releasing) gets the
-- destroy's intent here, under the new lease, with the effect id at its position in
-- :effect_ids (destroy_effect_id): the claim is the write that makes the call due. A claim
-- that ends without calling settles it (a failed row, see drop_lease and the provisioner
-- check); one that stops leaves it open, and the next owner records it ambiguous.
-- A pending row whose provisioner is in :bindings ({"<id>": [api_version, fingerprint,
-- ready_when]}, the claimer's provisioners, ready_when the provisioner's default for a row that
-- did not ask for one) and not bound to another version or fingerprint is bound here as
-- bind_initial_sidecar binds it, with the identity at its position (:sidecar_ids,
-- :token_hashes; none given: no row is bound) and the ensure's intent under the effect id at
-- its position (ensure_effect_id): the claim is the write that makes that call due too.
WITH due AS (
    SELECT id, row_number() OVER (ORDER BY next_attempt_at, id) AS slot
    FROM hubd_due_allocations(:exclude::text[], cardinality(:lease_ids::text[])) AS locked
), claimed AS (
    UPDATE hubd_allocations AS a SET
        lease_id = leases.lease_id,
        lease_expires_at = now() + make_interval(secs => :lease_duration),
        updated_at = now(),
        -- Decided on the row version being updated (the locked one), never on a read of it.
        (status, provisioner_api_version, provisioner_binding_fingerprint, sidecar_id,
         token_hash, external_ref, connect_deadline, connection_ready, ready_when) = (
            SELECT CASE WHEN bind THEN 'provisioning' ELSE a.status END,
                   CASE WHEN bind THEN version ELSE a.provisioner_api_version END,
                   CASE WHEN bind THEN fingerprint ELSE a.provisioner_binding_fingerprint END,
                   CASE WHEN bind THEN leases.sidecar_id ELSE a.sidecar_id END,
                   CASE WHEN bind THEN leases.token_hash ELSE a.token_hash END,
                   CASE WHEN bind THEN NULL ELSE a.external_ref END,
                   CASE WHEN bind THEN now() + make_interval(secs => :connect_timeout)
                        ELSE a.connect_deadline END,
                   CASE WHEN bind THEN false ELSE a.connection_ready END,
                   CASE WHEN bind THEN COALESCE(a.ready_when, decided.ready_when)
                        ELSE a.ready_when END
            FROM (
                SELECT COALESCE(a.status = 'pending' AND leases.sidecar_id IS NOT NULL
                           AND COALESCE(a.provisioner_api_version, wanted.version)
                               = wanted.version
                           AND COALESCE(a.provisioner_binding_fingerprint, wanted.fingerprint)
                               = wanted.fingerprint, false) AS bind,
                       wanted.version, wanted.fingerprint, wanted.ready_when
                FROM (SELECT :bindings::text::jsonb -> a.provisioner_id ->> 0 AS version,
                             :bindings::text::jsonb -> a.provisioner_id ->> 1 AS fingerprint,
                             :bindings::text::jsonb -> a.provisioner_id ->> 2 AS ready_when)
                    AS wanted
            ) AS decided)
    FROM due
    JOIN unnest(:lease_ids::text[], :effect_ids::text[], :sidecar_ids::text[],
                :token_hashes::bytea[]) WITH ORDINALITY
        AS leases (lease_id, effect_id, sidecar_id, token_hash, slot) ON leases.slot = due.slot
    -- By key: planned on a table it believes empty, the join alone walked the whole primary
    -- key once a claim (schema.sql, hubd_due_allocations).
    WHERE a.id = due.id AND a.id = ANY (ARRAY(SELECT id FROM due))
    RETURNING a.*,
        CASE WHEN a.status IN ('replacing', 'releasing') AND a.sidecar_id IS NOT NULL
             THEN leases.effect_id END AS destroy_effect_id,
        -- This statement's own binding: the new identity is unique to it.
        CASE WHEN a.status = 'provisioning' AND a.sidecar_id = leases.sidecar_id
             THEN leases.effect_id END AS ensure_effect_id,
        -- Whether an earlier lease left a plugin call with no outcome (only a status that calls
        -- plugins can have one): the claim settles those first, and skips the statement
        -- otherwise. Exact: no other lease can write an intent while this one is live, and
        -- this statement's own intents are not in its snapshot. A row bound here has none.
        a.status IN ('provisioning', 'replacing', 'releasing')
            AND a.sidecar_id IS DISTINCT FROM leases.sidecar_id
            AND hubd_has_open_effects(a.id) AS open_effects
), intents AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id,
        effect_id, kind, from_status, to_status, phase)
    SELECT id, generation, lease_id, :instance_id, effect_id, kind, from_status, status, phase
    FROM (
        SELECT id, generation, lease_id, destroy_effect_id AS effect_id, 'destroy' AS kind,
            status AS from_status, status, 'intent' AS phase, 1 AS place
        FROM claimed WHERE destroy_effect_id IS NOT NULL
        UNION ALL
        SELECT id, generation, lease_id, NULL, 'bind_sidecar', 'pending', status, 'committed', 1
        FROM claimed WHERE ensure_effect_id IS NOT NULL
        UNION ALL
        SELECT id, generation, lease_id, ensure_effect_id, 'ensure', status, status, 'intent', 2
        FROM claimed WHERE ensure_effect_id IS NOT NULL
    ) AS rows
    ORDER BY id, place
)
SELECT * FROM claimed;

-- name: renew_leases
-- Extend, in one statement, every lease in the pairs (:allocation_ids, :lease_ids) that is still held
-- and live; returns the ids renewed. Rows are locked in id order, so two renewals (or a
-- renewal and a set statement) never deadlock.
-- Each side of a join also names its rows by key (a.id = ANY ...): a plan made on a table the
-- statistics call empty may otherwise read the whole table and filter it, every renewal.
WITH held AS (
    SELECT a.id FROM hubd_allocations AS a
    JOIN unnest(:allocation_ids::text[], :lease_ids::text[]) AS mine (id, lease_id)
      ON a.id = mine.id AND a.lease_id = mine.lease_id
    WHERE a.id = ANY (:allocation_ids::text[])
      AND a.lease_expires_at > clock_timestamp()
    ORDER BY a.id
    FOR UPDATE OF a
)
UPDATE hubd_allocations AS a
SET lease_expires_at = now() + make_interval(secs => :lease_duration)
FROM held
WHERE a.id = held.id AND a.id = ANY (:allocation_ids::text[])
  AND a.lease_expires_at > clock_timestamp()
RETURNING a.id;

-- name: drop_lease
-- Give a live lease back without any other change, so the row is claimable at once: a claim that
-- found local work still running on its allocation must not hold the row for a whole lease. The
-- intents its claim statement wrote are settled as never called (:instance_id the hub).
WITH dropped AS (
    UPDATE hubd_allocations
    SET lease_id = NULL, lease_expires_at = NULL
    WHERE id = :allocation_id AND lease_id = :lease_id AND lease_expires_at > clock_timestamp()
    RETURNING id
), settled AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id,
        effect_id, kind, from_status, to_status, phase, error_code, message)
    SELECT i.allocation_id, i.generation, i.lease_id, :instance_id, i.effect_id, i.kind,
        i.from_status, i.to_status, 'failed', 'not_called', 'the claim gave its lease back first'
    FROM hubd_allocation_ledger AS i JOIN dropped ON i.allocation_id = dropped.id
    WHERE i.lease_id = :lease_id AND i.effect_id IS NOT NULL AND i.phase = 'intent'
)
SELECT id FROM dropped;

-- name: give_back_lease
-- A claim that stopped because its lease no longer fenced its writes (a release or a peer moved
-- the row on) ends :lease_id early: the row is claimable at once instead of after the lease runs
-- out. Nothing else changes, its open intents included: the next claim settles them as it would
-- after an expired lease. Only while the lease is still :lease_id.
UPDATE hubd_allocations SET lease_id = NULL, lease_expires_at = NULL
WHERE id = :allocation_id AND lease_id = :lease_id
RETURNING id;

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
        connect_deadline = now() + make_interval(secs => :connect_timeout),
        connection_ready = false,
        ready_when = COALESCE(ready_when, :ready_when::text),
        updated_at = now()
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
      AND status = 'pending'
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,
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
        connect_deadline = now() + make_interval(secs => :connect_timeout),
        connection_ready = false,
        updated_at = now()
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
      AND status = 'replacing'
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,
        hubd_ledger_rows(:effects::text::jsonb, 'bind_replacement_sidecar', 'replacing',
            status) AS r
)
SELECT * FROM updated;

-- name: mark_allocated
-- provisioning → allocated: the provisioner accepted ensure (:external_ref), with what it knows
-- of the sidecar (:endpoint, :metadata as JSON text; NULL: nothing). Each fills only what the
-- generation's sidecar has not published already (a sidecar may connect and publish before the
-- acceptance is written): the sidecar's own word is the later one.
WITH updated AS (
    UPDATE hubd_allocations
    SET status = 'allocated', external_ref = :external_ref,
        endpoint = COALESCE(endpoint, :endpoint::text),
        metadata = COALESCE(metadata, :metadata::text::jsonb),
        updated_at = now()
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
      AND status = 'provisioning'
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,
        hubd_ledger_rows(:effects::text::jsonb, 'mark_allocated', 'provisioning', status) AS r
)
SELECT * FROM updated;

-- name: begin_initialization
-- Record, before the on-ready hook runs, that this lease is initializing the sidecar; a crash
-- before mark_connection_ready leaves the marker for the next claim to find.
WITH updated AS (
    UPDATE hubd_allocations SET initialization_lease_id = :lease_id, updated_at = now()
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
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
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
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
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
      AND status = :expected_status
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,
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
        metadata = CASE WHEN p.accept THEN COALESCE(a.metadata, p.metadata::jsonb)
                        ELSE a.metadata END,
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
WITH updated AS (
    UPDATE hubd_allocations SET
        status = 'replacing',
        generation = generation + 1,
        ensure_attempts = ensure_attempts + 1,
        next_attempt_at = now() + make_interval(secs => :delay),
        failure_code = :failure_code,
        failure_message = :failure_message,
        connection_ready = false,
        initialization_lease_id = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
      AND status = :expected_status
      AND (NOT :only_if_initialization_incomplete OR (initialization_lease_id IS NOT NULL
                      AND initialization_lease_id =
                          COALESCE(:expected_initialization_lease_id, initialization_lease_id)))
      AND (:expected_connection_seq::bigint IS NULL OR connection_seq = :expected_connection_seq)
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,
        hubd_ledger_rows(:effects::text::jsonb, 'begin_replacement', :expected_status, status,
            :failure_code, :failure_message) AS r
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
        connection_ready = false,
        initialization_lease_id = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
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
        connection_ready = false,
        initialization_lease_id = NULL,
        next_attempt_at = NULL,
        lease_id = NULL,
        lease_expires_at = NULL,
        finished_at = now(),
        updated_at = now()
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
      AND status = :expected_status
    RETURNING *
), logged AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,
        hubd_ledger_rows(:effects::text::jsonb, 'fail', :expected_status, status,
            :failure_code, :failure_message) AS r
)
SELECT * FROM updated;

-- name: mark_destroy_failed
-- replacing/releasing → destroy_failed (:failure_code/:failure_message): an operator must look,
-- infrastructure may leak.
WITH prior AS (
    SELECT id, status FROM hubd_allocations
    WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
      AND lease_expires_at > clock_timestamp()
      AND status IN ('replacing', 'releasing')
    FOR UPDATE
), updated AS (
    UPDATE hubd_allocations AS a SET
        status = 'destroy_failed',
        failure_code = :failure_code,
        failure_message = :failure_message,
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
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, kind,
        from_status, to_status, phase, error_code, message, effect_id, duration_ms)
    SELECT id, generation, :lease_id, :instance_id, r.* FROM updated,
        hubd_ledger_rows(:effects::text::jsonb, 'mark_destroy_failed', from_status, status,
            :failure_code, :failure_message) AS r
)
SELECT updated.* FROM updated;

-- name: mark_released
-- releasing → released once the sidecar is destroyed. In set form (hubd.store.pipeline): each
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
        status = 'released',
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

-- name: try_sweep_lock
-- One sweeper per provisioner across replicas: a session advisory lock, released by
-- release_sweep_lock or by the session's end (a crashed sweeper holds nothing).
SELECT pg_try_advisory_lock(hashtext('hubd_orphans'), hashtext(:lock_name));

-- name: release_sweep_lock
SELECT pg_advisory_unlock(hashtext('hubd_orphans'), hashtext(:lock_name));

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
