-- Statements on hubd_sidecar_connections: the durable record of which sidecar is connected where,
-- so any replica can answer "is this sidecar ready?" from the database.
--
-- Every statement that records or clears a connection also bumps the allocation's
-- connection_seq in the same statement. Claims fence their connection-dependent writes on that
-- number (see park and mark_connection_ready in transitions.sql); updating the
-- allocation row also takes its row lock, so a record and a clear of one allocation never
-- interleave.
--
-- Lock order: allocation rows before their connection rows, several allocations in id order
-- (FOR NO KEY UPDATE where a statement takes the row before updating it: what its UPDATE would
-- take, so foreign-key checks of other tables are not held up).
-- Every statement here follows it, and so do transitions (whose trigger deletes records after
-- the allocation row is updated), so two of them never wait on each other in a cycle. A clear
-- that took the record's row first would deadlock with a reconnect being recorded on another
-- replica, or with a release, at the same moment; PostgreSQL would abort one after a second.

-- name: identities
-- What handshakes are checked against, for every allocation in :allocation_ids at once (the
-- look-ups that arrived while the previous statement ran): each allocation's status, generation
-- and current identity, and that identity's reconnect secret (all NULL when it has none: a row
-- of an older generation or sidecar is no secret of this one). No row for an id: no such
-- allocation. Both tables are read through :allocation_ids: planned on tables it believes empty,
-- a join on the allocation alone walked every allocation, or every secret once per allocation
-- (15,707 pages for 8 look-ups at 2,000 secrets in the test).
SELECT a.id, a.status, a.generation, a.sidecar_id, a.token_hash,
       s.secret_hash, s.previous_hash, s.acknowledged
FROM hubd_allocations AS a
LEFT JOIN hubd_sidecar_secrets AS s
       ON s.allocation_id = a.id AND s.generation = a.generation AND s.sidecar_id = a.sidecar_id
      AND s.allocation_id = ANY (:allocation_ids::text[])
WHERE a.id = ANY (:allocation_ids::text[]);

