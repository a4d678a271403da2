-- 0033_announced_takes: a take commits without the feed's lock and, most of the time, without
-- a notification, so that concurrent takes flush their commits together instead of one after
-- another (architecture §8, "A take's events"). Its 'requested' (and 'ready') events are
-- written by the next update of its row: the announcement of the replica holding the member's
-- socket, which hears of takes on 'hubd_handover' from the take that holds the bell and looks
-- while the in-flight mark says takes are still uncommitted; or any other update of the row,
-- a release included.

ALTER TABLE hubd_allocations
    ADD COLUMN take_unannounced boolean NOT NULL DEFAULT false;

-- No index of its own: a take not yet announced is owed its hand-over too (its mark is cleared
-- with take_unannounced, by the acknowledgement or a new generation), so the announcement finds
-- it through hubd_allocations_handover_idx; and with no index on the column the announcement's
-- update is a heap-only one, which writes no index entry.

-- Rows only hubd's functions may lock (an application role has no privilege on the table).
-- Every take holds 'in_flight' FOR KEY SHARE to its commit, so that a replica can see that
-- takes are uncommitted (FOR UPDATE SKIP LOCKED finds the row locked); the take that finds the
-- bell of the current tenth of a second free holds it FOR UPDATE to its commit and notifies,
-- and the others, which found it held, do not: the holder's notification wakes the replicas,
-- which look again while any take is in flight. Sixteen bells, a new one every 100 ms: a take
-- kept uncommitted holds one, and silences only the takes of its tenths; the next take of
-- another rings, and the replicas then look for as long as the first stays in flight.
CREATE TABLE hubd_take_bells (
    bell text PRIMARY KEY CHECK (bell ~ '^(in_flight|bell_([0-9]|1[0-5]))$')
);
INSERT INTO hubd_take_bells (bell)
SELECT 'bell_' || n FROM generate_series(0, 15) AS n UNION ALL SELECT 'in_flight';

-- As 0030 made it, and: the row is marked take_unannounced (its events wait for the
-- announcement), and only a take that finds its tenth's bell free, or cannot mark itself in
-- flight, notifies. A take that neither rang nor marked itself would go unheard until the
-- socket check.
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
    IF taken.id IS NOT NULL THEN
        INSERT INTO hubd_allocation_ledger
            (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
        VALUES (taken.id, taken.generation, instance, 'take', taken.status, taken.status,
            'committed', 'taken from pool ' || pool);
        -- The mark first, then the bell: a take that found the bell held is in flight until
        -- it commits, which the bell's holder, notifying at its own commit, makes the replicas
        -- watch for. SKIP LOCKED: neither ever waits (a replica's look at the mark holds it an
        -- instant); a take that could not mark itself notifies.
        IF NOT EXISTS (SELECT 1 FROM hubd_take_bells AS b WHERE b.bell = 'in_flight'
                       FOR KEY SHARE SKIP LOCKED)
           OR EXISTS (SELECT 1 FROM hubd_take_bells AS b
                      WHERE b.bell = 'bell_'
                          || floor(extract(epoch FROM clock_timestamp()) * 10)::bigint % 16
                      FOR UPDATE SKIP LOCKED) THEN
            PERFORM pg_notify('hubd_handover', hubd_notice(taken.id, taken.generation || ':take'));
        END IF;
        RETURN taken;
    END IF;
    RETURN NULL;
END;
$$;

-- Whether a take is uncommitted: the in-flight mark is held (by a take, to its commit). A
-- replica that finds it free holds it an instant, until this statement's commit.
CREATE FUNCTION hubd_takes_in_flight() RETURNS boolean LANGUAGE sql AS $$
    SELECT NOT EXISTS (SELECT 1 FROM hubd_take_bells AS b WHERE b.bell = 'in_flight'
                       FOR UPDATE SKIP LOCKED)
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

-- As 0032 made it, and: a take writes nothing (take_unannounced); the update that announces it
-- writes 'requested', 'ready' if the row reads ready now, and its status if that is no longer
-- 'allocated' (a release or a replacement that came first).
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
          OR OLD.handover_pending IS DISTINCT FROM NEW.handover_pending
          OR OLD.take_unannounced IS DISTINCT FROM NEW.take_unannounced)
    EXECUTE FUNCTION hubd_record_event();

DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_take_member(text, text, text, text, text, timestamp with time zone, '
            'double precision, text)',
        'hubd_takes_in_flight()',
        'hubd_announce_take()',
        'hubd_record_event()']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    -- A take's plans are the same for every pool: planned once per connection, not per call
    -- (custom plans cost 0.35 ms a take, a quarter of it, measured).
    ALTER FUNCTION hubd_take_member(text, text, text, text, text, timestamptz,
        double precision, text) SET plan_cache_mode = force_generic_plan;
END;
$$;
