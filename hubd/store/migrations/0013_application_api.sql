-- 0013_application_api: what applications use (docs/api.md). An allocation carries what its
-- sidecar serves at (endpoint, metadata), how it becomes ready (ready_when) and an optional
-- idempotency key; every change an application can wait on is an event in a commit-ordered,
-- resumable feed and a notification; the schema hubd_v1 is the one way in for every language,
-- executable by the role hubd_app and nothing else.

CREATE DOMAIN hubd_endpoint AS text CONSTRAINT hubd_endpoint_check CHECK (
    length(VALUE) BETWEEN 1 AND 1024);
CREATE DOMAIN hubd_metadata AS jsonb CONSTRAINT hubd_metadata_check CHECK (
    jsonb_typeof(VALUE) = 'object' AND octet_length(VALUE::text) <= 16384);
CREATE DOMAIN hubd_ready_when AS text CONSTRAINT hubd_ready_when_check CHECK (
    VALUE IN ('connected', 'declared'));

ALTER TABLE hubd_allocations
    ADD COLUMN idempotency_key text,
    -- NULL until the claim binds the provisioner, which resolves its default.
    ADD COLUMN ready_when hubd_ready_when,
    -- Published for the current generation only (hubd_clear_published).
    ADD COLUMN endpoint hubd_endpoint,
    ADD COLUMN metadata hubd_metadata;

-- The same key (within a tenant) names the same allocation, for good: a retried request never
-- makes a second one. Only keyed rows have an entry.
CREATE UNIQUE INDEX hubd_allocations_idempotency_idx
    ON hubd_allocations ((coalesce(tenant_id, '')), idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- A sidecar that declares readiness (ready_when = 'declared') says so on its connection: a
-- reconnect starts undeclared.
ALTER TABLE hubd_sidecar_connections ADD COLUMN declared_ready boolean NOT NULL DEFAULT false;

-- What was published belongs to the generation that published it: a generation that is
-- abandoned (replacement, release) takes its endpoint and metadata with it.
CREATE FUNCTION hubd_clear_published() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.endpoint := NULL;
    NEW.metadata := NULL;
    RETURN NEW;
END;
$$;

CREATE TRIGGER hubd_allocations_clear_published
    BEFORE UPDATE OF generation ON hubd_allocations
    FOR EACH ROW
    WHEN (OLD.generation IS DISTINCT FROM NEW.generation)
    EXECUTE FUNCTION hubd_clear_published();

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
    failure_message text
);

-- Events below the horizon have been pruned; a cursor older than it cannot be resumed.
CREATE TABLE hubd_event_horizon (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    position  bigint NOT NULL
);
INSERT INTO hubd_event_horizon (position) VALUES (0);

-- Runs at commit (a deferred constraint trigger), once per changed row. SECURITY DEFINER: at
-- commit the current role is the caller's again (an application's, after hubd_v1.request), which
-- may not write the feed.
CREATE FUNCTION hubd_record_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
DECLARE
    terminal boolean := NEW.status IN ('released', 'failed', 'destroy_failed');
    kind text;
    at_position bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        kind := 'requested';
    ELSIF terminal AND OLD.status IS DISTINCT FROM NEW.status THEN
        kind := NEW.status;
    ELSIF NEW.connection_ready AND NOT OLD.connection_ready THEN
        kind := 'ready';
    ELSIF OLD.status IS DISTINCT FROM NEW.status OR OLD.generation <> NEW.generation THEN
        kind := NEW.status;
    ELSIF OLD.connection_ready AND NOT NEW.connection_ready THEN
        kind := 'not_ready';
    ELSE
        kind := 'published';
    END IF;
    -- Held to the end of the commit: the next transaction's positions come after this one's,
    -- and only once this one is visible.
    PERFORM pg_advisory_xact_lock(hashtext('hubd.events'));
    at_position := nextval('hubd_event_position');
    INSERT INTO hubd_events (position, allocation_id, tenant_id, session_id, event, status,
        ready, generation, endpoint, metadata, failure_code, failure_message)
    VALUES (at_position, NEW.id, NEW.tenant_id, NEW.session_id, kind, NEW.status,
        NEW.connection_ready AND NEW.status = 'allocated', NEW.generation, NEW.endpoint,
        NEW.metadata, NEW.failure_code, NEW.failure_message);
    PERFORM pg_notify('hubd_events', json_build_object(
        'position', at_position, 'allocation_id', NEW.id, 'event', kind,
        'status', NEW.status, 'ready', NEW.connection_ready AND NEW.status = 'allocated',
        'generation', NEW.generation, 'tenant', NEW.tenant_id)::text);
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER hubd_allocations_event_insert
    AFTER INSERT ON hubd_allocations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION hubd_record_event();

CREATE CONSTRAINT TRIGGER hubd_allocations_event_update
    AFTER UPDATE ON hubd_allocations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.connection_ready IS DISTINCT FROM NEW.connection_ready
          OR OLD.generation IS DISTINCT FROM NEW.generation
          OR OLD.endpoint IS DISTINCT FROM NEW.endpoint
          OR OLD.metadata IS DISTINCT FROM NEW.metadata)
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