-- name: record
-- Connections become the current ones of their allocations: element i of the arrays is
-- connection :connection_ids[i] of :allocation_ids[i] at :generations[i], sidecar
-- :sidecar_ids[i], on instance :instance_id. A handshake storm writes many in one statement;
-- each is written exactly as if it ran alone.
-- With :authenticates[i] the element is a handshake not yet authenticated (the listener's
-- admission: authenticate and record in one round trip, before the upgrade): it is written only
-- if its credentials open the identity this statement's snapshot holds, exactly as the
-- protocol's check in hubd.server.handshake.authorize decides (generation and sidecar id equal
-- to the current ones, provisioning or allocated, :token_hashes[i] the token's digest, and the
-- reconnect secret rule: none set, the token alone; set, the current secret, or until the
-- welcome is acknowledged what opened the latest connection; protocol :versions[i] 1 never once
-- a secret is set). Digests are compared as digests of :key (random per statement) and the
-- digest, so the comparison's time says nothing of how much of a digest matched. Its guard for
-- the rotation (below) is the secret that snapshot holds. Several of one allocation may be
-- given: of those admitted the last one is written, the others are superseded by it. Without
-- :authenticates[i] the element is written unchecked (:seen_hashes[i] is its guard), and at
-- most one per allocation may be given.
-- A record is written only while the allocation still accepts exactly that sidecar (current
-- generation and identity, provisioning or allocated). In the same statement: the connection
-- number is bumped, and 'hubd_connected' carries '<tag>:<generation>:<seq>:<connection>:<mac>'
-- (hubd_notice: the allocation's tag, as any role may listen, and a mac, as any may notify) to
-- every replica: waiters wake, and a replica holding an older socket of the same generation
-- closes it as superseded.
-- Then one of two things:
-- * With :ready_on_connect (no on-ready hook to run) and the allocation parked waiting for this connect
--   (allocated, not ready, no initialization marker, no live lease, ready_when not 'declared':
--   such a sidecar is ready once it says so, see declare_ready), it becomes ready here, with
--   its ledger row: no claim is needed, and none can be running (a claim holds a live lease, and
--   a claim that lost it can write nothing).
-- * Otherwise the allocation is made due and woken (a claim holding it sees the bump when it
--   parks or marks ready, so a connect on a leased row is never lost).
-- With :rotates[i] (a protocol v2 handshake, or a v1 one of a generation with no secret), the
-- generation's reconnect secret (hubd_sidecar_secrets) is rotated first (the new
-- :secret_hashes[i], :presented_hashes[i] valid until the welcome is acknowledged), guarded on
-- the state the handshake saw: of two handshakes that saw the same state only the first
-- rotates, and the other records nothing (rotation_lost). The rotation is written only
-- for an allocation that, in this statement's snapshot, accepts this sidecar; one that moves on
-- in the moment before the row lock leaves a secret of an identity no handshake can present
-- again. Secrets and allocations are locked in id order, so two statements never deadlock.
-- Returns a row per connection: its allocation's identity as the snapshot had it (status,
-- generation, sidecar, token digest and secret state; NULL: no such allocation), whether it was
-- admitted and whether another of the statement's was written in its place (outvoted), the
-- record's number (NULL: not written), whether the allocation became ready, what a written
-- record's sidecar serves (spec, tenant_id, session_id, ready_when: its welcome's) and whether
-- the rotation lost.
WITH given AS (
    SELECT *
    FROM unnest(:connection_ids::text[], :allocation_ids::text[], :generations::integer[],
                :sidecar_ids::text[], :rotates::boolean[], :seen_hashes::bytea[],
                :secret_hashes::bytea[], :presented_hashes::bytea[], :authenticates::boolean[],
                :versions::integer[], :token_hashes::bytea[]) WITH ORDINALITY
        AS i (connection_id, allocation_id, generation, sidecar_id, rotate, seen_hash,
              secret_hash, presented_hash, authenticate, version, token_hash, ord)
), checked AS (
    SELECT g.*, a.status AS current_status, a.generation AS current_generation,
           a.sidecar_id AS current_sidecar_id, a.token_hash AS current_token_hash,
           s.secret_hash AS current_secret_hash, s.previous_hash AS current_previous_hash,
           s.acknowledged AS current_acknowledged, a.spec AS current_spec,
           a.tenant_id AS current_tenant_id, a.session_id AS current_session_id,
           a.ready_when AS current_ready_when, a.handover_pending AS current_handover_pending,
           NOT g.authenticate OR coalesce(
               a.status IN ('provisioning', 'allocated')
               AND g.generation = a.generation
               AND g.sidecar_id = a.sidecar_id
               AND sha256(:key::bytea || a.token_hash) = sha256(:key::bytea || g.token_hash)
               AND CASE
                   WHEN s.secret_hash IS NULL THEN g.presented_hash IS NULL
                   WHEN g.version = 1 THEN false
                   WHEN sha256(:key::bytea || g.presented_hash)
                        = sha256(:key::bytea || s.secret_hash) THEN true
                   WHEN s.acknowledged IS NOT FALSE THEN false
                   WHEN s.previous_hash IS NULL THEN g.presented_hash IS NULL
                   ELSE sha256(:key::bytea || g.presented_hash)
                        = sha256(:key::bytea || s.previous_hash)
               END,
               false) AS admitted
    FROM given AS g
    -- Each row by its key (LIMIT 1 keeps the planner from turning the look-ups into a scan).
    LEFT JOIN LATERAL (
        SELECT status, generation, sidecar_id, token_hash, spec, tenant_id, session_id,
               ready_when, handover_pending
        FROM hubd_allocations
        WHERE id = g.allocation_id LIMIT 1
    ) AS a ON true
    -- A secret of an older generation or sidecar is no secret of this identity.
    LEFT JOIN LATERAL (
        SELECT secret_hash, previous_hash, acknowledged FROM hubd_sidecar_secrets
        WHERE allocation_id = g.allocation_id AND generation = a.generation
          AND sidecar_id = a.sidecar_id
        LIMIT 1
    ) AS s ON true
), input AS (
    SELECT DISTINCT ON (allocation_id)
           connection_id, allocation_id, generation, sidecar_id, rotate,
           CASE WHEN authenticate THEN current_secret_hash ELSE seen_hash END AS seen_hash,
           secret_hash, presented_hash
    FROM checked WHERE admitted
    ORDER BY allocation_id, ord DESC
), rotated AS (
    INSERT INTO hubd_sidecar_secrets AS s
        (allocation_id, generation, sidecar_id, secret_hash, previous_hash, acknowledged)
    SELECT a.id, a.generation, a.sidecar_id, i.secret_hash, i.presented_hash,
           i.secret_hash IS NULL
    FROM input AS i
    -- Each row by its key (LIMIT 1 keeps the planner from turning the look-ups into a scan).
    CROSS JOIN LATERAL (
        SELECT id, generation, sidecar_id FROM hubd_allocations
        WHERE id = i.allocation_id AND generation = i.generation AND sidecar_id = i.sidecar_id
          AND status IN ('provisioning', 'allocated')
        LIMIT 1
    ) AS a
    WHERE i.rotate
    ORDER BY a.id
    ON CONFLICT (allocation_id) DO UPDATE SET
        generation = EXCLUDED.generation,
        sidecar_id = EXCLUDED.sidecar_id,
        secret_hash = EXCLUDED.secret_hash,
        previous_hash = EXCLUDED.previous_hash,
        acknowledged = EXCLUDED.acknowledged,
        rotated_at = now()
    WHERE CASE WHEN s.generation = EXCLUDED.generation AND s.sidecar_id = EXCLUDED.sidecar_id
               THEN s.secret_hash IS NOT DISTINCT FROM (
                   SELECT i.seen_hash FROM input AS i
                   WHERE i.allocation_id = EXCLUDED.allocation_id)
               ELSE (SELECT i.seen_hash FROM input AS i
                     WHERE i.allocation_id = EXCLUDED.allocation_id) IS NULL END
    RETURNING s.allocation_id
), prior AS (
    -- Locked one by one in the input's (id) order.
    SELECT a.id, i.connection_id, i.sidecar_id, a.ready_now
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT id,
               (:ready_on_connect::boolean AND status = 'allocated' AND NOT connection_ready
                AND initialization_lease_id IS NULL
                AND (lease_expires_at IS NULL OR lease_expires_at <= clock_timestamp())
                -- A sidecar that declares readiness is ready when it says so (declare_ready).
                AND ready_when IS DISTINCT FROM 'declared')
                   AS ready_now
        FROM hubd_allocations
        WHERE id = i.allocation_id AND generation = i.generation AND sidecar_id = i.sidecar_id
          AND status IN ('provisioning', 'allocated')
          AND (NOT i.rotate OR EXISTS (
              SELECT 1 FROM rotated AS r WHERE r.allocation_id = i.allocation_id))
        LIMIT 1
        FOR UPDATE
    ) AS a
), alloc AS (
    UPDATE hubd_allocations AS a SET
        connection_seq = a.connection_seq + 1,
        -- prior.ready_now was decided on the row as locked, which may be newer than the row
        -- this statement's snapshot sees (a claim that accepted the ensure, provisioning →
        -- allocated, committed while prior waited). PostgreSQL checks the constraints on the new
        -- row built from the snapshot's version before it finds that version superseded and
        -- rebuilds from the locked one: readiness only where this version is allocated, or
        -- hubd_allocations_ready_check fails the whole statement.
        connection_ready = a.connection_ready OR (prior.ready_now AND a.status = 'allocated'),
        next_attempt_at = CASE WHEN prior.ready_now THEN NULL
                               WHEN a.next_attempt_at IS NULL OR a.next_attempt_at > now()
                               THEN now() ELSE a.next_attempt_at END,
        connect_deadline = CASE WHEN prior.ready_now THEN NULL ELSE a.connect_deadline END,
        lease_id = CASE WHEN prior.ready_now THEN NULL ELSE a.lease_id END,
        lease_expires_at = CASE WHEN prior.ready_now THEN NULL ELSE a.lease_expires_at END,
        ensure_attempts = CASE WHEN prior.ready_now THEN 0 ELSE a.ensure_attempts END,
        destroy_attempts = CASE WHEN prior.ready_now THEN 0 ELSE a.destroy_attempts END,
        failure_code = CASE WHEN prior.ready_now THEN NULL ELSE a.failure_code END,
        failure_message = CASE WHEN prior.ready_now THEN NULL ELSE a.failure_message END,
        updated_at = now()
    FROM prior
    WHERE a.id = prior.id AND a.id = ANY (:allocation_ids::text[])
    RETURNING a.id, a.generation, a.connection_seq, prior.ready_now, prior.connection_id,
              prior.sidecar_id, a.provisioner_id
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    SELECT id, generation, :instance_id, 'mark_ready', 'allocated', 'allocated', 'committed',
           'ready on connect'
    FROM alloc WHERE ready_now
), written AS (
    INSERT INTO hubd_sidecar_connections
        (connection_id, allocation_id, generation, sidecar_id, instance_id, seq)
    SELECT connection_id, id, generation, sidecar_id, :instance_id, connection_seq FROM alloc
    ON CONFLICT (allocation_id) DO UPDATE SET
        connection_id = EXCLUDED.connection_id,
        generation = EXCLUDED.generation,
        sidecar_id = EXCLUDED.sidecar_id,
        instance_id = EXCLUDED.instance_id,
        seq = EXCLUDED.seq,
        connected_at = now()
    RETURNING allocation_id, generation, seq, connection_id
), notified AS (
    SELECT pg_notify('hubd_connected',
                     hubd_notice(w.allocation_id,
                                 w.generation || ':' || w.seq || ':' || w.connection_id)),
           CASE WHEN NOT alloc.ready_now THEN pg_notify('hubd_wake', alloc.provisioner_id) END
    FROM written AS w JOIN alloc ON alloc.id = w.allocation_id
)
SELECT c.connection_id, c.allocation_id AS id, c.admitted, i.connection_id IS NULL AS outvoted,
       c.current_status AS status, c.current_generation AS generation,
       c.current_sidecar_id AS sidecar_id, c.current_token_hash AS token_hash,
       c.current_secret_hash AS secret_hash, c.current_previous_hash AS previous_hash,
       c.current_acknowledged AS acknowledged, w.seq,
       coalesce(alloc.ready_now, false) AS ready,
       -- What the sidecar serves, for its welcome: read from the row the admission checked
       -- (the spec never changes; tenant and session only at a pool member's take, which owes
       -- the sidecar a hand-over; ready_when only while pending), and only for a record
       -- written, so a refused handshake costs no copy of a spec.
       CASE WHEN w.seq IS NOT NULL THEN c.current_spec END AS spec,
       CASE WHEN w.seq IS NOT NULL THEN c.current_tenant_id END AS tenant_id,
       CASE WHEN w.seq IS NOT NULL THEN c.current_session_id END AS session_id,
       CASE WHEN w.seq IS NOT NULL THEN coalesce(c.current_ready_when, 'connected') END
           AS ready_when,
       coalesce(w.seq IS NOT NULL AND c.current_handover_pending, false) AS handover_pending,
       i.rotate AND NOT EXISTS (
           SELECT 1 FROM rotated AS r WHERE r.allocation_id = i.allocation_id) AS rotation_lost,
       (SELECT count(*) FROM notified) AS notified
