-- 0030_handover: a taken pool member's sidecar learns its session (architecture §4,
-- "Hand-over"). The take marks the row handover_pending and notifies 'hubd_handover'; the
-- replica holding the member's socket sends it a 'session' message, and after every welcome
-- while the mark stands; the sidecar's 'session_ack', fenced on its connection, clears it. With
-- ready_when 'declared' the tenant sees the allocation ready only then, and the provisioning
-- deadline runs from the take until then; with 'connected', at the take.

ALTER TABLE hubd_allocations
    ADD COLUMN handover_pending boolean NOT NULL DEFAULT false;

-- The hand-overs owed, for the periodic socket check: few at any moment, whatever the table.
CREATE INDEX hubd_allocations_handover_idx ON hubd_allocations (id) WHERE handover_pending;

-- Takes a ready member of `pool` for a request, in the request's statement: the oldest member
-- no other transaction holds (SKIP LOCKED: concurrent requests take different members, on any
-- replica, and none waits on another's), checked again as it is locked, so a member lost or
-- taken meanwhile is never handed out. The row becomes the tenant's, with the request's
-- session, key and clocks; its sidecar, generation and connection stay as they are. Its
-- sidecar is owed its session (handover_pending; 'hubd_handover' tells the replica holding its
-- socket); a member that is ready once its sidecar says so starts its provisioning clock
-- again, which the acknowledgement stops. NULL when no member is ready (a miss).
CREATE OR REPLACE FUNCTION hubd_take_member(pool text, tenant text, session text,
    requested_key text, requested_ready_when text, deadline timestamptz,
    idle double precision, instance text)
RETURNS hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    taken hubd_allocations;
BEGIN
    UPDATE hubd_allocations AS a SET
        tenant_id = tenant, session_id = session, idempotency_key = requested_key,
        taken_at = now(), expires_at = deadline, expiring = false, idle_timeout = idle,
        idle_at = now() + make_interval(secs => idle), handover_pending = true,
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
    IF taken.id IS NOT NULL THEN
        INSERT INTO hubd_allocation_ledger
            (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
        VALUES (taken.id, taken.generation, instance, 'take', taken.status, taken.status,
            'committed', 'taken from pool ' || pool);
        PERFORM pg_notify('hubd_handover', hubd_notice(taken.id, taken.generation || ':take'));
        RETURN taken;
    END IF;
    RETURN NULL;
END;
$$;

-- As 0025 made it, and: a new generation's sidecar is welcomed with the allocation's session
-- already, so no hand-over is owed to it.
CREATE OR REPLACE FUNCTION hubd_stamp_clocks() RETURNS trigger LANGUAGE plpgsql AS $$
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

-- Whether the row reads ready to its application: allocated, its sidecar connected (and
-- declared, where it must), and a taken member that must declare has acknowledged its session.
CREATE FUNCTION hubd_ready_to_tenant(status text, connection_ready boolean,
    handover_pending boolean, ready_when text)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT status = 'allocated' AND connection_ready
        AND NOT (handover_pending AND ready_when IS NOT DISTINCT FROM 'declared')
$$;

-- As 0029 made it, with readiness as the application reads it (hubd_ready_to_tenant): the take
-- of a member that must declare is 'requested' alone, and its acknowledgement 'ready'.
CREATE OR REPLACE FUNCTION hubd_record_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
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
    IF NEW.pool_id IS NOT NULL AND NEW.taken_at IS NULL THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        kinds := ARRAY['requested'];
    ELSE
        was_ready := hubd_ready_to_tenant(OLD.status, OLD.connection_ready,
            OLD.handover_pending, OLD.ready_when);
        IF OLD.taken_at IS NULL AND NEW.taken_at IS NOT NULL THEN
            kinds := CASE WHEN now_ready THEN ARRAY['requested', 'ready']
                          ELSE ARRAY['requested'] END;
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
        ELSE
            kinds := ARRAY['published'];
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
          OR OLD.expires_at IS DISTINCT FROM NEW.expires_at
          OR OLD.taken_at IS DISTINCT FROM NEW.taken_at
          OR OLD.handover_pending IS DISTINCT FROM NEW.handover_pending)
    EXECUTE FUNCTION hubd_record_event();

-- ready as hubd_ready_to_tenant says, spelled out: an application role may not run that function.
CREATE OR REPLACE VIEW hubd_v1.allocations WITH (security_barrier) AS
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

DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_take_member(text, text, text, text, text, timestamp with time zone, '
            'double precision, text)',
        'hubd_stamp_clocks()',
        'hubd_ready_to_tenant(text, boolean, boolean, text)',
        'hubd_record_event()']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        GRANT SELECT ON hubd_v1.allocations TO hubd_app;
    END IF;
END;
$$;
