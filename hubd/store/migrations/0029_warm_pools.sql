-- 0029_warm_pools: warm pools (docs/pools.md). The operator's [[pools]] keep members ready: an
-- ordinary allocation of the pool's provisioner and spec that no tenant owns yet, provisioned,
-- connected and ready. A request with the same provisioner and spec takes one in its own
-- statement, and the tenant sees an allocation that is ready at once; the daemons make a new
-- member in its place. A member no tenant took is hubd's: no application sees, counts or
-- releases it, and the feed says nothing of it until it is taken.

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
    counter_id     bigint GENERATED ALWAYS AS IDENTITY
);
-- jsonb's text is canonical (keys sorted, no spacing): equal specs have equal digests, and a
-- 64 KiB spec fits no index entry while its digest does.
CREATE UNIQUE INDEX hubd_pools_match_idx ON hubd_pools (provisioner_id, md5(spec::text));

-- pool_id: the pool that made the row (kept after it is taken, so warm it stays); taken_at:
-- when a request took it (NULL: a member no tenant owns yet).
ALTER TABLE hubd_allocations
    ADD COLUMN pool_id text,
    ADD COLUMN taken_at timestamptz,
    ADD CONSTRAINT hubd_allocations_taken_check CHECK (taken_at IS NULL OR pool_id IS NOT NULL);
ALTER TABLE hubd_events
    ADD COLUMN warm boolean NOT NULL DEFAULT false;

-- The members a request may take, oldest first; and every member not taken and not ended, for
-- the refill's count and the metrics. Only statements that name pool_id and taken_at imply either predicate.
CREATE INDEX hubd_allocations_warm_idx ON hubd_allocations (pool_id, created_at)
    WHERE pool_id IS NOT NULL AND taken_at IS NULL AND status = 'allocated'
      AND connection_ready;
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

-- A tenant's quota, as 0027 made it, with pool members no tenant took left out of the count
-- of requests with no tenant: they are hubd's, not an application's.
CREATE OR REPLACE FUNCTION hubd_admit_request(tenant text)
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

-- Takes a ready member of `pool` for a request, in the request's statement: the oldest member
-- no other transaction holds (SKIP LOCKED: concurrent requests take different members, on any
-- replica, and none waits on another's), checked again as it is locked, so a member lost or
-- taken meanwhile is never handed out. The row becomes the tenant's, with the request's
-- session, key and clocks; its sidecar, generation and connection stay as they are. NULL when
-- no member is ready (a miss).
CREATE FUNCTION hubd_take_member(pool text, tenant text, session text, requested_key text,
    requested_ready_when text, deadline timestamptz, idle double precision, instance text)
RETURNS hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    taken hubd_allocations;
BEGIN
    UPDATE hubd_allocations AS a SET
        tenant_id = tenant, session_id = session, idempotency_key = requested_key,
        taken_at = now(), expires_at = deadline, expiring = false, idle_timeout = idle,
        idle_at = now() + make_interval(secs => idle), updated_at = now()
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
        RETURN taken;
    END IF;
    RETURN NULL;
END;
$$;

-- The request, for hubd_v1.request and the daemon's own store alike (:instance the hub that
-- writes the ledger row; NULL for an application). A key already used returns its allocation
-- if the request is the same, and fails naming the key (HU409) if it is not. A new one must be
-- admitted by the tenant's quota (hubd_admit_request, HU429); it then takes a ready member of
-- the pool of its provisioner and spec, if there is one (hubd_take_member), and is made cold
-- otherwise. A taken member wakes the daemons, which make a new one in its place.
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
            -- nextval is strict: a counter dropped with its pool meanwhile counts nothing.
            PERFORM nextval(to_regclass(hubd_pool_counter(pool.counter_id,
                CASE WHEN created.id IS NULL THEN 'missed' ELSE 'taken' END)));
            IF created.id IS NOT NULL THEN
                PERFORM pg_notify('hubd_wake', provisioner);
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