FROM checked AS c
LEFT JOIN input AS i ON i.connection_id = c.connection_id
LEFT JOIN written AS w ON w.connection_id = c.connection_id
LEFT JOIN alloc ON alloc.connection_id = c.connection_id;

-- name: reassert
-- Write connection :connection_id's record again (same arguments as record) after this instance's
-- records were swept while its socket stayed open: only while the allocation still accepts that
-- sidecar and no other connection has recorded itself since (that one took over; this socket must
-- go). Returns the record's number, or no row when nothing was written.
WITH alloc AS (
    UPDATE hubd_allocations SET
        connection_seq = connection_seq + 1,
        next_attempt_at = CASE WHEN next_attempt_at IS NULL OR next_attempt_at > now()
                               THEN now() ELSE next_attempt_at END,
        updated_at = now()
    WHERE id = :allocation_id AND generation = :generation AND sidecar_id = :sidecar_id
      AND status IN ('provisioning', 'allocated')
      AND NOT EXISTS (SELECT 1 FROM hubd_sidecar_connections
                      WHERE allocation_id = :allocation_id AND connection_id <> :connection_id)
    RETURNING id, generation, connection_seq, provisioner_id
), written AS (
    INSERT INTO hubd_sidecar_connections
        (connection_id, allocation_id, generation, sidecar_id, instance_id, seq)
    SELECT :connection_id, id, generation, :sidecar_id, :instance_id, connection_seq FROM alloc
    -- A record that appeared after this statement's snapshot belongs to a newer socket: the
    -- conflict clause sees it and leaves it alone.
    ON CONFLICT (allocation_id) DO UPDATE SET instance_id = EXCLUDED.instance_id,
                                              seq = EXCLUDED.seq
    WHERE hubd_sidecar_connections.connection_id = EXCLUDED.connection_id
    RETURNING allocation_id, generation, seq, connection_id
), notified AS (
    SELECT pg_notify('hubd_connected',
                     hubd_notice(w.allocation_id,
                                 w.generation || ':' || w.seq || ':' || w.connection_id)),
           pg_notify('hubd_wake', alloc.provisioner_id)
    FROM written AS w JOIN alloc ON alloc.id = w.allocation_id
)
SELECT written.seq, (SELECT count(*) FROM notified) AS notified FROM written;

