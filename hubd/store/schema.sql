-- The current schema of hubd, as every migration applied in order leaves it.

-- Nobody but the schema's owner creates objects where hubd's functions look for names: a
-- function or operator created there could outbid the built-in one a hubd function calls.
-- (A migrating role that does not own the schema changes nothing here: PostgreSQL warns.)
DO $$
BEGIN
    EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', current_schema());
END;
$$;

-- A rule about one column is a domain, not a table constraint. PostgreSQL reads a table's CHECK
-- constraints from their stored text and plans them again in every statement that writes the
-- table, whichever columns it writes: 20 us a statement for the allocations' nine, more than the
-- update itself, paid by every park and release of a pipelined batch. A domain's rule is read
-- once per connection, and checked only where a statement assigns the column. The rules that
-- tie columns together stay table constraints.
CREATE DOMAIN hubd_status AS text CONSTRAINT hubd_status_check CHECK (VALUE IN (
    'pending', 'provisioning', 'allocated', 'replacing', 'releasing',
    'released', 'failed', 'destroy_failed'));
CREATE DOMAIN hubd_generation AS integer CONSTRAINT hubd_generation_check CHECK (VALUE >= 1);
CREATE DOMAIN hubd_attempts AS integer CONSTRAINT hubd_attempts_check CHECK (VALUE >= 0);
CREATE DOMAIN hubd_spec AS jsonb CONSTRAINT hubd_spec_check CHECK (jsonb_typeof(VALUE) = 'object');
-- A token's or a secret's hash.
CREATE DOMAIN hubd_sha256 AS bytea CONSTRAINT hubd_sha256_check CHECK (octet_length(VALUE) = 32);
CREATE DOMAIN hubd_ledger_phase AS text CONSTRAINT hubd_ledger_phase_check CHECK (
    VALUE IN ('intent', 'committed', 'failed', 'ambiguous'));
CREATE DOMAIN hubd_error_code AS text CONSTRAINT hubd_error_code_check CHECK (length(VALUE) <= 64);
CREATE DOMAIN hubd_ledger_message AS text CONSTRAINT hubd_ledger_message_check CHECK (
    length(VALUE) <= 500);
CREATE DOMAIN hubd_duration_ms AS double precision CONSTRAINT hubd_duration_ms_check CHECK (
    VALUE >= 0);
CREATE DOMAIN hubd_endpoint AS text CONSTRAINT hubd_endpoint_check CHECK (
    length(VALUE) BETWEEN 1 AND 1024);
CREATE DOMAIN hubd_metadata AS jsonb CONSTRAINT hubd_metadata_check CHECK (
    jsonb_typeof(VALUE) = 'object' AND octet_length(VALUE::text) <= 16384);
CREATE DOMAIN hubd_ready_when AS text CONSTRAINT hubd_ready_when_check CHECK (
    VALUE IN ('connected', 'declared'));

CREATE TABLE hubd_allocations (
    id                              text PRIMARY KEY,
    status                          hubd_status NOT NULL DEFAULT 'pending',
    generation                      hubd_generation NOT NULL DEFAULT 1,
    provisioner_id                  text NOT NULL,
    provisioner_api_version         text,
    provisioner_binding_fingerprint text,
    tenant_id                       text,
    session_id                      text,
    spec                            hubd_spec NOT NULL DEFAULT '{}'::jsonb,
    sidecar_id                      text,
    token_hash                      hubd_sha256,
    external_ref                    text,
    connect_deadline                timestamptz,
    connection_ready                boolean NOT NULL DEFAULT false,
    -- Bumped by every statement that records or clears a connection; claims fence on it.
    connection_seq                  bigint NOT NULL DEFAULT 0,
    initialization_lease_id         text,
    ensure_attempts                 hubd_attempts NOT NULL DEFAULT 0,
    destroy_attempts                hubd_attempts NOT NULL DEFAULT 0,
    next_attempt_at                 timestamptz,
    lease_id                        text,
    lease_expires_at                timestamptz,
    failure_code                    text,
    failure_message                 text,
    created_at                      timestamptz NOT NULL DEFAULT now(),
    updated_at                      timestamptz NOT NULL DEFAULT now(),
    finished_at                     timestamptz,
    -- An application's key for the request: the same key (within a tenant) names the same
    -- allocation, for good.
    idempotency_key                 text,
    -- NULL until the claim binds the provisioner, which resolves its default.
    ready_when                      hubd_ready_when,
    -- What the sidecar serves at, published for the current generation only
    -- (hubd_clear_published).
    endpoint                        hubd_endpoint,
    metadata                        hubd_metadata,
    -- The current generation's sidecar died, as its provisioner reported (what it said, when);
    -- a bind of a new sidecar clears both.
    exit_message                    text,
    exited_at                       timestamptz,
    -- Sidecars abandoned since replacements_since (a [reconciler] replacement_window); give_up:
    -- the count passed replacement_limit, and the release under way ends 'failed'.
    replacements                    integer NOT NULL DEFAULT 0,
    replacements_since              timestamptz,
    give_up                         boolean NOT NULL DEFAULT false,
    -- What the current generation's sidecar published before the acceptance, as one merge patch
    -- of the top level (a key it removed holds null): the acceptance merges the provisioner's
    -- metadata under it, whichever came first, and clears it (publish, mark_allocated, park).
    sidecar_patch                   hubd_metadata,
    -- When the allocation must end (its lifetime from its request, or an extension; NULL:
    -- never), whether the expiring warning was given, and who or what ended it ('application',
    -- 'operator', 'expired', 'unserved'; a failure's code is in failure_code).
    expires_at                      timestamptz,
    expiring                        boolean NOT NULL DEFAULT false,
    end_reason                      text,
    -- The idle timeout (seconds; NULL: none) and when the allocation goes idle unless its
    -- sidecar or application shows activity; when its provisioning clock started (claimed or
    -- replacing, not ready yet; hubd_stamp_clocks keeps both clocks).
    idle_timeout                    double precision CHECK (idle_timeout > 0),
    idle_at                         timestamptz,
    starting_since                  timestamptz,
    -- The pool that made the row (kept once taken: warm it stays) and when a request took it
    -- (NULL: a member no tenant owns yet; docs/pools.md).
    pool_id                         text,
    taken_at                        timestamptz,
    -- A taken member's sidecar has not yet acknowledged its session (architecture §4,
    -- "Hand-over"); cleared by the acknowledgement or a new generation.
    handover_pending                boolean NOT NULL DEFAULT false,
    -- A take whose events are not yet written: the next update of the row writes them
    -- (architecture §8, "A take's events").
    take_unannounced                boolean NOT NULL DEFAULT false,
    CONSTRAINT hubd_allocations_taken_check CHECK (taken_at IS NULL OR pool_id IS NOT NULL),
    CONSTRAINT hubd_allocations_exit_message_check CHECK (octet_length(exit_message) <= 8192),
    -- A lease is an id and an expiry together, never one without the other.
    CONSTRAINT hubd_allocations_lease_check CHECK ((lease_id IS NULL) = (lease_expires_at IS NULL)),
    -- A sidecar identity is bound with its token hash; the raw token is never stored.
    CONSTRAINT hubd_allocations_identity_check CHECK ((sidecar_id IS NULL) = (token_hash IS NULL)),
    -- Only an allocated allocation can have a ready connection.
    CONSTRAINT hubd_allocations_ready_check CHECK (NOT connection_ready OR status = 'allocated'),
    -- Terminal rows are never scheduled or leased.
    CONSTRAINT hubd_allocations_terminal_check CHECK (
        status NOT IN ('released', 'failed', 'destroy_failed')
        OR (next_attempt_at IS NULL AND lease_id IS NULL))
);

-- Serves the claim: only active, scheduled rows, by tenant (no tenant: ''), oldest due first
-- within each. Terminal rows never enter it, so the claim's cost does not grow with history.
CREATE INDEX hubd_allocations_due_idx ON hubd_allocations
    ((coalesce(tenant_id, '')), next_attempt_at, id)
    WHERE next_attempt_at IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

-- Serves the active status counts of /metrics, start-up repair and the repair sweep. The count
-- reads this index alone (an index-only scan, grouped in index order), so it costs what the
-- active rows cost whatever the history; keyed by id only, it read each row's heap tuple in id
-- order once the table was large and a bitmap scan of the same rows while it was small, 1.15x
-- apart at 1,000,000 against 10,000 finished rows (docs/performance.md). The id after the
-- status keeps a transition's "id = ... AND status IN (...)", which implies the predicate, an
-- exact descent should the planner ever take this index for it rather than the primary key.
CREATE INDEX hubd_allocations_active_idx ON hubd_allocations (status, id)
    WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

-- No index serves listings by status or time: a non-HOT update writes an entry into every index
-- of the table, so each index costs every transition of every allocation, and `alloc list`, an
-- operator's occasional command, reads the table instead (an index on status and created_at
-- cost six entries per allocation's lifecycle and served no statement of hubd's;
-- docs/performance.md).

-- Serves orphan collection: is this sidecar the current one of an active allocation? Only a
-- statement that names a sidecar implies "sidecar_id IS NOT NULL", so only such a statement can
-- use it. Without that, any statement on an active status could, and after an ANALYZE that saw
-- few active rows the planner preferred reading this whole index, filtered by id, to the
-- primary key: 3,213 pages a release in a bench run with 2,000 active rows.
CREATE INDEX hubd_allocations_sidecar_idx ON hubd_allocations (sidecar_id)
    WHERE sidecar_id IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

CREATE TABLE hubd_allocation_ledger (
    seq           bigint GENERATED ALWAYS AS IDENTITY,
    allocation_id text NOT NULL REFERENCES hubd_allocations (id),
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    generation    hubd_generation NOT NULL,
    lease_id      text,
    instance_id   text,
    effect_id     text,
    kind          text NOT NULL,
    from_status   text,
    to_status     text,
    phase         hubd_ledger_phase NOT NULL,
    error_code    hubd_error_code,
    message       hubd_ledger_message,
    duration_ms   hubd_duration_ms,
    -- Every read goes by allocation, in order: the key it reads by is the only one the table
    -- needs. seq comes from the identity's sequence, so no two rows share one without an index
    -- of its own to say so, which would cost every ledger row a second entry.
    PRIMARY KEY (allocation_id, seq)
);

-- Effects whose outcome was never recorded; a later claim settles them as ambiguous.
CREATE INDEX hubd_allocation_ledger_open_intent_idx ON hubd_allocation_ledger (allocation_id, effect_id)
    WHERE effect_id IS NOT NULL;

-- The ledger is evidence: rows are appended, never changed.
CREATE FUNCTION hubd_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'hubd_allocation_ledger is append-only';
END;
$$;

CREATE TRIGGER hubd_allocation_ledger_append_only
    BEFORE UPDATE OR DELETE ON hubd_allocation_ledger
    FOR EACH ROW EXECUTE FUNCTION hubd_ledger_append_only();

-- The ledger rows a transition writes, in order: its own row (own_kind, own_from → own_to,
-- committed, with own_code and own_message) and the rows of the plugin calls it brackets
-- (effects, a JSON array of rows, each with a place: negative before the transition's own row,
-- positive after it).
CREATE FUNCTION hubd_ledger_rows(effects jsonb, own_kind text, own_from text, own_to text,
    own_code text DEFAULT NULL, own_message text DEFAULT NULL)
RETURNS TABLE (kind text, from_status text, to_status text, phase text, error_code text,
    message text, effect_id text, duration_ms double precision)
