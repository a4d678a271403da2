-- 0025_idle_and_starting: an allocation may have an idle timeout (asked for with the request,
-- at most its provisioner's idle_timeout, which is also the default): once ready, it ends as
-- 'idle' when neither its sidecar (an activity message, architecture §4) nor its application
-- (touch, extend) showed activity for that long. And an allocation claimed but not ready
-- within its provisioner's provisioning_timeout is given up as 'provisioning_timeout'
-- (docs/api.md, "Lifetimes").

ALTER TABLE hubd_allocations
    ADD COLUMN idle_timeout double precision CHECK (idle_timeout > 0),
    ADD COLUMN idle_at timestamptz,
    ADD COLUMN starting_since timestamptz;
ALTER TABLE hubd_events
    ADD COLUMN idle_at timestamptz;
ALTER TABLE hubd_provisioner_limits
    ADD COLUMN idle_timeout double precision CHECK (idle_timeout > 0),
    ADD COLUMN provisioning_timeout double precision CHECK (provisioning_timeout > 0);

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

DROP FUNCTION hubd_v1.request(text, text, text, text, text, text, interval);
DROP FUNCTION hubd_request_allocation(text, text, text, jsonb, text, text, text, double precision);
CREATE FUNCTION hubd_request_allocation(provisioner text, tenant text, session text,
    requested_spec jsonb, requested_key text, requested_ready_when text, instance text,
    requested_lifetime double precision DEFAULT NULL,
    requested_idle_timeout double precision DEFAULT NULL)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    wanted_spec jsonb := coalesce(requested_spec, '{}'::jsonb);
    existing hubd_allocations;
    created hubd_allocations;
    deadline timestamptz;
    idle double precision;
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
    INSERT INTO hubd_allocations AS a (id, provisioner_id, tenant_id, session_id, spec,
        next_attempt_at, idempotency_key, ready_when, expires_at, idle_timeout)
    VALUES ('al_' || replace(gen_random_uuid()::text, '-', ''), provisioner, tenant, session,
        wanted_spec, now(), requested_key, requested_ready_when, deadline, idle)
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

CREATE OR REPLACE FUNCTION hubd_extend_allocation(allocation text, lifetime double precision,
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
    ELSIF OLD.expires_at IS DISTINCT FROM NEW.expires_at
          OR (OLD.expiring AND NOT NEW.expiring) THEN
        kind := 'extended';
    ELSE
        kind := 'published';
    END IF;
    LOCK TABLE hubd_feed_lock IN EXCLUSIVE MODE;
    at_position := nextval('hubd_event_position');
    INSERT INTO hubd_events (position, allocation_id, tenant_id, session_id, event, status,
        ready, generation, endpoint, metadata, failure_code, failure_message, expires_at,
        end_reason, idle_at)
    VALUES (at_position, NEW.id, NEW.tenant_id, NEW.session_id, kind, NEW.status,
        NEW.connection_ready AND NEW.status = 'allocated', NEW.generation, NEW.endpoint,
        NEW.metadata, NEW.failure_code, NEW.failure_message, NEW.expires_at,
        coalesce(NEW.end_reason, CASE WHEN terminal THEN NEW.failure_code END), NEW.idle_at);
    PERFORM pg_notify('hubd_events', json_build_object('position', at_position)::text);
    RETURN NULL;
END;
$$;

CREATE OR REPLACE VIEW hubd_v1.allocations WITH (security_barrier) AS
SELECT a.id, a.status::text AS status, (a.status = 'allocated' AND a.connection_ready) AS ready,
    a.generation::integer AS generation, a.provisioner_id AS provisioner, a.tenant_id AS tenant,
    a.session_id AS session, a.spec::jsonb AS spec, a.idempotency_key,
    a.ready_when::text AS ready_when, a.endpoint::text AS endpoint, a.metadata::jsonb AS metadata,
    a.failure_code, a.failure_message, a.created_at, a.updated_at, a.finished_at, a.expires_at,
    coalesce(a.end_reason, CASE WHEN a.status IN ('released', 'failed', 'destroy_failed')
                                THEN a.failure_code END) AS end_reason,
    make_interval(secs => a.idle_timeout) AS idle_timeout,
    CASE WHEN a.status = 'allocated' THEN a.idle_at END AS idle_at
FROM hubd_allocations AS a
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR a.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

CREATE OR REPLACE VIEW hubd_v1.events WITH (security_barrier) AS
SELECT e.position, e.at, e.allocation_id, e.tenant_id AS tenant, e.session_id AS session,
    e.event, e.status::text AS status, e.ready, e.generation::integer AS generation, e.endpoint,
    e.metadata, e.failure_code, e.failure_message, e.expires_at, e.end_reason, e.idle_at
FROM hubd_events AS e
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR e.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

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

-- The fixed path of 0016 for every function made or replaced here; none executable by PUBLIC;
-- hubd_app may call the API's new and replaced functions.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_stamp_clocks()',
        'hubd_idle_timeout(text, double precision)',
        'hubd_request_allocation(text, text, text, jsonb, text, text, text, double precision, '
            'double precision)',
        'hubd_touch_allocation(text)',
        'hubd_extend_allocation(text, double precision, text)',
        'hubd_record_event()',
        'hubd_v1.request(text, text, text, text, text, text, interval, interval)',
        'hubd_v1.touch(text)']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        GRANT EXECUTE ON FUNCTION
            hubd_v1.request(text, text, text, text, text, text, interval, interval) TO hubd_app;
        GRANT EXECUTE ON FUNCTION hubd_v1.touch(text) TO hubd_app;
    END IF;
END;
$$;
