-- Statements on hubd_tenant_quotas, the operator's limits on what one tenant may ask for, and on
-- hubd_tenant_usage, each tenant's request bucket. The limits are applied by hubd_admit_request
-- (schema.sql) in every request's own statement; these only set, clear and read them.
-- :tenant_key is 'tenant:' and the tenant, 'untenanted' or 'default' (hubd.store.quotas).

-- name: set_quota
-- Set the quota of :tenant_key: each limit given replaces the stored one, a NULL leaves it
-- (a new row has none), :clear_* removes that limit. The bucket starts full again when the
-- rate changes. Returns the row as it now stands.
WITH stored AS (
    INSERT INTO hubd_tenant_quotas AS q (tenant_key, max_active, max_pending, rate, burst)
    VALUES (:tenant_key, :max_active::integer, :max_pending::integer, :rate::float8,
            :burst::integer)
    ON CONFLICT (tenant_key) DO UPDATE SET
        max_active = CASE WHEN :clear_active THEN NULL
                          ELSE coalesce(EXCLUDED.max_active, q.max_active) END,
        max_pending = CASE WHEN :clear_pending THEN NULL
                           ELSE coalesce(EXCLUDED.max_pending, q.max_pending) END,
        rate = CASE WHEN :clear_rate THEN NULL ELSE coalesce(EXCLUDED.rate, q.rate) END,
        burst = CASE WHEN :clear_rate THEN NULL ELSE coalesce(EXCLUDED.burst, q.burst) END,
        updated_at = now()
    RETURNING q.*
), refilled AS (
    DELETE FROM hubd_tenant_usage AS u
    WHERE u.tenant_key = :tenant_key AND (:rate::float8 IS NOT NULL OR :clear_rate)
)
SELECT * FROM stored;

-- name: clear_quota
-- Remove the quota of :tenant_key (a tenant with none falls back to the default); returns
-- whether there was one.
WITH removed AS (
    DELETE FROM hubd_tenant_quotas WHERE tenant_key = :tenant_key RETURNING tenant_key
), forgotten AS (
    DELETE FROM hubd_tenant_usage WHERE tenant_key = :tenant_key
)
SELECT EXISTS (SELECT 1 FROM removed) AS removed;

-- name: usage
-- Every tenant with allocations not yet ended or a quota of its own, with what applies to it:
-- its counts, its quota (its own, else the default's, else none: quota_key NULL) and what its
-- bucket holds now (refilled to this moment; NULL with no rate or no request yet). The default
-- and the untenanted rows appear as themselves.
WITH counted AS (
    SELECT CASE WHEN a.tenant_id IS NULL THEN 'untenanted' ELSE 'tenant:' || a.tenant_id END
               AS tenant_key,
           count(*) AS active, count(*) FILTER (WHERE a.status = 'pending') AS pending
    FROM hubd_allocations AS a
    WHERE a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
      AND (a.pool_id IS NULL OR a.taken_at IS NOT NULL)
    GROUP BY 1
), keys AS (
    SELECT tenant_key FROM counted
    UNION
    SELECT tenant_key FROM hubd_tenant_quotas
)
SELECT k.tenant_key, coalesce(c.active, 0) AS active, coalesce(c.pending, 0) AS pending,
       q.tenant_key AS quota_key, q.max_active, q.max_pending, q.rate, q.burst,
       CASE WHEN q.rate IS NOT NULL AND u.tokens IS NOT NULL
            THEN least(q.burst::float8, u.tokens + q.rate * greatest(0::float8,
                     extract(epoch FROM clock_timestamp() - u.refilled_at)::float8))
       END AS tokens,
       coalesce(u.admitted, 0) AS admitted
FROM keys AS k
LEFT JOIN counted AS c ON c.tenant_key = k.tenant_key
LEFT JOIN LATERAL (
    SELECT * FROM hubd_tenant_quotas AS own
    WHERE own.tenant_key = k.tenant_key OR (own.tenant_key = 'default'
        AND k.tenant_key <> 'default'
        AND NOT EXISTS (SELECT 1 FROM hubd_tenant_quotas AS o WHERE o.tenant_key = k.tenant_key))
    ORDER BY own.tenant_key = 'default'
    LIMIT 1
) AS q ON true
LEFT JOIN hubd_tenant_usage AS u ON u.tenant_key = k.tenant_key
ORDER BY k.tenant_key = 'default' DESC, k.tenant_key = 'untenanted' DESC, k.tenant_key
LIMIT :limit;
