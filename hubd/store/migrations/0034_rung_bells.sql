-- 0034_rung_bells: a bell rings once in its slot of time, not once per take that finds it free.
-- Under 0033 the take that found its tenth's bell free rang, and the bell was free again as
-- soon as that take committed: in a burst one take after another rang, and each took NOTIFY's
-- lock at its commit, the lock every commit that notifies waits for (architecture §8). Now a
-- bell records the slot it rang in: a take that finds it rung in the current slot, or held by
-- the take ringing it, stays silent; the replicas that heard the ring keep looking until that
-- slot is over, so a take of the slot that commits after the ring is announced all the same.

-- The slot a bell last rang in (hubd_take_slot); NULL: never.
ALTER TABLE hubd_take_bells ADD COLUMN rang bigint;

-- The current slot of time: 20 ms, by the database's clock. Bell 'bell_<slot % 16>' is rung
-- in it.
CREATE FUNCTION hubd_take_slot() RETURNS bigint LANGUAGE sql AS $$
    SELECT floor(extract(epoch FROM clock_timestamp()) * 50)::bigint
$$;

-- As 0033 made it, and: the take that finds its slot's bell free and not yet rung in the slot
-- rings it (records the slot, and notifies).
CREATE OR REPLACE FUNCTION hubd_take_member(pool text, tenant text, session text,
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
CREATE OR REPLACE FUNCTION hubd_takes_in_flight() RETURNS boolean LANGUAGE plpgsql AS $$
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

DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_take_member(text, text, text, text, text, timestamp with time zone, '
            'double precision, text)',
        'hubd_take_slot()',
        'hubd_takes_in_flight()']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    -- As 0033: a take's plans are the same for every pool.
    ALTER FUNCTION hubd_take_member(text, text, text, text, text, timestamptz,
        double precision, text) SET plan_cache_mode = force_generic_plan;
END;
$$;