-- A member no tenant took is hubd's own: the feed says nothing of it. Its take is the tenant's
-- 'requested' (warm), followed at once by 'ready' when its sidecar is.
CREATE OR REPLACE FUNCTION hubd_record_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
    terminal boolean := NEW.status IN ('released', 'failed', 'destroy_failed');
    kinds text[];
    kind text;
    at_position bigint;
BEGIN
    IF NEW.pool_id IS NOT NULL AND NEW.taken_at IS NULL THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        kinds := ARRAY['requested'];
    ELSIF OLD.taken_at IS NULL AND NEW.taken_at IS NOT NULL THEN
        kinds := CASE WHEN NEW.connection_ready AND NEW.status = 'allocated'
                      THEN ARRAY['requested', 'ready'] ELSE ARRAY['requested'] END;
    ELSIF terminal AND OLD.status IS DISTINCT FROM NEW.status THEN
        kinds := ARRAY[NEW.status::text];
    ELSIF NEW.connection_ready AND NOT OLD.connection_ready THEN
        kinds := ARRAY['ready'];
    ELSIF OLD.status IS DISTINCT FROM NEW.status OR OLD.generation <> NEW.generation THEN
        kinds := ARRAY[NEW.status::text];
    ELSIF OLD.connection_ready AND NOT NEW.connection_ready THEN
        kinds := ARRAY['not_ready'];
    ELSIF NEW.expiring AND NOT OLD.expiring THEN
        kinds := ARRAY['expiring'];
    ELSIF OLD.expires_at IS DISTINCT FROM NEW.expires_at
          OR (OLD.expiring AND NOT NEW.expiring) THEN
        kinds := ARRAY['extended'];
    ELSE
        kinds := ARRAY['published'];
    END IF;
    LOCK TABLE hubd_feed_lock IN EXCLUSIVE MODE;
    FOREACH kind IN ARRAY kinds LOOP
        at_position := nextval('hubd_event_position');
        INSERT INTO hubd_events (position, allocation_id, tenant_id, session_id, event, status,
            ready, generation, endpoint, metadata, failure_code, failure_message, expires_at,
            end_reason, idle_at, warm)
        VALUES (at_position, NEW.id, NEW.tenant_id, NEW.session_id, kind, NEW.status,
            NEW.connection_ready AND NEW.status = 'allocated', NEW.generation, NEW.endpoint,
            NEW.metadata, NEW.failure_code, NEW.failure_message, NEW.expires_at,
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
          OR OLD.taken_at IS DISTINCT FROM NEW.taken_at)
    EXECUTE FUNCTION hubd_record_event();

-- A member no tenant took is no application's: not in the view, so not released, extended or
-- touched through hubd_v1 either. warm: the allocation was a pool's member.
CREATE OR REPLACE VIEW hubd_v1.allocations WITH (security_barrier) AS
SELECT a.id, a.status::text AS status, (a.status = 'allocated' AND a.connection_ready) AS ready,
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

CREATE OR REPLACE VIEW hubd_v1.events WITH (security_barrier) AS
SELECT e.position, e.at, e.allocation_id, e.tenant_id AS tenant, e.session_id AS session,
    e.event, e.status::text AS status, e.ready, e.generation::integer AS generation, e.endpoint,
    e.metadata, e.failure_code, e.failure_message, e.expires_at, e.end_reason, e.idle_at,
    e.warm
FROM hubd_events AS e
WHERE NOT (SELECT s.restricted FROM hubd_caller_scope() AS s)
   OR e.tenant_id = (SELECT s.tenant FROM hubd_caller_scope() AS s);

DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_pool_counter(bigint, text)',
        'hubd_pool_counters()',
        'hubd_admit_request(text)',
        'hubd_take_member(text, text, text, text, text, timestamp with time zone, '
            'double precision, text)',
        'hubd_request_allocation(text, text, text, jsonb, text, text, text, double precision, '
            'double precision)',
        'hubd_refill_pool(text, integer, text)',
        'hubd_release_orphaned_members(text)',
        'hubd_record_event()']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        GRANT SELECT ON hubd_v1.allocations, hubd_v1.events TO hubd_app;
    END IF;
END;
$$;