-- The request, for hubd_v1.request and the daemon's own store alike (:instance the hub that
-- writes the ledger row; NULL for an application). A key already used returns its allocation
-- if the request is the same, and fails naming the key (HU409) if it is not.
CREATE FUNCTION hubd_request_allocation(provisioner text, tenant text, session text,
    requested_spec jsonb, requested_key text, requested_ready_when text, instance text)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    wanted_spec jsonb := coalesce(requested_spec, '{}'::jsonb);
    existing hubd_allocations;
    created hubd_allocations;
BEGIN
    PERFORM hubd_check_request(provisioner, tenant, session, wanted_spec, requested_key,
        requested_ready_when);
    INSERT INTO hubd_allocations AS a (id, provisioner_id, tenant_id, session_id, spec,
        next_attempt_at, idempotency_key, ready_when)
    VALUES ('al_' || replace(gen_random_uuid()::text, '-', ''), provisioner, tenant, session,
        wanted_spec, now(), requested_key, requested_ready_when)
    ON CONFLICT ((coalesce(tenant_id, '')), idempotency_key) WHERE idempotency_key IS NOT NULL
    DO NOTHING
    RETURNING a.* INTO created;
    IF created.id IS NOT NULL THEN
        INSERT INTO hubd_allocation_ledger
            (allocation_id, generation, instance_id, kind, to_status, phase)
        VALUES (created.id, created.generation, instance, 'request', created.status, 'committed');
        -- Named by provisioner, not allocation: PostgreSQL delivers the alike notifications of
        -- one transaction once, so a thousand requests committed together wake a daemon once.
        PERFORM pg_notify('hubd_wake', provisioner);
        RETURN NEXT created;
        RETURN;
    END IF;
    SELECT * INTO existing FROM hubd_allocations AS a
    WHERE coalesce(a.tenant_id, '') = coalesce(tenant, '')
      AND a.idempotency_key = requested_key;
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

-- The application API, version 1. Everything here keeps its name, arguments and columns
-- across migrations; a change that cannot be compatible becomes hubd_v2 beside it.
CREATE SCHEMA hubd_v1;

-- The stable columns: never a token hash, a secret or a lease.
CREATE VIEW hubd_v1.allocations AS
SELECT a.id, a.status::text AS status, (a.status = 'allocated' AND a.connection_ready) AS ready,
    a.generation::integer AS generation, a.provisioner_id AS provisioner, a.tenant_id AS tenant,
    a.session_id AS session, a.spec::jsonb AS spec, a.idempotency_key,
    a.ready_when::text AS ready_when, a.endpoint::text AS endpoint, a.metadata::jsonb AS metadata,
    a.failure_code, a.failure_message, a.created_at, a.updated_at, a.finished_at
FROM hubd_allocations AS a;

CREATE VIEW hubd_v1.events AS
SELECT e.position, e.at, e.allocation_id, e.tenant_id AS tenant, e.session_id AS session,
    e.event, e.status::text AS status, e.ready, e.generation::integer AS generation, e.endpoint,
    e.metadata, e.failure_code, e.failure_message
FROM hubd_events AS e;

-- The functions resolve hubd's tables in the schema that holds them, never through a caller's
-- search_path: SET search_path FROM CURRENT records this one.
SELECT set_config('hubd.saved_search_path', current_setting('search_path'), true),
    set_config('search_path', 'pg_catalog, ' || quote_ident(current_schema()), true);

CREATE FUNCTION hubd_v1.request(provisioner text, tenant text DEFAULT NULL,
    session text DEFAULT NULL, spec jsonb DEFAULT '{}', idempotency_key text DEFAULT NULL,
    ready_when text DEFAULT NULL)
RETURNS hubd_v1.allocations LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    made text;
    result hubd_v1.allocations;
BEGIN
    SELECT r.id INTO made FROM hubd_request_allocation($1, $2, $3, $4, $5, $6, NULL) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = made;
    RETURN result;
END;
$$;

CREATE FUNCTION hubd_v1.release(allocation_id text, reason text DEFAULT 'release requested')
RETURNS hubd_v1.allocations LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    released text;
    result hubd_v1.allocations;
BEGIN
    SELECT r.id INTO released FROM hubd_release_allocation($1, $2, NULL) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = released;
    RETURN result;
END;
$$;

-- The position of the newest event this transaction's snapshot sees: list the allocations and
-- read this in one repeatable-read transaction, then follow the feed from it, and nothing is
-- missed or seen twice.
CREATE FUNCTION hubd_v1.event_cursor()
RETURNS bigint LANGUAGE sql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
    SELECT greatest((SELECT max(position) FROM hubd_events),
        (SELECT position FROM hubd_event_horizon))
$$;

-- The events after position :after_position, oldest first, at most :max_events, of one tenant or
-- allocation when given. A cursor the feed no longer covers fails (HU410) rather than skip.
CREATE FUNCTION hubd_v1.events_after(after_position bigint, tenant text DEFAULT NULL,
    allocation_id text DEFAULT NULL, max_events integer DEFAULT 1000)
RETURNS SETOF hubd_v1.events LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
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

SELECT set_config('search_path', current_setting('hubd.saved_search_path'), true);

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA hubd_v1 FROM PUBLIC;
REVOKE ALL ON FUNCTION hubd_record_event() FROM PUBLIC;

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
    END IF;
END;
$$;