-- name: disconnect_many
-- Connections :connection_ids[i] of :allocation_ids[i] closed (one per allocation; a network blip
-- closes thousands at once, and they share a statement). Each record is cleared only while it is
-- still that connection's: a takeover on any replica replaced it otherwise, and one replaced while
-- this statement waited for the allocation's row is re-checked as the new record and kept. The
-- sidecar of each record cleared is then lost (hubd_connection_lost, schema.sql): an allocated
-- row of the record's generation reads not ready, with a new connect deadline :connect_timeout
-- seconds away, and a row a claim holds keeps its lease and schedule. The allocation rows are
-- locked in id order before any record is deleted, as sweep_stale does. :instance_id is the
-- instance for the ledger ('connection_lost'). Returns the connection ids whose records were
-- cleared, each with the number of ledger rows written. Like sweep_stale, each step finds the
-- rows of the step before by key (arrays and maps), whatever the statistics its plan was made
-- from.
WITH wanted AS (
    SELECT jsonb_object_agg(allocation_id, connection_id) AS seen
    FROM unnest(:allocation_ids::text[], :connection_ids::text[]) AS i(allocation_id, connection_id)
), closed AS (
    -- Only pairs whose record is there to clear: the close of a socket already taken over
    -- waits on no row.
    SELECT c.allocation_id FROM hubd_sidecar_connections AS c
    WHERE c.allocation_id = ANY (:allocation_ids::text[])
      AND c.connection_id = (SELECT seen FROM wanted) ->> c.allocation_id
), locked AS (
    SELECT a.id FROM hubd_allocations AS a
    WHERE a.id = ANY (ARRAY(SELECT allocation_id FROM closed))
    ORDER BY a.id
    FOR NO KEY UPDATE
), cleared AS (
    DELETE FROM hubd_sidecar_connections AS c
    WHERE c.allocation_id = ANY (ARRAY(SELECT id FROM locked))
      AND c.connection_id = (SELECT seen FROM wanted) ->> c.allocation_id
    RETURNING c.allocation_id, c.generation, c.connection_id
), lost AS (
    -- Once, over every record cleared; the result reads it, as a CTE nothing reads never runs.
    SELECT hubd_connection_lost(array_agg(allocation_id), array_agg(generation::integer), NULL,
                                'connection_lost', :connect_timeout, :instance_id) AS logged
    FROM cleared
)
SELECT connection_id, (SELECT logged FROM lost) AS logged FROM cleared;

-- name: sweep_stale
-- Records held by instances that are gone or whose heartbeat is older than :ttl seconds (never the
-- caller's own, :instance_id: it knows its own sockets are open) are cleared, and their sidecars
-- lost as a disconnect's are (hubd_connection_lost: :connect_timeout seconds to reconnect, to any
-- replica; 'connection_swept' in the ledger, naming the instance). If such an instance is alive
-- after all, it writes its records again (reassert) and readiness comes back at the same
-- generation. Returns one row per swept record, each with the number of ledger rows written.
-- A record is deleted by its connection id, so one replaced while this statement waited for the
-- allocation's row (the sidecar reconnected to a live replica) is re-checked as the new record
-- and kept: re-checking the instance's liveness instead would re-use the stale instance's answer.
-- The rows found reach the later steps as arrays and a map, so each step finds them by key
-- whatever the statistics its plan was made from (see mark_unconnected in sweeps.sql).
WITH stale AS (
    SELECT c.allocation_id, c.connection_id
    FROM hubd_sidecar_connections AS c
    WHERE c.instance_id <> :instance_id
      AND NOT EXISTS (SELECT 1 FROM hubd_instances AS i
                      WHERE i.id = c.instance_id
                        AND i.heartbeat_at > now() - make_interval(secs => :ttl))
), found AS (
    SELECT array_agg(allocation_id) AS ids, jsonb_object_agg(allocation_id, connection_id) AS seen
    FROM stale
), locked AS (
    SELECT a.id FROM hubd_allocations AS a
    WHERE a.id = ANY ((SELECT ids FROM found)::text[])
    ORDER BY a.id
    FOR NO KEY UPDATE
), cleared AS (
    DELETE FROM hubd_sidecar_connections AS c
    WHERE c.allocation_id = ANY (ARRAY(SELECT id FROM locked))
      AND c.connection_id = (SELECT seen FROM found) ->> c.allocation_id
    RETURNING c.allocation_id, c.generation, c.connection_id, c.instance_id
), lost AS (
    -- Once, over every record cleared; the result reads it, as a CTE nothing reads never runs.
    SELECT hubd_connection_lost(array_agg(allocation_id), array_agg(generation::integer),
                                array_agg('instance ' || instance_id || ' stopped heartbeating'),
                                'connection_swept', :connect_timeout, :instance_id) AS logged
    FROM cleared
)
SELECT allocation_id, generation, connection_id, instance_id, (SELECT logged FROM lost) AS logged
FROM cleared;

