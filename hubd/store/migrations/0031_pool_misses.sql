-- 0031_pool_misses: what a request does when its pool has no member ready (docs/pools.md,
-- "A miss"): 'cold' makes it as without a pool, 'wait' looks for a member again until one is
-- ready or miss_wait seconds passed (then cold), 'refuse' fails it with HU503 and a retry-after.

ALTER TABLE hubd_pools
    ADD COLUMN miss text NOT NULL DEFAULT 'cold' CHECK (miss IN ('cold', 'wait', 'refuse')),
    ADD COLUMN miss_wait double precision NOT NULL DEFAULT 0
        CHECK (miss_wait >= 0 AND miss_wait <= 30);

-- The request, for hubd_v1.request and the daemon's own store alike (:instance the hub that
-- writes the ledger row; NULL for an application). A key already used returns its allocation
-- if the request is the same, and fails naming the key (HU409) if it is not. A new one must be
-- admitted by the tenant's quota (hubd_admit_request, HU429); it then takes a ready member of
-- the pool of its provisioner and spec, if there is one (hubd_take_member), as the pool's miss
-- says when none is ready (HU503 for 'refuse'), and is made cold otherwise. A taken member
-- wakes the daemons, which make a new one in its place.
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

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION hubd_request_allocation(text, text, text, jsonb, text, text, '
        'text, double precision, double precision) SET search_path = %s',
        format('pg_catalog, %I, pg_temp', current_schema()));
    REVOKE ALL ON FUNCTION hubd_request_allocation(text, text, text, jsonb, text, text, text,
        double precision, double precision) FROM PUBLIC;
END;
$$;
