-- 0032_quieter_takes: a take sends no hubd_wake (it leaves nothing due to claim; the daemons
-- hear of it on hubd_handover, which starts their refill too), and an update that changes
-- nothing an application reads (the acknowledgement of a hand-over where the allocation was
-- ready already) writes no event.

CREATE OR REPLACE FUNCTION hubd_request_allocation(provisioner text, tenant text,
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

DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_request_allocation(text, text, text, jsonb, text, text, text, double precision, '
            'double precision)',
        'hubd_record_event()']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END;
$$;