LANGUAGE sql IMMUTABLE AS $$
    SELECT r.kind, r.from_status, r.to_status, r.phase, r.error_code, r.message, r.effect_id,
        r.duration_ms
    FROM (
        SELECT 0 AS place, own_kind AS kind, own_from AS from_status, own_to AS to_status,
            'committed' AS phase, own_code AS error_code, own_message AS message,
            NULL::text AS effect_id, NULL::double precision AS duration_ms
        UNION ALL
        SELECT e.place, e.kind, e.from_status, e.to_status, e.phase, e.error_code, e.message,
            e.effect_id, e.duration_ms
        FROM jsonb_to_recordset(effects) AS e (place integer, kind text, from_status text,
            to_status text, phase text, error_code text, message text, effect_id text,
            duration_ms double precision)
    ) AS r
    ORDER BY r.place
$$;

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
-- one of the burst's claims to end (docs/measurements.md, "Fair claiming among tenants").
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

-- Whether a plugin call of the allocation has an intent and no outcome, looked up through the
-- allocation's own ledger rows. Written inline in the claim, the planner may instead (on a
-- ledger it believes small) collect every open intent of the whole ledger once and hash them:
-- 14 ms a claim at 20,000 ledger rows. A function with a setting is never inlined, so this runs
-- per claimed row, by index.
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

CREATE TABLE hubd_instances (
    id           text PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    ws_url       text,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    provisioners text[]  -- the provisioner ids it serves; NULL: it does not say
);

-- At most one current connection per allocation: its key. Every statement finds a record by
-- its allocation; the connection id only tells two sockets of one allocation apart, so it needs
-- no index (a second entry for every record, and one more on every takeover).
CREATE TABLE hubd_sidecar_connections (
    connection_id text NOT NULL,
    allocation_id text PRIMARY KEY REFERENCES hubd_allocations (id),
    generation    hubd_generation NOT NULL,
    sidecar_id    text NOT NULL,
    instance_id   text NOT NULL,
    connected_at  timestamptz NOT NULL DEFAULT now(),
    -- The allocation's connection_seq when written: the higher of two records took over.
    seq           bigint NOT NULL DEFAULT 0,
    -- A sidecar that declares readiness (ready_when = 'declared') says so on its connection: a
    -- reconnect starts undeclared.
    declared_ready boolean NOT NULL DEFAULT false
);

-- Serves a replica's own records and a dead instance's sweep. Only a statement that names an
-- instance implies the predicate, so a look at one allocation's record (park, readiness) cannot
-- take this index: after an ANALYZE that saw no records, the planner rated a walk of every
-- record here as cheap as the allocation's key, and each park read all of them (0.79 ms a park
-- with 2,000 sidecars connected, against 0.43 for a bind).
CREATE INDEX hubd_sidecar_connections_instance_idx ON hubd_sidecar_connections (instance_id)
    WHERE instance_id IS NOT NULL;

-- Whether generation :wanted_generation of the allocation has a current connection record on an
-- instance whose heartbeat is within :ttl seconds, or on :instance (the asker: it holds the
-- socket, whatever its heartbeat says after an outage). Written inline (park, readiness), the
-- planner may instead, on a table it believes small, read every record once and hash them, and
-- keep that generic plan while the burst fills the table: 4,000 pages a park at 2,000 records in
-- the test. A function with a setting is never inlined, so this reads the allocation's own
-- record, by key. STABLE: it sees the calling statement's snapshot, as the inline look did. A
-- generation whose sidecar was reported dead (exited_at) is never live, whatever record its
-- socket left.
CREATE FUNCTION hubd_sidecar_live(
    allocation text, wanted_generation integer, ttl double precision, instance text)
RETURNS boolean
LANGUAGE sql STABLE
SET enable_seqscan = off
AS $$
    SELECT EXISTS (
        SELECT 1 FROM hubd_sidecar_connections AS c
        LEFT JOIN hubd_instances AS i ON i.id = c.instance_id
        WHERE c.allocation_id = allocation AND c.generation = wanted_generation
          AND (i.heartbeat_at > now() - make_interval(secs => ttl) OR c.instance_id = instance))
    AND NOT EXISTS (
        SELECT 1 FROM hubd_allocations AS a
        WHERE a.id = allocation AND a.generation = wanted_generation
          AND a.exited_at IS NOT NULL)
$$;

-- A sidecar whose connection record went is lost: the one rule of every statement that clears
-- records (disconnect_many, sweep_stale and release_instance in connections.sql). For each
-- allocation lost_ids[i] whose record of generation lost_generations[i] was cleared, while that
-- generation is current and provisioning or allocated, the connection number is bumped and the
-- row reads not ready. An allocated one also gets a new connect deadline connect_timeout seconds
-- away, is scheduled for it unless a claim holds the row (the claim's connection-fenced write
-- sees the bumped number and decides again; its lease is never touched), and gets a committed
-- ledger row of ledger_kind with lost_messages[i] (a shorter or NULL array: no message), written
-- by instance. Returns how many ledger rows were written. A sidecar reported dead (exited_at)
-- keeps its passed deadline and, unless a claim holds it, is due at once. The caller has locked
-- the allocation rows, in id order, before it cleared their records: the lock order of
-- connections.sql.
-- The rows are found by key, through a map of the arrays made once per call, whatever the
-- statistics the plan was made from. PL/pgSQL, not SQL: it keeps its plans for the session,
-- where before PostgreSQL 18 a SQL function's are made again at every call.
CREATE FUNCTION hubd_connection_lost(lost_ids text[], lost_generations integer[],
    lost_messages text[], ledger_kind text, connect_timeout double precision, instance text)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    seen jsonb;
    logged integer;
