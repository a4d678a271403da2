-- 0028_http_api: the HTTP API's keys (docs/http.md), and a wall a connection may narrow itself
-- into, so that an HTTP request runs the same hubd_v1 functions a database role of its tenant
-- runs, behind the same wall.

-- A key is 'hubd_' || id || '.' || secret; only sha256(secret) is kept. A key sees one tenant
-- (tenant_id) or every tenant (every_tenant, an operator's). Revoked keys stay, so a revoked
-- id is never handed out again and the listing says when it went.
CREATE TABLE hubd_api_keys (
    id           text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{16}$'),
    secret_hash  hubd_sha256 NOT NULL,
    tenant_id    text,
    every_tenant boolean NOT NULL DEFAULT false,
    name         text NOT NULL DEFAULT '' CHECK (length(name) <= 200),
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    CONSTRAINT hubd_api_keys_scope_check CHECK ((tenant_id IS NULL) = every_tenant),
    CONSTRAINT hubd_api_keys_tenant_check CHECK (length(tenant_id) BETWEEN 1 AND 200)
);

-- The caller's wall, as 0016 made it, narrowed by the setting hubd.wall where the caller has
-- set it: a caller that sees every tenant and sets hubd.wall sees that tenant alone. It only
-- narrows: a caller walled into a tenant stays walled into its own whatever it sets, and any
-- role may set it, since a wall it builds around itself gives it nothing. hubd's HTTP API sets
-- it (transaction-local) for each request of a tenant's key.
CREATE OR REPLACE FUNCTION hubd_caller_scope(OUT restricted boolean, OUT tenant text)
LANGUAGE sql STABLE SECURITY DEFINER AS $$
    SELECT coalesce(chosen.every_tenant = false, false) OR n.narrowed IS NOT NULL,
        CASE WHEN coalesce(chosen.every_tenant = false, false) THEN chosen.tenant_id
             ELSE n.narrowed END
    FROM (SELECT nullif(current_setting('hubd.wall', true), '') AS narrowed) AS n
    LEFT JOIN LATERAL (
        SELECT r.every_tenant, r.tenant_id FROM hubd_tenant_roles AS r
        WHERE r.role_name IN (nullif(current_setting('role'), 'none'), session_user)
        ORDER BY r.role_name = coalesce(nullif(current_setting('role'), 'none'), session_user)
            DESC
        LIMIT 1
    ) AS chosen ON true
$$;

DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
BEGIN
    EXECUTE format('ALTER FUNCTION hubd_caller_scope() SET search_path = %s', fixed);
    REVOKE ALL ON FUNCTION hubd_caller_scope() FROM PUBLIC;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app') THEN
        GRANT EXECUTE ON FUNCTION hubd_caller_scope() TO hubd_app;
    END IF;
END;
$$;