-- name: release_instance
-- A clean stop of :instance_id: its records go and their sidecars are lost at once, as a
-- disconnect's are (hubd_connection_lost: :connect_timeout seconds to reconnect to a peer),
-- instead of reading ready until a peer's sweep. Returns the records cleared, each with the
-- number of ledger rows written.
WITH locked AS (
    SELECT a.id FROM hubd_allocations AS a
    WHERE a.id IN (SELECT allocation_id FROM hubd_sidecar_connections
                   WHERE instance_id = :instance_id)
    ORDER BY a.id
    FOR NO KEY UPDATE
), cleared AS (
    DELETE FROM hubd_sidecar_connections
    WHERE allocation_id IN (SELECT id FROM locked) AND instance_id = :instance_id
    RETURNING allocation_id, generation
), lost AS (
    -- Once, over every record cleared; the result reads it, as a CTE nothing reads never runs.
    SELECT hubd_connection_lost(array_agg(allocation_id), array_agg(generation::integer),
                                array_agg('the hub holding the socket stopped'::text),
                                'connection_lost', :connect_timeout, :instance_id) AS logged
    FROM cleared
)
SELECT allocation_id, generation, (SELECT logged FROM lost) AS logged FROM cleared;

-- name: readiness
-- Whether :generation of :allocation_id has a current record on an instance whose heartbeat is
-- within :ttl seconds, or on the asking :instance_id itself (it holds the socket, whatever its
-- heartbeat says after an outage), and, when the allocation is ready once its sidecar says so
-- (ready_when 'declared'), whether that record's sidecar said so; and the connection number that
-- answer belongs to (no row: no allocation; a declaration bumps it too). Also the seconds from
-- now to the row's connect deadline as it stands with that answer (NULL: none): a disconnect
-- since the claim read its row gave a fresh one; for a sidecar reported dead, the deadline is
-- passed, and exit_message says how it died.
SELECT a.connection_seq,
       CASE WHEN a.exited_at IS NOT NULL AND a.generation = :generation
            THEN least(extract(epoch FROM a.connect_deadline - now())::float8, 0)
            ELSE extract(epoch FROM a.connect_deadline - now())::float8 END AS deadline_in,
       CASE WHEN a.generation = :generation THEN a.exit_message END AS exit_message,
       hubd_sidecar_live(a.id, :generation, :ttl, :instance_id)
       AND (a.ready_when IS DISTINCT FROM 'declared' OR coalesce((
           -- By key (LIMIT 1 keeps the look-up off a scan of every record).
           SELECT c.declared_ready AND c.generation = :generation
           FROM hubd_sidecar_connections AS c WHERE c.allocation_id = a.id LIMIT 1), false))
           AS connected
FROM hubd_allocations AS a WHERE a.id = :allocation_id;

