-- The current schema of hubd, as every migration applied in order leaves it.

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

-- Serves the claim: only active, scheduled rows, oldest due first. Terminal rows never enter it,
-- so the claim's cost does not grow with history.
CREATE INDEX hubd_allocations_due_idx ON hubd_allocations (next_attempt_at, id)
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

-- The due rows a claim takes, oldest first, locked and skipping rows another claimer holds.
-- Statistics lag a burst: a table analyzed while nearly empty makes "few rows are due" look
-- true, and the planner then fetches every due row and sorts them, under load and with a burst's
-- dead tuples 10-15 ms a claim, where walking the due index in order stops at the rows wanted.
-- The settings leave that walk the only plan, in this function alone.
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
    seq           bigint NOT NULL DEFAULT 0
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
-- record, by key. STABLE: it sees the calling statement's snapshot, as the inline look did.
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

-- Whenever an allocation moves to a newer generation or becomes terminal, every replica hears
-- it on 'hubd_sockets' ('<allocation>:<generation>:fence|retire') and closes the sockets it holds
-- that no longer belong: the replica that wrote the transition is rarely the one holding them.
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
    PERFORM pg_notify('hubd_sockets', NEW.id || ':' || NEW.generation || ':' ||
        CASE WHEN terminal THEN 'retire' ELSE 'fence' END);
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
