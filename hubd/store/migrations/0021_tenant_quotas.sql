-- 0021_tenant_quotas: an operator bounds what one tenant may ask for (docs/operations.md,
-- "Quotas"): allocations not yet ended, allocations waiting for a sidecar, and a request rate,
-- decided in the request's own statement so that no race admits past a limit.

-- An operator's limits on what one tenant may ask for (`hubd tenant quota`, docs/operations.md
-- "Quotas"): at most max_active allocations not yet ended, at most max_pending of them still
-- waiting for a sidecar, and requests refilled at rate per second up to burst (a token bucket).
-- tenant_key: 'tenant:' and the tenant, 'untenanted' for requests with no tenant, 'default' for
-- every tenant with no row of its own (each counted on its own). NULL: no such limit. Only hubd
-- reads it: an application role has no privilege on it.
CREATE TABLE hubd_tenant_quotas (
    tenant_key  text PRIMARY KEY,
    max_active  integer,
    max_pending integer,
    rate        double precision,
    burst       integer,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT hubd_tenant_quotas_key_check CHECK (tenant_key IN ('default', 'untenanted')
        OR (tenant_key LIKE 'tenant:_%' AND length(tenant_key) <= 207)),
    CONSTRAINT hubd_tenant_quotas_counts_check CHECK (max_active >= 0 AND max_pending >= 0),
    CONSTRAINT hubd_tenant_quotas_rate_check CHECK ((rate IS NULL) = (burst IS NULL)
        AND rate > 0 AND rate <= 1000000 AND burst BETWEEN 1 AND 1000000)
);

-- A tenant's request bucket (tokens as of refilled_at) and how many requests it admitted; one
-- row per tenant_key a quota applied to. Its row lock is what serializes a tenant's requests
-- while a quota applies (hubd_admit_request).
CREATE TABLE hubd_tenant_usage (
    tenant_key  text PRIMARY KEY,
    tokens      double precision NOT NULL,
    refilled_at timestamptz NOT NULL,
    admitted    bigint NOT NULL DEFAULT 0
);

-- Serves a quota's counts: a tenant's allocations not yet ended, by status. Only a statement
-- that names a tenant implies the predicate, so a look-up by key on statistics that say the
-- table is empty never walks it instead of the primary key. Requests with no tenant are counted
-- through hubd_allocations_active_idx.
CREATE INDEX hubd_allocations_tenant_idx ON hubd_allocations (tenant_id, status)
    WHERE tenant_id IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');

-- Whether the tenant's quota (its own row, else the default's) admits one more request now;
-- raises HU429 naming the limit, the tenant and when to try again when it does not. With no
-- quota and no default it costs two look-ups by key. Under a quota the tenant's usage row is
-- updated first: that row's lock serializes the tenant's requests until each requester ends its
-- transaction, so the counts that follow (a fresh snapshot per statement under READ COMMITTED)
-- see every request committed before; a REPEATABLE READ or SERIALIZABLE caller that raced
-- another fails to serialize (40001) instead of counting without it. Concurrent requests, on
-- any number of replicas and connections, never admit past a limit. A refusal rolls back with
-- the caller's transaction (or savepoint): the bucket keeps its token.
CREATE FUNCTION hubd_admit_request(tenant text)
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
        RAISE EXCEPTION '% % % allocations not yet ended, its quota''s max_active: release '
            'one and retry', who, has, active_now
            USING ERRCODE = 'HU429', DETAIL = 'limit=max_active';
    END IF;
    IF pending_now >= quota.max_pending THEN
        RAISE EXCEPTION '% % % allocations waiting for a sidecar, its quota''s max_pending: '
            'retry once one is provisioned', who, has, pending_now
            USING ERRCODE = 'HU429', DETAIL = 'limit=max_pending';
    END IF;
END;
$$;

-- A new request must be admitted by the tenant's quota.
CREATE OR REPLACE FUNCTION hubd_request_allocation(provisioner text, tenant text, session text,
    requested_spec jsonb, requested_key text, requested_ready_when text, instance text)
RETURNS SETOF hubd_allocations LANGUAGE plpgsql AS $$
DECLARE
    wanted_spec jsonb := coalesce(requested_spec, '{}'::jsonb);
    existing hubd_allocations;
    created hubd_allocations;
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
    INSERT INTO hubd_allocations AS a (id, provisioner_id, tenant_id, session_id, spec,
        next_attempt_at, idempotency_key, ready_when)
    VALUES ('al_' || replace(gen_random_uuid()::text, '-', ''), provisioner, tenant, session,
        wanted_spec, now(), requested_key, requested_ready_when)
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

DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
BEGIN
    EXECUTE format('ALTER FUNCTION hubd_admit_request(text) SET search_path = %s', fixed);
    EXECUTE 'REVOKE ALL ON FUNCTION hubd_admit_request(text) FROM PUBLIC';
    EXECUTE format('ALTER FUNCTION hubd_request_allocation(text, text, text, jsonb, text, text, '
                   'text) SET search_path = %s', fixed);
END;
$$;
