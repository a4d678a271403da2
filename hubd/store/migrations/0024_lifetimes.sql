-- 0024_lifetimes: an allocation may have a lifetime (asked for with the request, bounded by its
-- provisioner's max_lifetime, extended by the application), a pending one that no daemon
-- serves fails after its provisioner's pending_timeout, an expiring event comes before the
-- end, and every end says who or what ended it (docs/api.md, "Lifetimes").

ALTER TABLE hubd_allocations
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN expiring boolean NOT NULL DEFAULT false,
    ADD COLUMN end_reason text;
ALTER TABLE hubd_events
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN end_reason text;

-- What each provisioner's daemons allow (docs/operations.md, "Lifetimes"): the longest an
-- allocation may live (max_lifetime seconds, from its request) and how long one may wait
-- pending before it fails as unserved (pending_timeout seconds). Written by every daemon at its
-- start from its [[provisioners]] entries (the last start wins: replicas share one config);
-- read by the request, extend and the deadline sweep, so each decides in its own statement.
CREATE TABLE hubd_provisioner_limits (
    provisioner_id  text PRIMARY KEY,
    max_lifetime    double precision CHECK (max_lifetime > 0),
    pending_timeout double precision CHECK (pending_timeout > 0),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- Serves the deadline sweep: rows with a lifetime, and rows waiting to be served. Only the
-- sweep names created_at, so no look-up by key ever takes the second instead of the primary key.
CREATE INDEX hubd_allocations_expiry_idx ON hubd_allocations (expires_at)
    WHERE expires_at IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');
CREATE INDEX hubd_allocations_pending_idx ON hubd_allocations (created_at)
    WHERE status = 'pending' AND created_at IS NOT NULL;

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

DROP FUNCTION hubd_request_allocation(text, text, text, jsonb, text, text, text);
CREATE FUNCTION hubd_request_allocation(provisioner text, tenant text, session text,
    requested_spec jsonb, requested_key text, requested_ready_when text, instance text,
    requested_lifetime double precision DEFAULT NULL)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    wanted_spec jsonb := coalesce(requested_spec, '{}'::jsonb);
    existing hubd_allocations;
    created hubd_allocations;
    deadline timestamptz;
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
    INSERT INTO hubd_allocations AS a (id, provisioner_id, tenant_id, session_id, spec,
        next_attempt_at, idempotency_key, ready_when, expires_at)
    VALUES ('al_' || replace(gen_random_uuid()::text, '-', ''), provisioner, tenant, session,
        wanted_spec, now(), requested_key, requested_ready_when, deadline)
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
    UPDATE hubd_allocations AS a SET expires_at = wanted, expiring = false, updated_at = now()
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

CREATE OR REPLACE FUNCTION hubd_release_allocation(allocation text, reason text, instance text)
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

CREATE OR REPLACE FUNCTION hubd_record_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
AS $$
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
    ELSIF NEW.expiring AND NOT OLD.expiring THEN
        kind := 'expiring';
    ELSIF OLD.expires_at IS DISTINCT FROM NEW.expires_at THEN
        kind := 'extended';
    ELSE
        kind := 'published';
    END IF;
    LOCK TABLE hubd_feed_lock IN EXCLUSIVE MODE;
    at_position := nextval('hubd_event_position');
    INSERT INTO hubd_events (position, allocation_id, tenant_id, session_id, event, status,
        ready, generation, endpoint, metadata, failure_code, failure_message, expires_at,
        end_reason)
    VALUES (at_position, NEW.id, NEW.tenant_id, NEW.session_id, kind, NEW.status,
        NEW.connection_ready AND NEW.status = 'allocated', NEW.generation, NEW.endpoint,
        NEW.metadata, NEW.failure_code, NEW.failure_message, NEW.expires_at,
        coalesce(NEW.end_reason, CASE WHEN terminal THEN NEW.failure_code END));
    PERFORM pg_notify('hubd_events', json_build_object('position', at_position)::text);
    RETURN NULL;
END;
$$;

DROP TRIGGER hubd_allocations_event_update ON hubd_allocations;
CREATE CONSTRAINT TRIGGER hubd_allocations_event_update
    AFTER UPDATE ON hubd_allocations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.connection_ready IS DISTINCT FROM NEW.connection_ready
          OR OLD.generation IS DISTINCT FROM NEW.generation
          OR OLD.endpoint IS DISTINCT FROM NEW.endpoint
          OR OLD.metadata IS DISTINCT FROM NEW.metadata
          OR OLD.expiring IS DISTINCT FROM NEW.expiring
          OR OLD.expires_at IS DISTINCT FROM NEW.expires_at)
    EXECUTE FUNCTION hubd_record_event();

CREATE OR REPLACE VIEW hubd_v1.allocations WITH (security_barrier) AS
SELECT a.id, a.status::text AS status, (a.status = 'allocated' AND a.connection_ready) AS ready,
    a.generation::integer AS generation, a.provisioner_id AS provisioner, a.tenant_id AS tenant,
    a.session_id AS session, a.spec::jsonb AS spec, a.idempotency_key,
    a.ready_when::text AS ready_when, a.endpoint::text AS endpoint, a.metadata::jsonb AS metadata,
    a.failure_code, a.failure_message, a.created_at, a.updated_at, a.finished_at, a.expires_at,
    coalesce(a.end_reason, CASE WHEN a.status IN ('released', 'failed', 'destroy_failed')
                                THEN a.failure_code END) AS end_reason
FROM hubd_allocations AS a
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR a.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

CREATE OR REPLACE VIEW hubd_v1.events WITH (security_barrier) AS
SELECT e.position, e.at, e.allocation_id, e.tenant_id AS tenant, e.session_id AS session,
    e.event, e.status::text AS status, e.ready, e.generation::integer AS generation, e.endpoint,
    e.metadata, e.failure_code, e.failure_message, e.expires_at, e.end_reason
FROM hubd_events AS e
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR e.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

DROP FUNCTION hubd_v1.request(text, text, text, text, text, text);
CREATE FUNCTION hubd_v1.request(provisioner text, tenant text DEFAULT NULL,
    session text DEFAULT NULL, spec text DEFAULT '{}', idempotency_key text DEFAULT NULL,
    ready_when text DEFAULT NULL, lifetime interval DEFAULT NULL)
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
        request.ready_when, NULL, extract(epoch FROM request.lifetime)::float8) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = made;
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

-- The fixed path of 0016 for every function made or replaced here; none executable by PUBLIC;
-- hubd_app may call the API's new and replaced functions.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_lifetime_deadline(text, double precision, timestamptz)',
        'hubd_request_allocation(text, text, text, jsonb, text, text, text, double precision)',
        'hubd_extend_allocation(text, double precision, text)',
        'hubd_release_allocation(text, text, text)',
        'hubd_record_event()',
        'hubd_v1.request(text, text, text, text, text, text, interval)',
        'hubd_v1.extend(text, interval)']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        GRANT EXECUTE ON FUNCTION hubd_v1.request(text, text, text, text, text, text, interval)
            TO hubd_app;
        GRANT EXECUTE ON FUNCTION hubd_v1.extend(text, interval) TO hubd_app;
    END IF;
END;
$$;
