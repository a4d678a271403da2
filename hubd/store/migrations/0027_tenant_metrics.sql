-- 0027_tenant_metrics: /metrics counts every quota's refusals (docs/operations.md, "Tenants in
-- the metrics"). A refusal raises in the caller's transaction, which rolls back, so a count
-- written there would vanish with it: each quota row counts its refusals in sequences of its
-- own, whose nextval no rollback undoes.

-- Names the row's refusal counters. A number, not the tenant: every role may read relation
-- names in pg_class, while only hubd may read this table.
ALTER TABLE hubd_tenant_quotas ADD COLUMN counter_id bigint GENERATED ALWAYS AS IDENTITY;

-- The sequence counting quota row `counter`'s refusals by quota_limit ('max_active',
-- 'max_pending' or 'rate'), the limit named in the refusal's DETAIL.
CREATE FUNCTION hubd_refusal_counter(counter bigint, quota_limit text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT 'hubd_quota_refusals_' || counter::text || '_' || quota_limit
$$;

-- A quota row's counters come and go with it, owned by hubd's owner (SECURITY DEFINER) whoever
-- set the quota, and readable by no other role: their values say how often a tenant was
-- refused. A quota cleared and set again counts from zero (Prometheus reads a reset).
CREATE FUNCTION hubd_quota_counters() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    quota_limit text;
BEGIN
    FOREACH quota_limit IN ARRAY ARRAY['max_active', 'max_pending', 'rate'] LOOP
        IF TG_OP = 'INSERT' THEN
            EXECUTE format('CREATE SEQUENCE %I.%I', TG_TABLE_SCHEMA,
                hubd_refusal_counter(NEW.counter_id, quota_limit));
            EXECUTE format('REVOKE ALL ON SEQUENCE %I.%I FROM PUBLIC', TG_TABLE_SCHEMA,
                hubd_refusal_counter(NEW.counter_id, quota_limit));
        ELSE
            EXECUTE format('DROP SEQUENCE IF EXISTS %I.%I', TG_TABLE_SCHEMA,
                hubd_refusal_counter(OLD.counter_id, quota_limit));
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE TRIGGER hubd_tenant_quotas_counters AFTER INSERT OR DELETE ON hubd_tenant_quotas
    FOR EACH ROW EXECUTE FUNCTION hubd_quota_counters();

-- Counts one refusal where the refusal's rollback cannot undo it. Never fails the refusal it
-- counts: a counter dropped at that moment (its quota cleared meanwhile) goes uncounted.
CREATE FUNCTION hubd_count_refusal(counter bigint, quota_limit text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval(to_regclass(hubd_refusal_counter(counter, quota_limit)));
EXCEPTION WHEN OTHERS THEN
    NULL;
END;
$$;

-- Whether the tenant's quota (its own row, else the default's) admits one more request now;
-- raises HU429 naming the limit, the tenant and when to try again when it does not. With no
-- quota and no default it costs two look-ups by key. Under a quota the tenant's usage row is
-- updated first: that row's lock serializes the tenant's requests until each requester ends its
-- transaction, so the counts that follow (a fresh snapshot per statement under READ COMMITTED)
-- see every request committed before; a REPEATABLE READ or SERIALIZABLE caller that raced
-- another fails to serialize (40001) instead of counting without it. Concurrent requests, on
-- any number of replicas and connections, never admit past a limit. A refusal rolls back with
-- the caller's transaction (or savepoint): the bucket keeps its token. Each refusal is counted
-- first, against the row that refused (hubd_count_refusal).
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
        WHERE a.tenant_id IS NULL
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

-- The fixed path of 0016 for every function made or replaced here (CREATE OR REPLACE drops
-- the one it had); none executable by PUBLIC. The counters of the quotas set before this.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f text;
    counter bigint;
    quota_limit text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hubd_refusal_counter(bigint, text)',
        'hubd_quota_counters()',
        'hubd_count_refusal(bigint, text)',
        'hubd_admit_request(text)']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    FOR counter IN SELECT q.counter_id FROM hubd_tenant_quotas AS q LOOP
        FOREACH quota_limit IN ARRAY ARRAY['max_active', 'max_pending', 'rate'] LOOP
            EXECUTE format('CREATE SEQUENCE %I.%I', current_schema(),
                hubd_refusal_counter(counter, quota_limit));
            EXECUTE format('REVOKE ALL ON SEQUENCE %I.%I FROM PUBLIC', current_schema(),
                hubd_refusal_counter(counter, quota_limit));
        END LOOP;
    END LOOP;
END;
$$;