-- name: publish
-- Connection :connection_id of generation :generation of :allocation_id publishes what its sidecar
-- serves at: :endpoint (NULL: unchanged) and :metadata (a JSON object's text, NULL: unchanged),
-- merged over the stored object as a JSON merge patch of its top level: each key replaces the
-- stored one, a key given null removes it. Fenced: written only while that connection holds the
-- allocation's current record of the allocation's current generation, provisioning or allocated.
-- The record is read in this statement's snapshot; the allocation row is locked, and its
-- connection number, which every record, clear and declaration of readiness bumps (and which
-- the current record carries), must still be the record's: a record or clear that commits while
-- this statement waits for the lock moves the number on, and nothing is written. A merged object
-- larger than the column's 16 KiB is not written either (too_large). Before the acceptance
-- (provisioning) the patches are also kept merged as one (sidecar_patch, keys given null kept as
-- null), which must fit in 16 KiB too: the acceptance puts the provisioner's metadata under them,
-- whichever is written first (hubd_accepted_metadata). Writes only when something changes: an
-- unchanged publish makes no event. Returns one row: whether the fence held, and whether the
-- merge was too large.
WITH current AS (
    SELECT c.seq FROM hubd_sidecar_connections AS c
    WHERE c.allocation_id = :allocation_id AND c.connection_id = :connection_id
      AND c.generation = :generation
), merged AS (
    SELECT a.id, a.endpoint AS old_endpoint, a.metadata AS old_metadata,
           coalesce(:endpoint::text, a.endpoint) AS endpoint,
           CASE WHEN :metadata::text IS NULL THEN a.metadata
                ELSE (coalesce(a.metadata::jsonb, '{}'::jsonb) || :metadata::text::jsonb)
                     - ARRAY(SELECT key FROM jsonb_each(:metadata::text::jsonb)
                             WHERE value = 'null'::jsonb) END AS metadata,
           a.sidecar_patch AS old_patch,
           CASE WHEN :metadata::text IS NULL OR a.status <> 'provisioning' THEN a.sidecar_patch
                ELSE coalesce(a.sidecar_patch::jsonb, '{}'::jsonb) || :metadata::text::jsonb
           END AS patch
    FROM hubd_allocations AS a
    WHERE a.id = :allocation_id AND a.generation = :generation
      AND a.status IN ('provisioning', 'allocated')
      AND a.connection_seq = (SELECT seq FROM current)
    FOR NO KEY UPDATE
), updated AS (
    UPDATE hubd_allocations AS a SET
        endpoint = m.endpoint,
        metadata = m.metadata,
        sidecar_patch = m.patch,
        updated_at = now()
    FROM merged AS m
    WHERE a.id = m.id AND a.id = :allocation_id
      AND (m.metadata IS NULL OR octet_length(m.metadata::text) <= 16384)
      AND (m.patch IS NULL OR octet_length(m.patch::text) <= 16384)
      AND (m.old_endpoint IS DISTINCT FROM m.endpoint
           OR m.old_metadata::jsonb IS DISTINCT FROM m.metadata::jsonb
           OR m.old_patch::jsonb IS DISTINCT FROM m.patch::jsonb)
    RETURNING a.id
)
SELECT EXISTS (SELECT 1 FROM merged) AS fenced_in,
       coalesce((SELECT octet_length(metadata::text) > 16384
                        OR octet_length(patch::text) > 16384 FROM merged), false) AS too_large,
       (SELECT count(*) FROM updated) AS written;

-- name: declare_ready
-- Connection :connection_id of generation :generation of :allocation_id says its sidecar is
-- ready. Fenced as publish is (the connection holds the current record of the current
-- generation, provisioning or allocated, and the row's connection number is still the
-- record's). Only where the allocation is ready once its sidecar says so (ready_when
-- 'declared') and the record has not said so yet does it write anything; then, as the record
-- statement does for a connect: the record is marked declared, the connection number is bumped
-- (and the record carries the new one), and with :ready_on_connect (no on-ready hook) an
-- allocation parked waiting for its sidecar (allocated, not ready, no initialization marker, no
-- live lease) becomes ready here, with its ledger row; otherwise the allocation is made due and
-- woken, and a claim holding it sees the bump when it parks or marks ready. 'hubd_connected'
-- announces the new number (waiters wake). :instance_id is the instance for the ledger. Returns
-- one row: whether the fence held, whether anything was written, whether the allocation became
-- ready, and the record's number.
WITH current AS (
    SELECT c.seq, c.declared_ready FROM hubd_sidecar_connections AS c
    WHERE c.allocation_id = :allocation_id AND c.connection_id = :connection_id
      AND c.generation = :generation
), fenced AS (
    SELECT a.id, a.ready_when IS NOT DISTINCT FROM 'declared'
                 AND NOT (SELECT declared_ready FROM current) AS declares,
           (:ready_on_connect::boolean AND a.status = 'allocated' AND NOT a.connection_ready
            AND a.initialization_lease_id IS NULL
            AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= clock_timestamp()))
               AS ready_now
    FROM hubd_allocations AS a
    WHERE a.id = :allocation_id AND a.generation = :generation
      AND a.status IN ('provisioning', 'allocated')
      AND a.connection_seq = (SELECT seq FROM current)
    FOR UPDATE
), alloc AS (
    UPDATE hubd_allocations AS a SET
        connection_seq = a.connection_seq + 1,
        -- As in record: readiness only where the row as updated is allocated.
        connection_ready = a.connection_ready OR (f.ready_now AND a.status = 'allocated'),
        next_attempt_at = CASE WHEN f.ready_now THEN NULL
                               WHEN a.next_attempt_at IS NULL OR a.next_attempt_at > now()
                               THEN now() ELSE a.next_attempt_at END,
        connect_deadline = CASE WHEN f.ready_now THEN NULL ELSE a.connect_deadline END,
        lease_id = CASE WHEN f.ready_now THEN NULL ELSE a.lease_id END,
        lease_expires_at = CASE WHEN f.ready_now THEN NULL ELSE a.lease_expires_at END,
        ensure_attempts = CASE WHEN f.ready_now THEN 0 ELSE a.ensure_attempts END,
        destroy_attempts = CASE WHEN f.ready_now THEN 0 ELSE a.destroy_attempts END,
        failure_code = CASE WHEN f.ready_now THEN NULL ELSE a.failure_code END,
        failure_message = CASE WHEN f.ready_now THEN NULL ELSE a.failure_message END,
        updated_at = now()
    FROM fenced AS f
    WHERE a.id = f.id AND a.id = :allocation_id AND f.declares
    RETURNING a.id, a.generation, a.connection_seq, f.ready_now, a.provisioner_id
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    SELECT id, generation, :instance_id, 'mark_ready', 'allocated', 'allocated', 'committed',
           'ready on the sidecar''s declaration'
    FROM alloc WHERE ready_now
), declared AS (
    UPDATE hubd_sidecar_connections AS c SET declared_ready = true, seq = alloc.connection_seq
    FROM alloc
    WHERE c.allocation_id = alloc.id AND c.connection_id = :connection_id
    RETURNING c.seq
), notified AS (
    SELECT pg_notify('hubd_connected',
                     hubd_notice(alloc.id, alloc.generation || ':' || alloc.connection_seq || ':'
                                 || :connection_id)),
           CASE WHEN NOT alloc.ready_now THEN pg_notify('hubd_wake', alloc.provisioner_id) END
    FROM alloc
)
SELECT EXISTS (SELECT 1 FROM fenced) AS fenced_in,
       (SELECT seq FROM declared) AS seq,
       coalesce((SELECT ready_now FROM alloc), false) AS ready,
       (SELECT count(*) FROM notified) AS notified;

