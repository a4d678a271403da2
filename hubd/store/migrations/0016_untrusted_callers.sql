-- 0016_untrusted_callers: the application API is safe to hand to code the operator does not
-- control (docs/security.md, "The application API"). Every hubd function resolves names on a
-- fixed path with the caller's temporary schema last; only hubd's own functions can take the
-- feed's lock; a spec is bounded before it is parsed; a role can be walled into one tenant.

-- Nobody but the schema's owner creates objects where hubd's functions look for names: a
-- function or operator created there could outbid the built-in one a hubd function calls.
-- (A migrating role that does not own the schema changes nothing here: PostgreSQL warns.)
DO $$
BEGIN
    EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', current_schema());
END;
$$;

-- The feed's lock: an empty table that only hubd's functions may lock. An application role has
-- no privilege on it, so it can neither LOCK it nor hold it; an advisory lock's key, visible in
-- pg_locks, could be taken by any role. EXCLUSIVE conflicts with itself and with nothing a
-- reader takes; pg_locks shows who waits (waitstart) and who holds it.
CREATE TABLE hubd_feed_lock ();

-- Which tenant a database role is walled into, or that it sees every tenant (an operator's
-- role). A role with no row, and no row for the login it came from, sees every tenant: the
-- single-tenant behaviour. Names, not OIDs: a role dropped and created again keeps its wall.
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
-- EXECUTE for hubd_app, harmless by design: it tells a caller its own wall.
CREATE FUNCTION hubd_caller_scope(OUT restricted boolean, OUT tenant text)
LANGUAGE sql STABLE SECURITY DEFINER AS $$
    SELECT coalesce(chosen.every_tenant = false, false), chosen.tenant_id
    FROM (SELECT 1) AS one
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

-- Held to the end of the commit from the moment a position is taken; a commit that waits for it
-- shows in pg_locks, where the daemons watch for a holder that keeps it (docs/operations.md).
-- The notification carries the position alone: any role may LISTEN on any channel, so it says
-- nothing a listener could not read.
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
    ELSE
        kind := 'published';
    END IF;
    LOCK TABLE hubd_feed_lock IN EXCLUSIVE MODE;
    at_position := nextval('hubd_event_position');
    INSERT INTO hubd_events (position, allocation_id, tenant_id, session_id, event, status,
        ready, generation, endpoint, metadata, failure_code, failure_message)
    VALUES (at_position, NEW.id, NEW.tenant_id, NEW.session_id, kind, NEW.status,
        NEW.connection_ready AND NEW.status = 'allocated', NEW.generation, NEW.endpoint,
        NEW.metadata, NEW.failure_code, NEW.failure_message);
    PERFORM pg_notify('hubd_events', json_build_object('position', at_position)::text);
    RETURN NULL;
END;
$$;

-- The views show a walled caller its tenant's rows only. security_barrier: the wall is applied
-- before any function of the caller's sees a row.
CREATE OR REPLACE VIEW hubd_v1.allocations WITH (security_barrier) AS
SELECT a.id, a.status::text AS status, (a.status = 'allocated' AND a.connection_ready) AS ready,
    a.generation::integer AS generation, a.provisioner_id AS provisioner, a.tenant_id AS tenant,
    a.session_id AS session, a.spec::jsonb AS spec, a.idempotency_key,
    a.ready_when::text AS ready_when, a.endpoint::text AS endpoint, a.metadata::jsonb AS metadata,
    a.failure_code, a.failure_message, a.created_at, a.updated_at, a.finished_at
FROM hubd_allocations AS a
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR a.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

CREATE OR REPLACE VIEW hubd_v1.events WITH (security_barrier) AS
SELECT e.position, e.at, e.allocation_id, e.tenant_id AS tenant, e.session_id AS session,
    e.event, e.status::text AS status, e.ready, e.generation::integer AS generation, e.endpoint,
    e.metadata, e.failure_code, e.failure_message
FROM hubd_events AS e
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR e.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

-- The spec arrives as text and is bounded before it is parsed (hubd_parse_spec). A walled caller
-- requests for its tenant: naming none gets its own, naming another is refused.
DROP FUNCTION hubd_v1.request(text, text, text, jsonb, text, text);

CREATE FUNCTION hubd_v1.request(provisioner text, tenant text DEFAULT NULL,
    session text DEFAULT NULL, spec text DEFAULT '{}', idempotency_key text DEFAULT NULL,
    ready_when text DEFAULT NULL)
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
        request.ready_when, NULL) AS r;
    SELECT * INTO result FROM hubd_v1.allocations AS v WHERE v.id = made;
    RETURN result;
END;
$$;

-- A walled caller releases its tenant's allocations only; another tenant's id is as unknown to
-- it as an id no allocation has.
CREATE OR REPLACE FUNCTION hubd_v1.release(allocation_id text,
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

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA hubd_v1 TO hubd_app;
        GRANT EXECUTE ON FUNCTION hubd_caller_scope() TO hubd_app;
    END IF;
END;
$$;