BEGIN
    SELECT jsonb_object_agg(l.id, jsonb_build_array(l.generation, l.message)) INTO seen
    FROM unnest(lost_ids, lost_generations, lost_messages) AS l (id, generation, message);
    WITH updated AS (
        UPDATE hubd_allocations AS a SET
            connection_seq = a.connection_seq + 1,
            connection_ready = false,
            connect_deadline = CASE WHEN a.exited_at IS NOT NULL
                                    THEN least(a.connect_deadline, now())
                                    WHEN a.status = 'allocated'
                                    THEN now() + make_interval(secs => connect_timeout)
                                    ELSE a.connect_deadline END,
            next_attempt_at = CASE WHEN a.status = 'allocated'
                                        AND (a.lease_expires_at IS NULL
                                             OR a.lease_expires_at <= clock_timestamp())
                                   THEN CASE WHEN a.exited_at IS NOT NULL THEN now()
                                             ELSE now() + make_interval(secs => connect_timeout)
                                        END
                                   ELSE a.next_attempt_at END,
            updated_at = now()
        WHERE a.id = ANY (lost_ids)
          AND (seen -> a.id ->> 0)::integer = a.generation
          AND a.status IN ('provisioning', 'allocated')
        RETURNING a.id, a.generation, a.status
    ), written AS (
        INSERT INTO hubd_allocation_ledger
            (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
        SELECT u.id, u.generation, instance, ledger_kind, u.status, u.status, 'committed',
            seen -> u.id ->> 1
        FROM updated AS u WHERE u.status = 'allocated'
        RETURNING 1
    )
    SELECT count(*) INTO logged FROM written;
    RETURN logged;
END;
$$;

-- A generation's reconnect secret (protocol v2): only its holder may take over the connection.
CREATE TABLE hubd_sidecar_secrets (
    allocation_id text PRIMARY KEY REFERENCES hubd_allocations (id),
    -- The identity the secret belongs to: a row of an older generation or sidecar counts as no
    -- secret at all, so a replacement starts with none and needs no statement to forget it.
    generation    hubd_generation NOT NULL,
    sidecar_id    text NOT NULL,
    -- The secret of the latest welcome; NULL while only v1 sidecars (which cannot be told one)
    -- have connected.
    secret_hash   hubd_sha256,
    -- The secret that authenticated the latest connection (NULL: the token alone did). It stays
    -- valid until that connection acknowledges its welcome: a sidecar whose welcome was lost
    -- still holds it.
    previous_hash hubd_sha256,
    acknowledged  boolean NOT NULL DEFAULT false,
    rotated_at    timestamptz NOT NULL DEFAULT now()
);

-- Serves the sweep of dead instances' records and their own deletion.
CREATE INDEX hubd_instances_heartbeat_idx ON hubd_instances (heartbeat_at);

-- The key the daemons' internal notifications ('hubd_sockets', 'hubd_connected') are tagged
-- and authenticated with: any role of the server may LISTEN on any channel, so they name an
-- allocation by a tag, never by its id, and may NOTIFY on any, so each carries a mac (see
-- hubd_notice). Random, made once by the migration, never shown to an application role (it has
-- no privilege on the table) and never changed (a daemon reads it once, at its start).
CREATE TABLE hubd_notice_key (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key       hubd_sha256 NOT NULL
);
-- gen_random_uuid() draws on the server's strong random source (122 random bits each).
INSERT INTO hubd_notice_key (key)
VALUES (sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8')));

-- An allocation's tag in the daemons' notifications: the first 32 hex digits of
-- sha256(key || the id's UTF-8). A daemon computes the same tag (hubd.store.channels.NoticeKey)
-- for the allocations it holds sockets or waiters of; without the key a tag names nothing.
-- hubd_notice makes the tags of the notifications itself; this one is kept for a daemon of the
-- release before migration 0020, still running during a rolling restart.
CREATE FUNCTION hubd_notice_tag(allocation text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT left(encode(sha256(k.key || convert_to(allocation, 'UTF8')), 'hex'), 32)
    FROM hubd_notice_key AS k
$$;

-- An allocation's notice on the daemons' channels, whole: '<tag>:<fields>:<mac>', where the tag
-- is hubd_notice_tag's and the mac is the first 32 hex digits of
-- sha256(key || 'hubd-notice:' || '<tag>:<fields>' as UTF-8): any role may NOTIFY on any channel
-- too, and a daemon checks the mac (hubd.store.channels.NoticeKey) before it reads anything
-- else. The prefix keeps a mac from ever being a tag (no id starts with it). One function, the
-- key read once, so a statement that notifies pays one call per row: its path is set per call,
-- which costs more than either hash.
CREATE FUNCTION hubd_notice(allocation text, fields text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT n.body || ':'
           || left(encode(sha256(n.key || convert_to('hubd-notice:' || n.body, 'UTF8')), 'hex'), 32)
    FROM (SELECT k.key,
                 left(encode(sha256(k.key || convert_to(allocation, 'UTF8')), 'hex'), 32) || ':'
                 || fields AS body
          FROM hubd_notice_key AS k) AS n
$$;

-- Whenever an allocation moves to a newer generation or becomes terminal, every replica hears
-- it on 'hubd_sockets' ('<tag>:<generation>:fence|retire:<mac>', made by hubd_notice) and
-- closes the sockets it holds that no longer belong: the replica that wrote the transition is
-- rarely the one holding them.
-- The same transaction removes the connection record those sockets leave behind, so a closing
-- socket has nothing to clear.
-- A trigger, so that no transition (the reconciler's, a user's release, a future one) can forget.
CREATE FUNCTION hubd_socket_control() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    terminal boolean := NEW.status IN ('released', 'failed', 'destroy_failed');
BEGIN
    -- A finished allocation has no connection, and an older generation's record can never be
    -- current again (a record is written only for the current generation).
    DELETE FROM hubd_sidecar_connections
    WHERE allocation_id = NEW.id AND (terminal OR generation < NEW.generation);
    PERFORM pg_notify('hubd_sockets', hubd_notice(NEW.id, NEW.generation || ':' ||
        CASE WHEN terminal THEN 'retire' ELSE 'fence' END));
    RETURN NULL;
END;
$$;

CREATE TRIGGER hubd_allocations_socket_control
    AFTER UPDATE OF generation, status ON hubd_allocations
    FOR EACH ROW
    WHEN (OLD.generation IS DISTINCT FROM NEW.generation
          OR (NEW.status IN ('released', 'failed', 'destroy_failed')
              AND OLD.status NOT IN ('released', 'failed', 'destroy_failed')))
    EXECUTE FUNCTION hubd_socket_control();

-- The same key (within a tenant) names the same allocation, for good: a retried request never
-- makes a second one. Only keyed rows have an entry.
CREATE UNIQUE INDEX hubd_allocations_idempotency_idx
    ON hubd_allocations ((coalesce(tenant_id, '')), idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- What was published belongs to the generation that published it: a generation that is
-- abandoned (replacement, release) takes its endpoint and metadata with it.
CREATE FUNCTION hubd_clear_published() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.endpoint := NULL;
    NEW.metadata := NULL;
    NEW.sidecar_patch := NULL;
    RETURN NEW;
END;
$$;

CREATE TRIGGER hubd_allocations_clear_published
    BEFORE UPDATE OF generation ON hubd_allocations
    FOR EACH ROW
    WHEN (OLD.generation IS DISTINCT FROM NEW.generation)
    EXECUTE FUNCTION hubd_clear_published();

-- The metadata an acceptance records (mark_allocated, park with accept): the provisioner's
-- (provided; NULL: it gave none, and what is stored stays) with what the generation's sidecar
-- published over it, whichever was written first: patch, the sidecar's publishes before the
-- acceptance (a key given null stays removed), or, where none was kept, what is stored. A merge
-- that would pass the 16 KiB of hubd_metadata keeps what the sidecar published alone: its own
-- word is the later one.
CREATE FUNCTION hubd_accepted_metadata(provided jsonb, patch jsonb, stored jsonb)
RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN provided IS NULL OR octet_length(m.merged::text) > 16384 THEN stored
                ELSE m.merged END
    FROM (SELECT (provided || coalesce(patch, stored, '{}'::jsonb))
                 - ARRAY(SELECT key FROM jsonb_each(coalesce(patch, '{}'::jsonb))
                         WHERE value = 'null'::jsonb) AS merged) AS m
$$;

-- The event feed. position is commit order: it is assigned while the committing transaction
-- holds the feed's lock, which it keeps until its commit is visible, so a reader that sees
-- position N sees every position below it, and a transaction that committed late can never land
-- behind a cursor (a sequence value taken earlier in a transaction would: sequence order is not
-- commit order).
CREATE SEQUENCE hubd_event_position AS bigint;

CREATE TABLE hubd_events (
    position        bigint PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    allocation_id   text NOT NULL,
    tenant_id       text,
    session_id      text,
    event           text NOT NULL,
    status          hubd_status NOT NULL,
    ready           boolean NOT NULL,
    generation      hubd_generation NOT NULL,
    endpoint        text,
    metadata        jsonb,
    failure_code    text,
    failure_message text,
    expires_at      timestamptz,
    end_reason      text,
    idle_at         timestamptz,
    warm            boolean NOT NULL DEFAULT false
);

-- Events below the horizon have been pruned; a cursor older than it cannot be resumed.
CREATE TABLE hubd_event_horizon (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    position  bigint NOT NULL
);
INSERT INTO hubd_event_horizon (position) VALUES (0);

-- The feed's lock: an empty table that only hubd's functions may lock. An application role has
-- no privilege on it, so it can neither LOCK it nor hold it; an advisory lock's key, visible in
-- pg_locks, could be taken by any role. EXCLUSIVE conflicts with itself and with nothing a
-- reader takes; pg_locks shows who waits (waitstart) and who holds it.
CREATE TABLE hubd_feed_lock ();

-- Whether the row reads ready to its application: allocated, its sidecar connected (and
-- declared, where it must), and a taken member that must declare has acknowledged its session.
CREATE FUNCTION hubd_ready_to_tenant(status text, connection_ready boolean,
    handover_pending boolean, ready_when text)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT status = 'allocated' AND connection_ready
        AND NOT (handover_pending AND ready_when IS NOT DISTINCT FROM 'declared')
$$;

-- Runs at commit (a deferred constraint trigger), once per changed row. SECURITY DEFINER: at
-- commit the current role is the caller's again (an application's, after hubd_v1.request), which
-- may not write the feed. It takes the feed's lock (hubd_feed_lock), held to the end of the
-- commit: the next transaction's positions come after this one's, and only once this one is
-- visible. The notification carries the position alone: any role may LISTEN on any channel.
-- A take writes nothing (take_unannounced); the update that announces it, the replica's or any
-- other, writes 'requested', 'ready' if the row reads ready then, and its status if that is no
-- longer 'allocated'.
CREATE FUNCTION hubd_record_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
    terminal boolean := NEW.status IN ('released', 'failed', 'destroy_failed');
    now_ready boolean := hubd_ready_to_tenant(NEW.status, NEW.connection_ready,
        NEW.handover_pending, NEW.ready_when);
    was_ready boolean;
    kinds text[];
    kind text;
    at_position bigint;
BEGIN
    IF (NEW.pool_id IS NOT NULL AND NEW.taken_at IS NULL) OR NEW.take_unannounced THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        kinds := ARRAY['requested'];
    ELSE
        was_ready := hubd_ready_to_tenant(OLD.status, OLD.connection_ready,
            OLD.handover_pending, OLD.ready_when);
        IF OLD.take_unannounced OR (OLD.taken_at IS NULL AND NEW.taken_at IS NOT NULL) THEN
            kinds := ARRAY['requested'];
            IF now_ready THEN
                kinds := kinds || 'ready'::text;
            END IF;
            IF NEW.status <> 'allocated' THEN
                kinds := kinds || NEW.status::text;
            END IF;
        ELSIF terminal AND OLD.status IS DISTINCT FROM NEW.status THEN
            kinds := ARRAY[NEW.status::text];
        ELSIF now_ready AND NOT was_ready THEN
            kinds := ARRAY['ready'];
        ELSIF OLD.status IS DISTINCT FROM NEW.status OR OLD.generation <> NEW.generation THEN
            kinds := ARRAY[NEW.status::text];
        ELSIF was_ready AND NOT now_ready THEN
            kinds := ARRAY['not_ready'];
        ELSIF NEW.expiring AND NOT OLD.expiring THEN
            kinds := ARRAY['expiring'];
        ELSIF OLD.expires_at IS DISTINCT FROM NEW.expires_at
              OR (OLD.expiring AND NOT NEW.expiring) THEN
            kinds := ARRAY['extended'];
        ELSIF OLD.endpoint IS DISTINCT FROM NEW.endpoint
              OR OLD.metadata IS DISTINCT FROM NEW.metadata THEN
            kinds := ARRAY['published'];
        ELSE
            -- Nothing the application reads changed (a connection lost and found while a
            -- hand-over was owed, the hand-over's acknowledgement where it was ready already).
            RETURN NULL;
        END IF;
    END IF;
    LOCK TABLE hubd_feed_lock IN EXCLUSIVE MODE;
    FOREACH kind IN ARRAY kinds LOOP
        at_position := nextval('hubd_event_position');
        INSERT INTO hubd_events (position, allocation_id, tenant_id, session_id, event, status,
            ready, generation, endpoint, metadata, failure_code, failure_message, expires_at,
            end_reason, idle_at, warm)
        VALUES (at_position, NEW.id, NEW.tenant_id, NEW.session_id, kind, NEW.status,
            now_ready, NEW.generation, NEW.endpoint, NEW.metadata, NEW.failure_code,
            NEW.failure_message, NEW.expires_at,
            coalesce(NEW.end_reason, CASE WHEN terminal THEN NEW.failure_code END), NEW.idle_at,
            NEW.pool_id IS NOT NULL);
    END LOOP;
    PERFORM pg_notify('hubd_events', json_build_object('position', at_position)::text);
    RETURN NULL;
END;
$$;

-- Queued only for rows whose change can write an event: not for a pool member no tenant has
-- taken, a take not yet announced, or a hand-over acknowledged where readiness does not wait
-- for it (ready_when other than 'declared'); each would cost a call at commit for nothing.
CREATE CONSTRAINT TRIGGER hubd_allocations_event_insert
    AFTER INSERT ON hubd_allocations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN ((NEW.pool_id IS NULL OR NEW.taken_at IS NOT NULL) AND NOT NEW.take_unannounced)
    EXECUTE FUNCTION hubd_record_event();

CREATE CONSTRAINT TRIGGER hubd_allocations_event_update
    AFTER UPDATE ON hubd_allocations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN ((NEW.pool_id IS NULL OR NEW.taken_at IS NOT NULL) AND NOT NEW.take_unannounced
          AND (OLD.status IS DISTINCT FROM NEW.status
               OR OLD.connection_ready IS DISTINCT FROM NEW.connection_ready
               OR OLD.generation IS DISTINCT FROM NEW.generation
               OR OLD.endpoint IS DISTINCT FROM NEW.endpoint
               OR OLD.metadata IS DISTINCT FROM NEW.metadata
               OR OLD.expiring IS DISTINCT FROM NEW.expiring
               OR OLD.expires_at IS DISTINCT FROM NEW.expires_at
               OR OLD.taken_at IS DISTINCT FROM NEW.taken_at
               OR (OLD.handover_pending IS DISTINCT FROM NEW.handover_pending
                   AND (OLD.ready_when = 'declared' OR NEW.ready_when = 'declared'))
               OR OLD.take_unannounced IS DISTINCT FROM NEW.take_unannounced))
    EXECUTE FUNCTION hubd_record_event();

-- Deletes the events older than :keep seconds (at most :batch of them) and moves the horizon
-- past them; returns how many went.
CREATE FUNCTION hubd_prune_events(keep double precision, batch integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    last_pruned bigint;
    pruned integer;
BEGIN
    WITH doomed AS (
        SELECT e.position FROM hubd_events AS e
        WHERE e.at < now() - make_interval(secs => keep)
        ORDER BY e.position
        LIMIT batch
    ), deleted AS (
        DELETE FROM hubd_events AS e USING doomed WHERE e.position = doomed.position
        RETURNING e.position
    )
    SELECT max(deleted.position), count(*) INTO last_pruned, pruned FROM deleted;
    IF last_pruned IS NOT NULL THEN
        UPDATE hubd_event_horizon SET position = greatest(position, last_pruned);
    END IF;
    RETURN pruned;
END;
$$;

-- A request's checks, the same for every caller; a failed one names the argument.
CREATE FUNCTION hubd_check_request(provisioner text, tenant text, session text, spec jsonb,
    idempotency_key text, ready_when text)
RETURNS void LANGUAGE plpgsql STABLE AS $$
DECLARE
    unprintable constant text :=
        '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]';
    label_name text;
    label text;
BEGIN
    IF provisioner IS NULL OR provisioner !~ '^[a-z0-9][a-z0-9_.-]{0,63}$' THEN
        RAISE EXCEPTION 'malformed provisioner id: expected 1-64 characters of a-z, 0-9, ''_'', '
            '''.'', ''-'', starting with a letter or digit' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR label_name, label IN VALUES ('tenant', tenant), ('session', session),
        ('idempotency_key', idempotency_key)
    LOOP
        IF label IS NOT NULL AND (length(label) NOT BETWEEN 1 AND 200 OR label ~ unprintable) THEN
            RAISE EXCEPTION '% must be a non-empty string of at most 200 printable characters',
                label_name USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    IF spec IS NOT NULL AND jsonb_typeof(spec) <> 'object' THEN
        RAISE EXCEPTION 'spec must be a JSON object, not %', jsonb_typeof(spec)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(spec::text) > 65536 THEN
        RAISE EXCEPTION 'spec is larger than 64 KiB' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_path_exists(spec,
        'strict $.**{32 to last} ? (@.type() == "object" || @.type() == "array")') THEN
        RAISE EXCEPTION 'spec nests deeper than 32 levels' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF ready_when IS NOT NULL AND ready_when NOT IN ('connected', 'declared') THEN
        RAISE EXCEPTION 'ready_when must be ''connected'' or ''declared'', not %',
            quote_literal(left(ready_when, 40)) USING ERRCODE = 'invalid_parameter_value';
    END IF;
END;
$$;

-- An operator's limits on what one tenant may ask for (`hubd tenant quota`, docs/operations.md
-- "Quotas"): at most max_active allocations not yet ended, at most max_pending of them still
-- waiting for a sidecar, and requests refilled at rate per second up to burst (a token bucket).
-- tenant_key: 'tenant:' and the tenant, 'untenanted' for requests with no tenant, 'default' for
-- every tenant with no row of its own (each counted on its own). NULL: no such limit. Only hubd
-- reads it: an application role has no privilege on it. counter_id names the row's refusal
-- counters (hubd_refusal_counter): a number, not the tenant, since every role may read relation
-- names in pg_class.
CREATE TABLE hubd_tenant_quotas (
    tenant_key  text PRIMARY KEY,
    max_active  integer,
    max_pending integer,
    rate        double precision,
    burst       integer,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    counter_id  bigint GENERATED ALWAYS AS IDENTITY,
    CONSTRAINT hubd_tenant_quotas_key_check CHECK (tenant_key IN ('default', 'untenanted')
        OR (tenant_key LIKE 'tenant:_%' AND length(tenant_key) <= 207)),
    CONSTRAINT hubd_tenant_quotas_counts_check CHECK (max_active >= 0 AND max_pending >= 0),
    CONSTRAINT hubd_tenant_quotas_rate_check CHECK ((rate IS NULL) = (burst IS NULL)
        AND rate > 0 AND rate <= 1000000 AND burst BETWEEN 1 AND 1000000)
);

-- A tenant's request bucket (tokens as of refilled_at) and how many requests it admitted; one
-- row per tenant_key a quota applied to. Its row lock is what serializes a tenant's requests
-- while a quota applies (hubd_admit_request).
CREATE TABLE hubd_tenant_usage (
    tenant_key  text PRIMARY KEY,
    tokens      double precision NOT NULL,
    refilled_at timestamptz NOT NULL,
    admitted    bigint NOT NULL DEFAULT 0
);

-- A refusal raises in the caller's transaction, which rolls back, so a count written there would
-- vanish with it: each quota row counts its refusals in sequences of its own, whose nextval no
-- rollback undoes (docs/operations.md, "Tenants in the metrics"). This names the one counting
-- quota row `counter`'s refusals by quota_limit ('max_active', 'max_pending' or 'rate'), the
-- limit named in the refusal's DETAIL.
CREATE FUNCTION hubd_refusal_counter(counter bigint, quota_limit text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT 'hubd_quota_refusals_' || counter::text || '_' || quota_limit
$$;

-- A quota row's counters come and go with it, owned by hubd's owner (SECURITY DEFINER) whoever
-- set the quota, and readable by no other role: their values say how often a tenant was
-- refused. A quota cleared and set again counts from zero (Prometheus reads a reset).
CREATE FUNCTION hubd_quota_counters() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    quota_limit text;
BEGIN
    FOREACH quota_limit IN ARRAY ARRAY['max_active', 'max_pending', 'rate'] LOOP
        IF TG_OP = 'INSERT' THEN
            EXECUTE format('CREATE SEQUENCE %I.%I', TG_TABLE_SCHEMA,
                hubd_refusal_counter(NEW.counter_id, quota_limit));
            EXECUTE format('REVOKE ALL ON SEQUENCE %I.%I FROM PUBLIC', TG_TABLE_SCHEMA,
                hubd_refusal_counter(NEW.counter_id, quota_limit));
        ELSE
            EXECUTE format('DROP SEQUENCE IF EXISTS %I.%I', TG_TABLE_SCHEMA,
                hubd_refusal_counter(OLD.counter_id, quota_limit));
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE TRIGGER hubd_tenant_quotas_counters AFTER INSERT OR DELETE ON hubd_tenant_quotas
    FOR EACH ROW EXECUTE FUNCTION hubd_quota_counters();

-- Counts one refusal where the refusal's rollback cannot undo it. Never fails the refusal it
-- counts: a counter dropped at that moment (its quota cleared meanwhile) goes uncounted.
CREATE FUNCTION hubd_count_refusal(counter bigint, quota_limit text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval(to_regclass(hubd_refusal_counter(counter, quota_limit)));
EXCEPTION WHEN OTHERS THEN
    NULL;
END;
$$;

-- What each provisioner's daemons allow (docs/operations.md, "Lifetimes"): the longest an
-- allocation may live (max_lifetime seconds, from its request) and how long one may wait
-- pending before it fails as unserved (pending_timeout seconds). Written by every daemon at its
-- start from its [[provisioners]] entries (the last start wins: replicas share one config);
-- read by the request, extend and the deadline sweep, so each decides in its own statement.
CREATE TABLE hubd_provisioner_limits (
    provisioner_id  text PRIMARY KEY,
    max_lifetime    double precision CHECK (max_lifetime > 0),
    pending_timeout double precision CHECK (pending_timeout > 0),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- The longest (and default) idle timeout of its allocations, and how long one may take
    -- from its claim to ready before it is given up (seconds; NULL: none).
    idle_timeout    double precision CHECK (idle_timeout > 0),
    provisioning_timeout double precision CHECK (provisioning_timeout > 0)
);

-- Serves the deadline sweep: rows with a lifetime, and rows waiting to be served. Only the
-- sweep names created_at, so no look-up by key ever takes the second instead of the primary key.
CREATE INDEX hubd_allocations_expiry_idx ON hubd_allocations (expires_at)
    WHERE expires_at IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');
CREATE INDEX hubd_allocations_pending_idx ON hubd_allocations (created_at)
    WHERE status = 'pending' AND created_at IS NOT NULL;

-- Serve the deadline sweep only: no look-up by key names idle_at or starting_since.
CREATE INDEX hubd_allocations_idle_idx ON hubd_allocations (idle_at)
    WHERE idle_at IS NOT NULL AND status = 'allocated';
CREATE INDEX hubd_allocations_starting_idx ON hubd_allocations (starting_since)
    WHERE starting_since IS NOT NULL;

-- The clocks that follow from a row's own transitions, set in the statement that makes them
-- whichever statement that is: the provisioning clock starts when a claim takes the row out
-- of pending or a replacement begins, and stops when it becomes ready or leaves the active
-- states; the idle clock restarts at every readiness (a replacement sidecar is a fresh one).
CREATE FUNCTION hubd_stamp_clocks() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IN ('provisioning', 'replacing') THEN
        NEW.starting_since := coalesce(NEW.starting_since, now());
    ELSIF NEW.status <> 'allocated' THEN
        NEW.starting_since := NULL;
    END IF;
    IF NEW.generation <> OLD.generation THEN
        NEW.handover_pending := false;
    END IF;
    IF NEW.connection_ready AND NOT OLD.connection_ready THEN
        NEW.starting_since := NULL;
        IF NEW.idle_timeout IS NOT NULL THEN
            -- A warning given for the idle deadline is withdrawn; one for the lifetime stays.
            NEW.expiring := NEW.expiring AND NEW.expires_at IS NOT NULL
                AND (OLD.idle_at IS NULL OR NEW.expires_at < OLD.idle_at);
            NEW.idle_at := now() + make_interval(secs => NEW.idle_timeout);
        END IF;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER hubd_allocations_clocks
    BEFORE UPDATE ON hubd_allocations
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR (NEW.connection_ready AND NOT OLD.connection_ready))
    EXECUTE FUNCTION hubd_stamp_clocks();

-- The idle timeout of an allocation of provisioner that asks for `wanted` seconds: the wanted
-- one, else the provisioner's idle_timeout, else none (NULL). More than the provisioner's, or
-- not a positive number of seconds, fails (22023) naming both.
CREATE FUNCTION hubd_idle_timeout(provisioner text, wanted double precision)
RETURNS double precision LANGUAGE plpgsql STABLE AS $$
DECLARE
    longest double precision;
BEGIN
    IF wanted IS NOT NULL AND NOT (wanted > 0 AND wanted <= 315360000) THEN
        RAISE EXCEPTION 'idle_timeout must be a positive duration of at most 10 years, not % s',
            wanted USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT l.idle_timeout INTO longest FROM hubd_provisioner_limits AS l
    WHERE l.provisioner_id = provisioner;
    IF wanted > longest THEN
        RAISE EXCEPTION 'idle_timeout % s is longer than provisioner %''s idle_timeout of % s',
            round(wanted::numeric, 3), quote_literal(provisioner), round(longest::numeric, 3)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN coalesce(wanted, longest);
END;
$$;

-- Serves a quota's counts: a tenant's allocations not yet ended, by status. Only a statement
-- that names a tenant implies the predicate, so a look-up by key on statistics that say the
-- table is empty never walks it instead of the primary key. Requests with no tenant are counted
-- through hubd_allocations_active_idx.
CREATE INDEX hubd_allocations_tenant_idx ON hubd_allocations (tenant_id, status)
    WHERE tenant_id IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

-- Whether the tenant's quota (its own row, else the default's) admits one more request now;
-- raises HU429 naming the limit, the tenant and when to try again when it does not. With no
-- quota and no default it costs two look-ups by key. Under a quota the tenant's usage row is
-- updated first: that row's lock serializes the tenant's requests until each requester ends its
-- transaction, so the counts that follow (a fresh snapshot per statement under READ COMMITTED)
-- see every request committed before; a REPEATABLE READ or SERIALIZABLE caller that raced
-- another fails to serialize (40001) instead of counting without it. Concurrent requests, on
-- any number of replicas and connections, never admit past a limit. A refusal rolls back with
-- the caller's transaction (or savepoint): the bucket keeps its token. Each refusal is counted
-- first, against the row that refused (hubd_count_refusal).
CREATE FUNCTION hubd_admit_request(tenant text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    key constant text := CASE WHEN tenant IS NULL THEN 'untenanted' ELSE 'tenant:' || tenant END;
    who constant text := CASE WHEN tenant IS NULL THEN 'requests with no tenant'
                              ELSE 'tenant ' || quote_literal(tenant) END;
    has constant text := CASE WHEN tenant IS NULL THEN 'have' ELSE 'has' END;
    quota hubd_tenant_quotas;
    left_over double precision;
    active_now bigint;
    pending_now bigint;
BEGIN
    SELECT * INTO quota FROM hubd_tenant_quotas AS q WHERE q.tenant_key = key;
    IF NOT FOUND THEN
        SELECT * INTO quota FROM hubd_tenant_quotas AS q WHERE q.tenant_key = 'default';
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    INSERT INTO hubd_tenant_usage AS u (tenant_key, tokens, refilled_at)
    VALUES (key, coalesce(quota.burst, 0), clock_timestamp())
    ON CONFLICT (tenant_key) DO NOTHING;
    UPDATE hubd_tenant_usage AS u SET
        tokens = CASE WHEN quota.rate IS NULL THEN u.tokens
                      ELSE least(quota.burst::float8, u.tokens + quota.rate * greatest(0::float8,
                               extract(epoch FROM clock_timestamp() - u.refilled_at)::float8))
                           - 1 END,
        refilled_at = clock_timestamp(),
        admitted = u.admitted + 1
    WHERE u.tenant_key = key
    RETURNING u.tokens INTO left_over;
    IF quota.rate IS NOT NULL AND left_over < 0 THEN
        PERFORM hubd_count_refusal(quota.counter_id, 'rate');
        RAISE EXCEPTION '% asked faster than its quota of % requests a second (burst %): '
            'retry in % s', who, quota.rate, quota.burst, ceil(-left_over / quota.rate * 10) / 10
            USING ERRCODE = 'HU429', DETAIL = format('limit=rate retry_after=%s',
                ceil(-left_over / quota.rate * 10) / 10);
    END IF;
    IF quota.max_active IS NULL AND quota.max_pending IS NULL THEN
        RETURN;
    END IF;
    IF tenant IS NULL THEN
        SELECT count(*), count(*) FILTER (WHERE a.status = 'pending')
        INTO active_now, pending_now FROM hubd_allocations AS a
        WHERE a.tenant_id IS NULL AND (a.pool_id IS NULL OR a.taken_at IS NOT NULL)
          AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');
    ELSE
        SELECT count(*), count(*) FILTER (WHERE a.status = 'pending')
        INTO active_now, pending_now FROM hubd_allocations AS a
        WHERE a.tenant_id = tenant
          AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');
    END IF;
    IF active_now >= quota.max_active THEN
        PERFORM hubd_count_refusal(quota.counter_id, 'max_active');
        RAISE EXCEPTION '% % % allocations not yet ended, its quota''s max_active: release '
            'one and retry', who, has, active_now
            USING ERRCODE = 'HU429', DETAIL = 'limit=max_active';
    END IF;
    IF pending_now >= quota.max_pending THEN
        PERFORM hubd_count_refusal(quota.counter_id, 'max_pending');
        RAISE EXCEPTION '% % % allocations waiting for a sidecar, its quota''s max_pending: '
            'retry once one is provisioned', who, has, pending_now
            USING ERRCODE = 'HU429', DETAIL = 'limit=max_pending';
    END IF;
END;
$$;

-- When an allocation of provisioner asked at moment `since` for `wanted` seconds must end: the
-- wanted lifetime, else the provisioner's max_lifetime (hubd_provisioner_limits), else never
-- (NULL). Asking for more than the maximum, or for a lifetime that is not a positive number of
-- seconds, fails (22023) naming both.
CREATE FUNCTION hubd_lifetime_deadline(provisioner text, wanted double precision,
    since timestamptz)
RETURNS timestamptz LANGUAGE plpgsql STABLE AS $$
DECLARE
    longest double precision;
BEGIN
    IF wanted IS NOT NULL AND NOT (wanted > 0 AND wanted <= 315360000) THEN
        RAISE EXCEPTION 'lifetime must be a positive duration of at most 10 years, not % s',
            wanted USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT l.max_lifetime INTO longest FROM hubd_provisioner_limits AS l
    WHERE l.provisioner_id = provisioner;
    IF wanted > longest THEN
        RAISE EXCEPTION 'lifetime % s is longer than provisioner %''s max_lifetime of % s',
            round(wanted::numeric, 3), quote_literal(provisioner), round(longest::numeric, 3)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN since + make_interval(secs => coalesce(wanted, longest));
END;
$$;

-- Each pool as the daemons serving its provisioner configure it (the last to start wins, as
-- hubd_provisioner_limits): `size` members kept, at most `refill_rate` made a second. A
-- provisioner and spec name one pool at most, so a request matches one pool or none.
CREATE TABLE hubd_pools (
    pool_id        text PRIMARY KEY CHECK (pool_id ~ '^[a-z0-9][a-z0-9_.-]{0,63}$'),
    provisioner_id text NOT NULL,
    spec           hubd_spec NOT NULL,
    size           integer NOT NULL CHECK (size BETWEEN 0 AND 100000),
    refill_rate    double precision NOT NULL CHECK (refill_rate > 0 AND refill_rate <= 100000),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- The refill's bucket: members may be made until refilled_at reaches now, one per
    -- 1/refill_rate seconds, holding at most a second's worth (or one member) when idle.
    refilled_at    timestamptz NOT NULL DEFAULT '-infinity',
    -- Names the pool's take and miss counters (hubd_pool_counter): a number, not the name.
    counter_id     bigint GENERATED ALWAYS AS IDENTITY,
    -- What a request does when no member is ready: 'cold', 'wait' (up to miss_wait seconds,
    -- then cold) or 'refuse' (HU503).
    miss           text NOT NULL DEFAULT 'cold' CHECK (miss IN ('cold', 'wait', 'refuse')),
    miss_wait      double precision NOT NULL DEFAULT 0
        CHECK (miss_wait >= 0 AND miss_wait <= 30)
);
-- jsonb's text is canonical (keys sorted, no spacing): equal specs have equal digests, and a
-- 64 KiB spec fits no index entry while its digest does.
CREATE UNIQUE INDEX hubd_pools_match_idx ON hubd_pools (provisioner_id, md5(spec::text));

-- The members a request may take, oldest first; and every member not taken and not ended, for
-- the refill's count and the metrics. Only statements that name pool_id and taken_at imply either predicate.
CREATE INDEX hubd_allocations_warm_idx ON hubd_allocations (pool_id, created_at)
    WHERE pool_id IS NOT NULL AND taken_at IS NULL AND status = 'allocated'
      AND connection_ready;
-- The hand-overs owed, for the periodic socket check: few at any moment, whatever the table.
CREATE INDEX hubd_allocations_handover_idx ON hubd_allocations (id) WHERE handover_pending;
-- No index of its own: a take not yet announced is owed its hand-over too (its mark is cleared
-- with take_unannounced, by the acknowledgement or a new generation), so the announcement finds
-- it through hubd_allocations_handover_idx; and with no index on the column the announcement's
-- update is a heap-only one, which writes no index entry.

-- Rows only hubd's functions may lock (an application role has no privilege on the table).
-- Every take holds 'in_flight' FOR KEY SHARE to its commit, so that a replica can see that
-- takes are uncommitted (FOR UPDATE SKIP LOCKED finds the row locked). Time is cut in slots of
-- 20 ms (hubd_take_slot), and slot n rings bell 'bell_<n % 16>': the take that finds its slot's
-- bell free and not yet rung in the slot records the slot in `rang`, holding the row to its
-- commit, and notifies; the others, which found it held or rung, do not. The ring wakes the
-- replicas, which look again while any take is in flight and until the slot rung is over.
-- Sixteen bells: a take kept uncommitted holds one, and silences only the takes of its slots;
-- the next take of another rings, and the replicas then look for as long as the first stays in
-- flight.
CREATE TABLE hubd_take_bells (
    bell text PRIMARY KEY CHECK (bell ~ '^(in_flight|bell_([0-9]|1[0-5]))$'),
    -- The slot the bell last rang in; NULL: never.
    rang bigint
);
INSERT INTO hubd_take_bells (bell)
SELECT 'bell_' || n FROM generate_series(0, 15) AS n UNION ALL SELECT 'in_flight';

-- The current slot of time: 20 ms, by the database's clock.
CREATE FUNCTION hubd_take_slot() RETURNS bigint LANGUAGE sql AS $$
    SELECT floor(extract(epoch FROM clock_timestamp()) * 50)::bigint
$$;
CREATE INDEX hubd_allocations_members_idx ON hubd_allocations (pool_id)
    WHERE pool_id IS NOT NULL AND taken_at IS NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

-- The sequence counting pool row `counter`'s takes or misses (kind 'taken' or 'missed'): a
-- request that takes a member, or matches the pool and finds none ready. A sequence, not a
-- column: a count on the pool's row would lock it until each requester commits, so every
-- request for the pool would wait on the slowest, and an application could hold it for good.
-- A take rolled back with its transaction stays counted.
CREATE FUNCTION hubd_pool_counter(counter bigint, kind text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT 'hubd_pool_' || kind || '_' || counter::text
$$;

-- A pool's counters come and go with its row, owned by hubd's owner whoever wrote the pool.
CREATE FUNCTION hubd_pool_counters() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    kind text;
BEGIN
    FOREACH kind IN ARRAY ARRAY['taken', 'missed'] LOOP
        IF TG_OP = 'INSERT' THEN
            EXECUTE format('CREATE SEQUENCE %I.%I', TG_TABLE_SCHEMA,
                hubd_pool_counter(NEW.counter_id, kind));
            EXECUTE format('REVOKE ALL ON SEQUENCE %I.%I FROM PUBLIC', TG_TABLE_SCHEMA,
                hubd_pool_counter(NEW.counter_id, kind));
        ELSE
            EXECUTE format('DROP SEQUENCE IF EXISTS %I.%I', TG_TABLE_SCHEMA,
                hubd_pool_counter(OLD.counter_id, kind));
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE TRIGGER hubd_pools_counters AFTER INSERT OR DELETE ON hubd_pools
    FOR EACH ROW EXECUTE FUNCTION hubd_pool_counters();

-- Takes a ready member of `pool` for a request, in the request's statement: the oldest member
-- no other transaction holds (SKIP LOCKED: concurrent requests take different members, on any
-- replica, and none waits on another's), checked again as it is locked, so a member lost or
-- taken meanwhile is never handed out. The row becomes the tenant's, with the request's
-- session, key and clocks; its sidecar, generation and connection stay as they are. Its
-- sidecar is owed its session (handover_pending), and its events wait for the take's
-- announcement (take_unannounced; architecture §8): only the take that rings its slot's bell,
-- or cannot mark itself in flight, notifies 'hubd_handover', and with the feed's lock untaken,
-- concurrent takes flush their commits together. A member that is ready once its sidecar says
-- so starts its provisioning clock again, which the acknowledgement stops. NULL when no member
-- is ready (a miss).
CREATE FUNCTION hubd_take_member(pool text, tenant text, session text,
    requested_key text, requested_ready_when text, deadline timestamptz,
    idle double precision, instance text)
RETURNS hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    taken hubd_allocations;
    slot bigint;
BEGIN
    UPDATE hubd_allocations AS a SET
        tenant_id = tenant, session_id = session, idempotency_key = requested_key,
        taken_at = now(), expires_at = deadline, expiring = false, idle_timeout = idle,
        idle_at = now() + make_interval(secs => idle), handover_pending = true,
        take_unannounced = true,
        starting_since = CASE WHEN a.ready_when = 'declared' THEN now() END,
        updated_at = now()
    WHERE a.id = (
        SELECT m.id FROM hubd_allocations AS m
        WHERE m.pool_id = pool AND m.taken_at IS NULL AND m.status = 'allocated'
          AND m.connection_ready
          AND (requested_ready_when IS NULL OR m.ready_when = requested_ready_when)
        ORDER BY m.created_at
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
      AND a.pool_id = pool AND a.taken_at IS NULL AND a.status = 'allocated'
      AND a.connection_ready
    RETURNING a.* INTO taken;
    IF taken.id IS NULL THEN
        RETURN NULL;
    END IF;
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    VALUES (taken.id, taken.generation, instance, 'take', taken.status, taken.status,
        'committed', 'taken from pool ' || pool);
    -- The mark first, then the slot: a take that stays silent has marked itself in flight
    -- before it read the slot, so a replica's look after the slot is over finds it in flight
    -- or committed. SKIP LOCKED: neither ever waits (a replica's look at the mark holds it an
    -- instant); a take that could not mark itself notifies.
    IF NOT EXISTS (SELECT 1 FROM hubd_take_bells AS b WHERE b.bell = 'in_flight'
                   FOR KEY SHARE SKIP LOCKED) THEN
        PERFORM pg_notify('hubd_handover', hubd_notice(taken.id, taken.generation || ':take'));
        RETURN taken;
    END IF;
    slot := hubd_take_slot();
    -- Held: the take ringing it has not committed, and notifies at its commit. Rung in this
    -- slot: the replicas that heard it look until the slot is over.
    UPDATE hubd_take_bells AS b SET rang = slot
    WHERE b.bell = (SELECT c.bell FROM hubd_take_bells AS c
                    WHERE c.bell = 'bell_' || slot % 16 AND c.rang IS DISTINCT FROM slot
                    FOR UPDATE SKIP LOCKED);
    IF FOUND THEN
        PERFORM pg_notify('hubd_handover', hubd_notice(taken.id, taken.generation || ':take'));
    END IF;
    RETURN taken;
END;
$$;

-- Whether a take may yet commit unheard: the slot of a bell rung is not over (a take of it
-- stays silent), or the in-flight mark is held (by a take, to its commit). A replica that
-- finds neither holds the mark an instant, until this statement's commit; while a slot is
-- open it takes no lock.
CREATE FUNCTION hubd_takes_in_flight() RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    slot bigint := hubd_take_slot();
BEGIN
    IF EXISTS (SELECT 1 FROM hubd_take_bells AS b WHERE b.rang >= slot) THEN
        RETURN true;
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM hubd_take_bells AS b WHERE b.bell = 'in_flight'
                       FOR UPDATE SKIP LOCKED);
END;
$$;

-- Any update of a taken row after its take announces the take: its events are written first.
CREATE FUNCTION hubd_announce_take() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.take_unannounced := false;
    RETURN NEW;
END;
$$;

CREATE TRIGGER hubd_allocations_announce
    BEFORE UPDATE ON hubd_allocations
    FOR EACH ROW
    WHEN (OLD.take_unannounced)
    EXECUTE FUNCTION hubd_announce_take();

-- The request, for hubd_v1.request and the daemon's own store alike (:instance the hub that
-- writes the ledger row; NULL for an application). A key already used returns its allocation
-- if the request is the same, and fails naming the key (HU409) if it is not. A new one must be
-- admitted by the tenant's quota (hubd_admit_request, HU429); it then takes a ready member of
-- the pool of its provisioner and spec, if there is one (hubd_take_member), as the pool's miss
-- says when none is ready (HU503 for 'refuse'), and is made cold otherwise. A taken member
-- wakes the daemons, which make a new one in its place.
CREATE FUNCTION hubd_request_allocation(provisioner text, tenant text,
    session text, requested_spec jsonb, requested_key text, requested_ready_when text,
    instance text, requested_lifetime double precision DEFAULT NULL,
    requested_idle_timeout double precision DEFAULT NULL)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    wanted_spec jsonb := coalesce(requested_spec, '{}'::jsonb);
    existing hubd_allocations;
    created hubd_allocations;
    deadline timestamptz;
    idle double precision;
    pool hubd_pools;
    waited_until timestamptz;
    pause double precision := 0.005;
BEGIN
    PERFORM hubd_check_request(provisioner, tenant, session, wanted_spec, requested_key,
        requested_ready_when);
    -- A request that names an allocation made already is answered whatever the quota.
    IF requested_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM hubd_allocations AS a
        WHERE coalesce(a.tenant_id, '') = coalesce(tenant, '')
          AND a.idempotency_key = requested_key) THEN
        PERFORM hubd_admit_request(tenant);
    END IF;
    deadline := hubd_lifetime_deadline(provisioner, requested_lifetime, now());
    idle := hubd_idle_timeout(provisioner, requested_idle_timeout);
    SELECT * INTO pool FROM hubd_pools AS p
    WHERE p.provisioner_id = provisioner AND md5(p.spec::text) = md5(wanted_spec::text)
      AND p.spec = wanted_spec;
    IF pool.pool_id IS NOT NULL THEN
        IF requested_key IS NOT NULL THEN
            -- A take sets the key by UPDATE, which has no ON CONFLICT: two requests with one
            -- key would both take a member, and the second would fail on the key's index. The
            -- tenant's usage row serializes them (it already does under a quota); each then
            -- looks for the key in a snapshot taken after the other committed. A REPEATABLE
            -- READ caller that raced another fails to serialize (40001) on the row instead.
            INSERT INTO hubd_tenant_usage AS u (tenant_key, tokens, refilled_at)
            VALUES (CASE WHEN tenant IS NULL THEN 'untenanted' ELSE 'tenant:' || tenant END,
                0, clock_timestamp())
            ON CONFLICT (tenant_key) DO UPDATE SET admitted = u.admitted;
            SELECT * INTO existing FROM hubd_allocations AS a
            WHERE coalesce(a.tenant_id, '') = coalesce(tenant, '')
              AND a.idempotency_key = requested_key;
        END IF;
        IF existing.id IS NULL THEN
            created := hubd_take_member(pool.pool_id, tenant, session, requested_key,
                requested_ready_when, deadline, idle, instance);
            -- A pool that waits on a miss looks again until a member is ready or its wait is
            -- over, each look in a snapshot of its own: only under READ COMMITTED, where a
            -- member made ready meanwhile can be seen at all. Looks come 5 ms apart at first,
            -- then 50 ms: a burst that emptied the pool costs each waiter a look per 50 ms.
            IF created.id IS NULL AND pool.miss = 'wait'
               AND current_setting('transaction_isolation') = 'read committed' THEN
                waited_until := clock_timestamp() + make_interval(secs => pool.miss_wait);
                WHILE created.id IS NULL AND clock_timestamp() < waited_until LOOP
                    PERFORM pg_sleep(least(pause,
                        extract(epoch FROM waited_until - clock_timestamp())::float8));
                    pause := least(pause * 2, 0.05);
                    created := hubd_take_member(pool.pool_id, tenant, session, requested_key,
                        requested_ready_when, deadline, idle, instance);
                END LOOP;
            END IF;
            -- nextval is strict: a counter dropped with its pool meanwhile counts nothing.
            PERFORM nextval(to_regclass(hubd_pool_counter(pool.counter_id,
                CASE WHEN created.id IS NULL THEN 'missed' ELSE 'taken' END)));
            IF created.id IS NULL AND pool.miss = 'refuse' THEN
                RAISE EXCEPTION 'pool % has no member ready: retry in 1 s',
                    quote_literal(pool.pool_id)
                    USING ERRCODE = 'HU503', DETAIL = 'retry_after=1';
            END IF;
            IF created.id IS NOT NULL THEN
                -- No hubd_wake: a take leaves nothing due to claim, and the daemons hear of
                -- it on hubd_handover (hubd_take_member), which also starts their refill.
                RETURN NEXT created;
                RETURN;
            END IF;
        END IF;
    END IF;
    IF existing.id IS NULL THEN
        INSERT INTO hubd_allocations AS a (id, provisioner_id, tenant_id, session_id, spec,
            next_attempt_at, idempotency_key, ready_when, expires_at, idle_timeout)
        VALUES ('al_' || replace(gen_random_uuid()::text, '-', ''), provisioner, tenant,
            session, wanted_spec, now(), requested_key, requested_ready_when, deadline, idle)
        ON CONFLICT ((coalesce(tenant_id, '')), idempotency_key)
            WHERE idempotency_key IS NOT NULL
        DO NOTHING
        RETURNING a.* INTO created;
        IF created.id IS NOT NULL THEN
            INSERT INTO hubd_allocation_ledger
                (allocation_id, generation, instance_id, kind, to_status, phase)
            VALUES (created.id, created.generation, instance, 'request', created.status,
                'committed');
            -- Named by provisioner, not allocation: PostgreSQL delivers the alike
            -- notifications of one transaction once, so a thousand requests committed
            -- together wake a daemon once.
            PERFORM pg_notify('hubd_wake', provisioner);
            RETURN NEXT created;
            RETURN;
        END IF;
        SELECT * INTO existing FROM hubd_allocations AS a
        WHERE coalesce(a.tenant_id, '') = coalesce(tenant, '')
          AND a.idempotency_key = requested_key;
    END IF;
    IF existing.id IS NULL THEN
        -- The conflicting row is not in this transaction's snapshot (repeatable read).
        RAISE EXCEPTION 'idempotency key % was taken by a transaction this one cannot see',
            quote_literal(requested_key) USING ERRCODE = 'serialization_failure';
    END IF;
    IF existing.provisioner_id <> provisioner OR existing.session_id IS DISTINCT FROM session
        OR existing.spec <> wanted_spec
        OR existing.ready_when IS DISTINCT FROM coalesce(requested_ready_when,
            existing.ready_when) THEN
        RAISE EXCEPTION 'idempotency key % already names allocation %, requested with another '
            'provisioner, session, spec or ready_when', quote_literal(requested_key), existing.id
            USING ERRCODE = 'HU409';
    END IF;
    RETURN NEXT existing;
END;
$$;

-- Keeps pool `pool` at its size, by one daemon at a time (the pool row's lock; another that
-- finds it held skips this turn): members of another spec than the pool's (it was changed) and
-- members past its size (the not yet ready and the newest first) are released, with end_reason
-- 'pool'; then new members are requested, as many as the pool lacks, at most `most` and what
-- its refill_rate allows now, whichever daemons refill it. The count is read after the lock is
-- held, in a snapshot of its own, so it sees every member the previous holder made. Returns how
-- many were made and released, and how many the pool still lacks.
CREATE FUNCTION hubd_refill_pool(pool text, most integer, instance text,
    OUT made integer, OUT released integer, OUT lacking integer)
LANGUAGE plpgsql AS $$
DECLARE
    p hubd_pools;
    kept integer;
    surplus text[];
    victim text;
    window_secs double precision;
    allowed integer;
BEGIN
    made := 0;
    released := 0;
    lacking := 0;
    SELECT * INTO p FROM hubd_pools AS x WHERE x.pool_id = pool FOR NO KEY UPDATE SKIP LOCKED;
    IF p.pool_id IS NULL THEN
        RETURN;
    END IF;
    WITH ranked AS (
        SELECT m.id, m.spec = p.spec AS fits,
            row_number() OVER (PARTITION BY m.spec = p.spec
                ORDER BY m.status = 'allocated' AND m.connection_ready DESC, m.created_at) AS n
        FROM hubd_allocations AS m
        WHERE m.pool_id = pool AND m.taken_at IS NULL
          AND m.status IN ('pending', 'provisioning', 'allocated', 'replacing')
    )
    SELECT count(*) FILTER (WHERE r.fits AND r.n <= p.size),
        coalesce(array_agg(r.id) FILTER (WHERE NOT r.fits OR r.n > p.size), '{}')
    INTO kept, surplus FROM ranked AS r;
    FOREACH victim IN ARRAY surplus LOOP
        UPDATE hubd_allocations AS a SET end_reason = 'pool'
        WHERE a.id = victim AND a.end_reason IS NULL;
        PERFORM hubd_release_allocation(victim, 'pool ' || pool || ' has no room for it',
            instance);
        released := released + 1;
    END LOOP;
    window_secs := greatest(1.0, 1.0 / p.refill_rate);
    allowed := floor(p.refill_rate * least(window_secs,
        extract(epoch FROM clock_timestamp() - p.refilled_at)::float8));
    made := greatest(0, least(most, allowed, p.size - kept));
    lacking := greatest(0, p.size - kept - made);
    IF made > 0 THEN
        UPDATE hubd_pools AS x SET refilled_at = greatest(x.refilled_at,
                clock_timestamp() - make_interval(secs => window_secs))
            + make_interval(secs => made / p.refill_rate)
        WHERE x.pool_id = pool;
        WITH added AS (
            INSERT INTO hubd_allocations AS a (id, provisioner_id, spec, next_attempt_at,
                pool_id)
            SELECT 'al_' || replace(gen_random_uuid()::text, '-', ''), p.provisioner_id,
                p.spec, now(), p.pool_id
            FROM generate_series(1, made)
            RETURNING a.id, a.generation, a.status
        )
        INSERT INTO hubd_allocation_ledger
            (allocation_id, generation, instance_id, kind, to_status, phase, message)
        SELECT added.id, added.generation, instance, 'request', added.status, 'committed',
            'member of pool ' || pool
        FROM added;
        PERFORM pg_notify('hubd_wake', p.provisioner_id);
    END IF;
END;
$$;

-- The members of pools that no longer exist (a pool removed from the configuration), released
-- with end_reason 'pool'; returns how many.
CREATE FUNCTION hubd_release_orphaned_members(instance text)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    victim record;
    released integer := 0;
BEGIN
    FOR victim IN
        SELECT m.id, m.pool_id FROM hubd_allocations AS m
        WHERE m.pool_id IS NOT NULL AND m.taken_at IS NULL
          AND m.status IN ('pending', 'provisioning', 'allocated', 'replacing')
          AND NOT EXISTS (SELECT 1 FROM hubd_pools AS p WHERE p.pool_id = m.pool_id)
        FOR UPDATE OF m SKIP LOCKED
    LOOP
        UPDATE hubd_allocations AS a SET end_reason = 'pool'
        WHERE a.id = victim.id AND a.end_reason IS NULL;
        PERFORM hubd_release_allocation(victim.id, 'pool ' || victim.pool_id || ' was removed',
            instance);
        released := released + 1;
    END LOOP;
    RETURN released;
END;
$$;

-- A release (:reason in the ledger, :instance the hub that writes it): pending with nothing
-- bound goes straight to released; any other active status becomes releasing under a new
-- generation, which fences off the current claim and sidecar. Releasing or finished: nothing
-- changes. Returns the row as it now stands; an unknown id fails (no_data_found).
CREATE FUNCTION hubd_release_allocation(allocation text, reason text, instance text)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    moved integer;
    result hubd_allocations;
BEGIN
    WITH prior AS (
        SELECT a.id, a.status FROM hubd_allocations AS a
        WHERE a.id = allocation
          AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing')
        FOR UPDATE
    ), updated AS (
        UPDATE hubd_allocations AS a SET
            status = CASE WHEN prior.status = 'pending' THEN 'released' ELSE 'releasing' END,
            generation = CASE WHEN prior.status = 'pending' THEN a.generation
                ELSE a.generation + 1 END,
            next_attempt_at = CASE WHEN prior.status = 'pending' THEN NULL ELSE now() END,
            lease_id = CASE WHEN prior.status = 'pending' THEN NULL ELSE a.lease_id END,
            lease_expires_at = CASE WHEN prior.status = 'pending' THEN NULL
                ELSE a.lease_expires_at END,
            finished_at = CASE WHEN prior.status = 'pending' THEN now() END,
            connection_ready = false,
            initialization_lease_id = NULL,
            end_reason = coalesce(a.end_reason,
                CASE WHEN instance IS NULL THEN 'application' ELSE 'operator' END),
            updated_at = now()
        FROM prior
        WHERE a.id = prior.id AND a.id = allocation
        RETURNING a.id, a.generation, a.status, a.provisioner_id, prior.status AS from_status
    ), logged AS (
        INSERT INTO hubd_allocation_ledger
            (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
        SELECT u.id, u.generation, instance, 'release', u.from_status, u.status, 'committed',
            left(coalesce(reason, 'release requested'), 500)
        FROM updated AS u
    ), woken AS (
        -- One per provisioner and transaction; nothing when no row moved.
        SELECT pg_notify('hubd_wake', u.provisioner_id) FROM updated AS u
    )
    SELECT count(*) INTO moved FROM updated, woken;
    SELECT * INTO result FROM hubd_allocations AS a WHERE a.id = allocation;
    IF result.id IS NULL THEN
        RAISE EXCEPTION 'no allocation %', quote_literal(left(allocation, 80))
            USING ERRCODE = 'no_data_found';
    END IF;
    RETURN NEXT result;
END;
$$;

-- An application's (or operator's) extension of a live allocation: it now ends `lifetime`
-- seconds from now, within its provisioner's max_lifetime counted from its request (22023
-- beyond it, naming the latest moment). Pending to allocated only: a release under way or an
-- end is not undone (the row is returned unchanged). Clears the expiring warning; the ledger
-- gets an 'extend' row by instance. An unknown id fails (no_data_found).
CREATE FUNCTION hubd_extend_allocation(allocation text, lifetime double precision,
    instance text)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    found hubd_allocations;
    longest double precision;
    wanted timestamptz;
BEGIN
    SELECT * INTO found FROM hubd_allocations AS a WHERE a.id = allocation FOR NO KEY UPDATE;
    IF found.id IS NULL THEN
        RAISE EXCEPTION 'no allocation %', quote_literal(left(allocation, 80))
            USING ERRCODE = 'no_data_found';
    END IF;
    IF found.status NOT IN ('pending', 'provisioning', 'allocated', 'replacing') THEN
        RETURN NEXT found;
        RETURN;
    END IF;
    IF lifetime IS NULL OR NOT (lifetime > 0 AND lifetime <= 315360000) THEN
        RAISE EXCEPTION 'lifetime must be a positive duration of at most 10 years'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT l.max_lifetime INTO longest FROM hubd_provisioner_limits AS l
    WHERE l.provisioner_id = found.provisioner_id;
    wanted := now() + make_interval(secs => lifetime);
    IF wanted > found.created_at + make_interval(secs => longest) THEN
        RAISE EXCEPTION 'allocation % may live until % at the latest (provisioner %''s '
            'max_lifetime of % s from its request)', found.id,
            found.created_at + make_interval(secs => longest), quote_literal(found.provisioner_id),
            round(longest::numeric, 3) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- An extension is the application's activity too: the idle clock starts again.
    UPDATE hubd_allocations AS a SET expires_at = wanted, expiring = false,
        idle_at = CASE WHEN a.idle_at IS NOT NULL
                       THEN now() + make_interval(secs => a.idle_timeout) END,
        updated_at = now()
    WHERE a.id = found.id
    RETURNING * INTO found;
    INSERT INTO hubd_allocation_ledger
        (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
    VALUES (found.id, found.generation, instance, 'extend', found.status, found.status,
        'committed', 'ends at ' || to_char(wanted AT TIME ZONE 'UTC',
            'YYYY-MM-DD"T"HH24:MI:SS"Z"'));
    RETURN NEXT found;
END;
$$;

-- Activity of an allocation's application: its idle clock starts again (from now, where it
-- has an idle timeout and is not ending), and a warning given for the idle deadline (not the
-- nearer lifetime's) is withdrawn.
CREATE FUNCTION hubd_touch_allocation(allocation text)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    found hubd_allocations;
BEGIN
    UPDATE hubd_allocations AS a SET
        idle_at = CASE WHEN a.idle_at IS NOT NULL
                       THEN now() + make_interval(secs => a.idle_timeout) END,
        expiring = a.expiring AND a.expires_at IS NOT NULL
                   AND (a.idle_at IS NULL OR a.expires_at < a.idle_at),
        updated_at = now()
    WHERE a.id = allocation AND a.idle_timeout IS NOT NULL
      AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing')
    RETURNING * INTO found;
    IF found.id IS NULL THEN
        SELECT * INTO found FROM hubd_allocations AS a WHERE a.id = allocation;
    END IF;
    IF found.id IS NULL THEN
        RAISE EXCEPTION 'no allocation %', quote_literal(left(allocation, 80))
            USING ERRCODE = 'no_data_found';
    END IF;
    RETURN NEXT found;
END;
$$;

-- One orphan sweeper per provisioner across replicas: the sweeper holds its row's lock (FOR
-- UPDATE SKIP LOCKED, in a transaction on a connection of its own) for the sweep. An application
-- role has no privilege on the table, so it can neither take nor keep that lock.
CREATE TABLE hubd_sweep_locks (
    name text PRIMARY KEY
);

-- Which tenant a database role is walled into, or that it sees every tenant (an operator's
-- role). A role with no row, and no row for the login it came from, sees every tenant: the
-- single-tenant behaviour. Names, not OIDs: a role dropped and created again keeps its wall.
-- A key is 'hubd_' || id || '.' || secret; only sha256(secret) is kept. A key sees one tenant
-- (tenant_id) or every tenant (every_tenant, an operator's). Revoked keys stay, so a revoked
-- id is never handed out again and the listing says when it went.
CREATE TABLE hubd_api_keys (
    id           text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{16}$'),
    secret_hash  hubd_sha256 NOT NULL,
    tenant_id    text,
    every_tenant boolean NOT NULL DEFAULT false,
    name         text NOT NULL DEFAULT '' CHECK (length(name) <= 200),
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    CONSTRAINT hubd_api_keys_scope_check CHECK ((tenant_id IS NULL) = every_tenant),
    CONSTRAINT hubd_api_keys_tenant_check CHECK (length(tenant_id) BETWEEN 1 AND 200)
);

CREATE TABLE hubd_tenant_roles (
    role_name    text PRIMARY KEY,
    tenant_id    text,
    every_tenant boolean NOT NULL DEFAULT false,
    granted_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT hubd_tenant_roles_scope_check CHECK ((tenant_id IS NULL) = every_tenant),
    CONSTRAINT hubd_tenant_roles_tenant_check CHECK (length(tenant_id) BETWEEN 1 AND 200)
);

-- The caller's wall: (false, NULL) when it sees every tenant, (true, tenant) when it is walled
-- into one. The caller is the role it SET ROLE to, else the login; a login walled into a
-- tenant stays walled after a SET ROLE to a role with no row (hubd_app itself, say). Neither
-- value can be forged: SET ROLE checks membership, and only a superuser changes session_user.
-- EXECUTE for hubd_app, harmless by design: it tells a caller its own wall. The setting
-- hubd.wall narrows a caller that sees every tenant to that tenant (the HTTP API sets it per
-- request); a walled caller stays walled into its own whatever it sets.
CREATE FUNCTION hubd_caller_scope(OUT restricted boolean, OUT tenant text)
LANGUAGE sql STABLE SECURITY DEFINER AS $$
    SELECT coalesce(chosen.every_tenant = false, false) OR n.narrowed IS NOT NULL,
        CASE WHEN coalesce(chosen.every_tenant = false, false) THEN chosen.tenant_id
             ELSE n.narrowed END
    FROM (SELECT nullif(current_setting('hubd.wall', true), '') AS narrowed) AS n
    LEFT JOIN LATERAL (
        SELECT r.every_tenant, r.tenant_id FROM hubd_tenant_roles AS r
        WHERE r.role_name IN (nullif(current_setting('role'), 'none'), session_user)
        ORDER BY r.role_name = coalesce(nullif(current_setting('role'), 'none'), session_user)
            DESC
        LIMIT 1
    ) AS chosen ON true
$$;

-- A spec as text, bounded before it is parsed: the text is refused past 256 KiB (a parse costs
-- about ten times the text in memory) and past 32 levels of nesting, counted on the text
-- itself (a deep document must not reach the parser's recursion). The parsed spec then meets
-- hubd_check_request's 64 KiB.
CREATE FUNCTION hubd_parse_spec(spec text) RETURNS jsonb LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    brackets text;
    before integer;
BEGIN
    IF spec IS NULL THEN
        RETURN '{}'::jsonb;
    END IF;
    IF octet_length(spec) > 262144 THEN
        RAISE EXCEPTION 'spec is larger than 64 KiB (its text has % bytes, more than the 256 KiB '
            'read before parsing)', octet_length(spec) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Strings gone, only brackets kept; each pass removes the innermost pairs.
    brackets := regexp_replace(regexp_replace(spec, '"(?:[^"\\]|\\.)*"', '', 'g'),
        '[^][{}]', '', 'g');
    FOR depth IN 1..32 LOOP
        EXIT WHEN brackets = '';
        brackets := regexp_replace(brackets, '\[\]|\{\}', '', 'g');
    END LOOP;
    IF brackets <> '' THEN
        before := length(brackets);
        brackets := regexp_replace(brackets, '\[\]|\{\}', '', 'g');
        IF length(brackets) < before THEN
            RAISE EXCEPTION 'spec nests deeper than 32 levels'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION 'spec is not valid JSON: its brackets do not pair up'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- No EXCEPTION block: a subtransaction per request would overflow the backend's cache of
    -- them in a transaction of many requests. PostgreSQL 15 has no pg_input_is_valid; there the
    -- cast's own error (22P02) stands.
    IF current_setting('server_version_num')::integer >= 160000 THEN
        IF NOT pg_input_is_valid(spec, 'jsonb') THEN
            RAISE EXCEPTION 'spec is not valid JSON: %',
                left((pg_input_error_info(spec, 'jsonb')).message, 200)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    RETURN spec::jsonb;
END;
$$;

-- The application API, version 1. Everything here keeps its name, arguments and columns
-- across migrations; a change that cannot be compatible becomes hubd_v2 beside it.
CREATE SCHEMA hubd_v1;

-- The stable columns: never a token hash, a secret or a lease. A walled caller sees its tenant's
-- rows only; security_barrier: the wall is applied before any function of the caller's sees a row.
CREATE VIEW hubd_v1.allocations WITH (security_barrier) AS
SELECT a.id, a.status::text AS status,
    (a.status = 'allocated' AND a.connection_ready
     AND NOT (a.handover_pending AND a.ready_when IS NOT DISTINCT FROM 'declared')) AS ready,
    a.generation::integer AS generation, a.provisioner_id AS provisioner, a.tenant_id AS tenant,
    a.session_id AS session, a.spec::jsonb AS spec, a.idempotency_key,
    a.ready_when::text AS ready_when, a.endpoint::text AS endpoint, a.metadata::jsonb AS metadata,
    a.failure_code, a.failure_message, a.created_at, a.updated_at, a.finished_at, a.expires_at,
    coalesce(a.end_reason, CASE WHEN a.status IN ('released', 'failed', 'destroy_failed')
                                THEN a.failure_code END) AS end_reason,
    make_interval(secs => a.idle_timeout) AS idle_timeout,
    CASE WHEN a.status = 'allocated' THEN a.idle_at END AS idle_at,
    a.pool_id IS NOT NULL AS warm
FROM hubd_allocations AS a
WHERE (a.pool_id IS NULL OR a.taken_at IS NOT NULL)
  AND (NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
       OR a.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s));

CREATE VIEW hubd_v1.events WITH (security_barrier) AS
SELECT e.position, e.at, e.allocation_id, e.tenant_id AS tenant, e.session_id AS session,
    e.event, e.status::text AS status, e.ready, e.generation::integer AS generation, e.endpoint,
    e.metadata, e.failure_code, e.failure_message, e.expires_at, e.end_reason, e.idle_at,
    e.warm
FROM hubd_events AS e
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR e.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

-- The spec arrives as text and is bounded before it is parsed (hubd_parse_spec). A walled caller
-- requests for its tenant: naming none gets its own, naming another is refused.
CREATE FUNCTION hubd_v1.request(provisioner text, tenant text DEFAULT NULL,
    session text DEFAULT NULL, spec text DEFAULT '{}', idempotency_key text DEFAULT NULL,
    ready_when text DEFAULT NULL, lifetime interval DEFAULT NULL,
    idle_timeout interval DEFAULT NULL)
RETURNS hubd_v1.allocations LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    scope record;
    for_tenant text := request.tenant;
    made text;
    result hubd_v1.allocations;
BEGIN
    SELECT * INTO scope FROM hubd_caller_scope();
    IF scope.restricted THEN
        IF for_tenant IS NULL THEN
            for_tenant := scope.tenant;
        ELSIF for_tenant IS DISTINCT FROM scope.tenant THEN
            RAISE EXCEPTION 'this role may request only for tenant %', quote_literal(scope.tenant)
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END IF;
    SELECT r.id INTO made FROM hubd_request_allocation(request.provisioner, for_tenant,
        request.session, hubd_parse_spec(request.spec), request.idempotency_key,
        request.ready_when, NULL, extract(epoch FROM request.lifetime)::float8,
        extract(epoch FROM request.idle_timeout)::float8) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = made;
    RETURN result;
END;
$$;

-- A walled caller releases its tenant's allocations only; another tenant's id is as unknown to
-- it as an id no allocation has.
CREATE FUNCTION hubd_v1.release(allocation_id text,
    reason text DEFAULT 'release requested')
RETURNS hubd_v1.allocations LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    released text;
    result hubd_v1.allocations;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM hubd_v1.allocations AS v WHERE v.id = release.allocation_id)
    THEN
        RAISE EXCEPTION 'no allocation %', quote_literal(left(release.allocation_id, 80))
            USING ERRCODE = 'no_data_found';
    END IF;
    SELECT r.id INTO released FROM hubd_release_allocation($1, $2, NULL) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = released;
    RETURN result;
END;
$$;

-- A walled caller extends its tenant's allocations only (as release).
CREATE FUNCTION hubd_v1.extend(allocation_id text, lifetime interval)
RETURNS hubd_v1.allocations LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    extended text;
    result hubd_v1.allocations;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM hubd_v1.allocations AS v WHERE v.id = extend.allocation_id)
    THEN
        RAISE EXCEPTION 'no allocation %', quote_literal(left(extend.allocation_id, 80))
            USING ERRCODE = 'no_data_found';
    END IF;
    SELECT r.id INTO extended FROM hubd_extend_allocation(extend.allocation_id,
        extract(epoch FROM extend.lifetime)::float8, NULL) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = extended;
    RETURN result;
END;
$$;

-- The application is still using the allocation: its idle clock starts again. A walled caller
-- touches its tenant's allocations only (as release).
CREATE FUNCTION hubd_v1.touch(allocation_id text)
RETURNS hubd_v1.allocations LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    touched text;
    result hubd_v1.allocations;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM hubd_v1.allocations AS v WHERE v.id = touch.allocation_id)
    THEN
        RAISE EXCEPTION 'no allocation %', quote_literal(left(touch.allocation_id, 80))
            USING ERRCODE = 'no_data_found';
    END IF;
    SELECT r.id INTO touched FROM hubd_touch_allocation(touch.allocation_id) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = touched;
    RETURN result;
END;
$$;

-- The position of the newest event this transaction's snapshot sees: list the allocations and
-- read this in one repeatable-read transaction, then follow the feed from it, and nothing is
-- missed or seen twice.
CREATE FUNCTION hubd_v1.event_cursor()
RETURNS bigint LANGUAGE sql STABLE SECURITY DEFINER AS $$
    SELECT greatest((SELECT max(position) FROM hubd_events),
        (SELECT position FROM hubd_event_horizon))
$$;

-- The events after position :after_position, oldest first, at most :max_events, of one tenant or
-- allocation when given. A cursor the feed no longer covers fails (HU410) rather than skip.
CREATE FUNCTION hubd_v1.events_after(after_position bigint, tenant text DEFAULT NULL,
    allocation_id text DEFAULT NULL, max_events integer DEFAULT 1000)
RETURNS SETOF hubd_v1.events LANGUAGE plpgsql STABLE SECURITY DEFINER AS $$
DECLARE
    pruned bigint := (SELECT h.position FROM hubd_event_horizon AS h);
BEGIN
    IF after_position IS NULL OR after_position < 0 THEN
        RAISE EXCEPTION 'after_position must be a position >= 0' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF after_position < pruned THEN
        RAISE EXCEPTION 'event cursor % is older than the feed keeps (it starts after %)',
            after_position, pruned USING ERRCODE = 'HU410',
            HINT = 'read hubd_v1.allocations and hubd_v1.event_cursor() again, then follow on';
    END IF;
    RETURN QUERY
    SELECT * FROM hubd_v1.events AS e
    WHERE e.position > after_position
      AND (events_after.tenant IS NULL OR e.tenant = events_after.tenant)
      AND (events_after.allocation_id IS NULL OR e.allocation_id = events_after.allocation_id)
    ORDER BY e.position
    LIMIT least(greatest(max_events, 1), 10000);
END;
$$;

-- Every hubd function names its objects on one fixed path: the catalog, hubd's schema, and the
-- caller's temporary schema last, where nothing of hubd's can be shadowed. None is executable by
-- PUBLIC; hubd_app gets what it may run below.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc AS p
        WHERE (p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'hubd\_%')
           OR p.pronamespace = 'hubd_v1'::regnamespace
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END;
$$;

-- A take's plans are the same for every pool: planned once per connection, not per call
-- (custom plans cost 0.35 ms a take, a quarter of it, measured).
ALTER FUNCTION hubd_take_member(text, text, text, text, text, timestamptz, double precision, text)
    SET plan_cache_mode = force_generic_plan;


-- The least-privilege role: run the API, read its views, nothing else. Roles belong to the
-- server, not the database: several hubd databases share it, and a migrating role that may not
-- create roles leaves it to the operator (docs/api.md says how).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        BEGIN
            CREATE ROLE hubd_app NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created meanwhile by a migration of another database
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'hubd_app was not created: this role may not create roles';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        GRANT USAGE ON SCHEMA hubd_v1 TO hubd_app;
        GRANT SELECT ON ALL TABLES IN SCHEMA hubd_v1 TO hubd_app;
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA hubd_v1 TO hubd_app;
        GRANT EXECUTE ON FUNCTION hubd_caller_scope() TO hubd_app;
    END IF;
END;
$$;