-- name: declare_not_ready
-- Connection :connection_id of generation :generation of :allocation_id says its sidecar can no
-- longer serve (its readiness check failed). Fenced as declare_ready is. Only where the
-- allocation is ready once its sidecar says so (ready_when 'declared') and the record has said
-- so does it write anything: the record is marked not declared, the connection number is bumped
-- (the record carries the new one: a claim about to make the row ready on the declaration is
-- fenced off), and the allocation reads not ready, as a connected sidecar that has not declared
-- does (readiness): one that was ready gets a connect deadline :connect_timeout seconds away, by
-- which its sidecar must declare again or be abandoned, is scheduled for it unless a claim holds
-- it, and gets a ledger row 'sidecar_not_ready' (by :instance_id); one not ready yet keeps its
-- deadline and schedule. Nothing is notified: no waiter waits for readiness to go. Returns one
-- row: whether the fence held, the record's new number (NULL: nothing was to write), and whether
-- the allocation stopped being ready.
WITH current AS (
    SELECT c.seq, c.declared_ready FROM hubd_sidecar_connections AS c
    WHERE c.allocation_id = :allocation_id AND c.connection_id = :connection_id
      AND c.generation = :generation
), fenced AS (
    SELECT a.id, a.ready_when IS NOT DISTINCT FROM 'declared'
                 AND (SELECT declared_ready FROM current) AS withdraws,
           a.connection_ready AS was_ready,
           a.lease_expires_at IS NOT NULL AND a.lease_expires_at > clock_timestamp() AS leased
    FROM hubd_allocations AS a
    WHERE a.id = :allocation_id AND a.generation = :generation
      AND a.status IN ('provisioning', 'allocated')
      AND a.connection_seq = (SELECT seq FROM current)
    FOR NO KEY UPDATE
), alloc AS (
    UPDATE hubd_allocations AS a SET
        connection_seq = a.connection_seq + 1,
        connection_ready = false,
        connect_deadline = CASE WHEN f.was_ready
                                THEN now() + make_interval(secs => :connect_timeout)
                                ELSE a.connect_deadline END,
        next_attempt_at = CASE WHEN f.was_ready AND NOT f.leased
                               THEN now() + make_interval(secs => :connect_timeout)
                               ELSE a.next_attempt_at END,
        updated_at = now()
    FROM fenced AS f
    WHERE a.id = f.id AND a.id = :allocation_id AND f.withdraws
    RETURNING a.id, a.generation, a.connection_seq, f.was_ready
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    SELECT id, generation, :instance_id, 'sidecar_not_ready', 'allocated', 'allocated',
           'committed', 'the sidecar said it cannot serve'
    FROM alloc WHERE was_ready
    RETURNING 1
), undeclared AS (
    UPDATE hubd_sidecar_connections AS c SET declared_ready = false, seq = alloc.connection_seq
    FROM alloc
    WHERE c.allocation_id = alloc.id AND c.connection_id = :connection_id
    RETURNING c.seq
)
SELECT EXISTS (SELECT 1 FROM fenced) AS fenced_in,
       (SELECT seq FROM undeclared) AS seq,
       coalesce((SELECT was_ready FROM alloc), false) AS withdrawn,
       (SELECT count(*) FROM logged) AS logged;

-- name: check_sockets
-- For each socket an instance holds (allocation :allocation_ids[i], connection :connection_ids[i]):
-- the allocation's status and generation now, and which connection holds its record (NULL: none).
-- Each socket's rows are read by key, one lookup per socket (LIMIT keeps the lookups from being
-- planned as joins): a plan made on tables the statistics call empty may otherwise hash every
-- allocation and every record, or compare every socket with every record.
SELECT s.allocation_id, s.connection_id, a.status, a.generation,
       c.connection_id AS recorded_connection_id, c.seq AS recorded_seq
FROM unnest(:allocation_ids::text[], :connection_ids::text[]) AS s (allocation_id, connection_id)
LEFT JOIN LATERAL (
    SELECT status, generation FROM hubd_allocations WHERE id = s.allocation_id LIMIT 1
) AS a ON true
LEFT JOIN LATERAL (
    SELECT connection_id, seq FROM hubd_sidecar_connections
    WHERE allocation_id = s.allocation_id LIMIT 1
) AS c ON true;

-- name: stale
-- Connections whose instance is gone or whose heartbeat is older than :ttl seconds.
SELECT c.allocation_id, c.generation, c.connection_id, c.instance_id
FROM hubd_sidecar_connections AS c
LEFT JOIN hubd_instances AS i ON i.id = c.instance_id
WHERE i.id IS NULL OR i.heartbeat_at <= now() - make_interval(secs => :ttl)
ORDER BY c.allocation_id;

-- name: record_activity
-- The sidecars of generations (:allocation_ids[i], :generations[i]) showed activity: each
-- allocation still allocated at that generation, with an idle clock running, goes idle its
-- idle_timeout from now, and a warning given for its idle deadline (not a nearer lifetime's)
-- is withdrawn. A clock restarted within the last second (or the last 5% of a shorter
-- timeout) is left as it is, unless a warning is out: a sidecar reporting activity many times
-- a second writes about once a second. The rows are locked in id order, as every multi-row
-- statement takes them. Returns the generations whose clock runs (restarted now or lately).
WITH input AS (
    SELECT DISTINCT i.allocation_id, i.generation
    FROM unnest(:allocation_ids::text[], :generations::integer[]) AS i (allocation_id, generation)
    ORDER BY i.allocation_id
), current AS (
    SELECT a.id, a.generation, a.stale
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT id, generation,
               expiring OR idle_at < now() + make_interval(
                   secs => idle_timeout - least(1.0, idle_timeout * 0.05)) AS stale
        FROM hubd_allocations
        WHERE id = i.allocation_id AND generation = i.generation AND status = 'allocated'
          AND idle_at IS NOT NULL
        LIMIT 1
    ) AS a
), locked AS (
    SELECT a.id FROM current AS c
    CROSS JOIN LATERAL (
        SELECT id FROM hubd_allocations
        WHERE id = c.id AND generation = c.generation AND status = 'allocated'
        LIMIT 1
        FOR NO KEY UPDATE
    ) AS a
    WHERE c.stale
), updated AS (
    UPDATE hubd_allocations AS a SET
        expiring = a.expiring AND a.expires_at IS NOT NULL AND a.expires_at < a.idle_at,
        idle_at = now() + make_interval(secs => a.idle_timeout),
        updated_at = now()
    FROM locked AS l
    WHERE a.id = l.id AND a.id = ANY (:allocation_ids::text[])
    RETURNING a.id
)
SELECT c.id, c.generation FROM current AS c
WHERE NOT c.stale OR c.id IN (SELECT id FROM updated);

-- name: takes_in_flight
-- Whether a take is uncommitted (hubd_takes_in_flight): a replica that heard of takes looks
-- for them again until none is. Its own statement, before the announcement's: a take that
-- commits between the two is then in that statement's snapshot.
SELECT hubd_takes_in_flight() AS in_flight;

-- name: announce_takes
-- The takes whose sidecars are connected to :instance_id, and every take older than
-- :stale_after seconds wherever its sidecar is (one lost, or held by a replica that died; NULL:
-- none), announced: their events are written at this commit (hubd_record_event). A row another
-- transaction holds is skipped: that transaction's own update announces it. Rows locked in id
-- order, as every multi-row statement takes them; found through the hand-overs owed (every
-- take not announced owes one: hubd_allocations_handover_idx). Returns each, and whether its
-- sidecar is owed its session (the hand-over to send, where its socket is held).
WITH due AS (
    SELECT a.id FROM hubd_allocations AS a
    WHERE a.handover_pending AND a.take_unannounced
      AND (EXISTS (SELECT 1 FROM hubd_sidecar_connections AS c
                   WHERE c.allocation_id = a.id AND c.instance_id = :instance_id)
           OR a.taken_at < now() - make_interval(secs => :stale_after::float8))
    ORDER BY a.id
    FOR UPDATE OF a SKIP LOCKED
)
UPDATE hubd_allocations AS a SET take_unannounced = false
FROM due
WHERE a.id = due.id
RETURNING a.id, a.generation, a.tenant_id, a.session_id,
    a.handover_pending AND a.status IN ('provisioning', 'allocated') AS owed;

-- name: owed_handovers
-- Every hand-over still owed, as handovers answers (hubd_allocations_handover_idx): the socket
-- check sends those whose sockets are held here again.
SELECT a.id, a.generation, a.tenant_id, a.session_id
FROM hubd_allocations AS a
WHERE a.handover_pending AND a.status IN ('provisioning', 'allocated');

-- name: acknowledge_handovers
-- Connections :connection_ids[i] of generations :generations[i] of :allocation_ids[i] say their
-- sidecars hold their sessions (a 'session_ack' each). Each fenced as publish is (the
-- connection holds the current record of the current generation, provisioning or allocated,
-- and the row's connection number is still the record's); the rows locked in id order, as
-- every multi-row statement takes them. Each one owed a hand-over has handover_pending
-- cleared, and with it the provisioning clock the take of a member that must declare started
-- (an allocation that reads ready to its application from here gets a 'ready' event), with a
-- ledger row 'handover' by :instance_id. Returns a row per connection whose fence held: whether
-- a hand-over was owed (and is now done).
WITH input AS (
    SELECT DISTINCT i.connection_id, i.allocation_id, i.generation
    FROM unnest(:connection_ids::text[], :allocation_ids::text[], :generations::integer[])
        AS i (connection_id, allocation_id, generation)
    ORDER BY i.allocation_id
), fenced AS (
    SELECT i.connection_id, a.id, a.handover_pending
    FROM input AS i
    CROSS JOIN LATERAL (
        SELECT x.id, x.handover_pending FROM hubd_allocations AS x
        WHERE x.id = i.allocation_id AND x.generation = i.generation
          AND x.status IN ('provisioning', 'allocated')
          AND x.connection_seq = (
              SELECT c.seq FROM hubd_sidecar_connections AS c
              WHERE c.allocation_id = i.allocation_id AND c.connection_id = i.connection_id
                AND c.generation = i.generation)
        LIMIT 1
        FOR NO KEY UPDATE
    ) AS a
), updated AS (
    UPDATE hubd_allocations AS a SET
        handover_pending = false,
        starting_since = CASE WHEN a.connection_ready THEN NULL ELSE a.starting_since END,
        updated_at = now()
    FROM (SELECT DISTINCT f.id FROM fenced AS f WHERE f.handover_pending) AS f
    WHERE a.id = f.id AND a.id = ANY (:allocation_ids::text[])
    RETURNING a.id, a.generation, a.status
), logged AS (
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    SELECT u.id, u.generation, :instance_id, 'handover', u.status, u.status, 'committed',
        'the sidecar holds its session'
    FROM updated AS u
)
SELECT f.connection_id, EXISTS (SELECT 1 FROM updated AS u WHERE u.id = f.id) AS handed_over
FROM fenced AS f;
