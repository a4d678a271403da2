-- Statements behind the allocation counts of /metrics, run every poll interval by every replica:
-- each costs what the active rows cost, however many finished rows the table holds.

-- name: count_active
-- Exact counts of the active statuses: an index-only scan of hubd_allocations_active_idx (the
-- active rows only, keyed by status), so the cost follows the number of active rows, not the
-- table's.
SELECT status, count(*) AS n FROM hubd_allocations
WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
GROUP BY status;

-- name: estimate_statuses
-- Every status's share of the table as the planner's statistics last saw it (refreshed by
-- autovacuum's ANALYZE), times the table's estimated size: a flat-cost estimate for the terminal
-- statuses, whose exact count would scan every row ever finished. No row before the first ANALYZE.
SELECT vals.status, round(vals.freq * greatest(c.reltuples, 0))::bigint AS n
FROM pg_class AS c
JOIN pg_namespace AS ns ON ns.oid = c.relnamespace
JOIN pg_stats AS s
  ON s.schemaname = ns.nspname AND s.tablename = c.relname AND s.attname = 'status'
CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs)
    AS vals (status, freq)
WHERE c.oid = 'hubd_allocations'::regclass;

-- name: tenant_counts
-- Allocations not yet ended and waiting for a sidecar, per labelled tenant, and every quota
-- row's refusals (docs/operations.md, "Tenants in the metrics"), in rows keyed like quota rows:
-- 'tenant:' and the tenant for each tenant with a quota row of its own and for the :labels
-- others with the most allocations not yet ended (ties by name), 'other' for the sum of the
-- rest; 'untenanted' and 'default' only for their quota rows' refusals. Counts are NULL where
-- the key has no gauge here ('default', 'untenanted': allocations with no tenant are what
-- count_active counted less these, in the same snapshot), refusals where it has no quota row.
-- At most quota rows + :labels + 1 rows, whatever the number of tenants. Naming a tenant
-- lets hubd_allocations_tenant_idx serve it alone: an index-only scan of the tenants' active
-- rows once the table is vacuumed, however many rows have ended.
WITH counted AS (
    SELECT a.tenant_id, count(*) AS active,
           count(*) FILTER (WHERE a.status = 'pending') AS pending
    FROM hubd_allocations AS a
    WHERE a.tenant_id IS NOT NULL
      AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
    GROUP BY a.tenant_id
), unquoted AS (
    SELECT c.tenant_id, c.active, c.pending,
           row_number() OVER (ORDER BY c.active DESC, c.tenant_id) AS rank
    FROM counted AS c
    WHERE NOT EXISTS (SELECT 1 FROM hubd_tenant_quotas AS q
                      WHERE q.tenant_key = 'tenant:' || c.tenant_id)
), gauges AS (
    SELECT q.tenant_key, coalesce(c.active, 0) AS active, coalesce(c.pending, 0) AS pending
    FROM hubd_tenant_quotas AS q
    LEFT JOIN counted AS c ON q.tenant_key = 'tenant:' || c.tenant_id
    WHERE q.tenant_key LIKE 'tenant:%'
    UNION ALL
    SELECT 'tenant:' || u.tenant_id, u.active, u.pending FROM unquoted AS u
    WHERE u.rank <= :labels
    UNION ALL
    SELECT 'other', coalesce(sum(u.active), 0), coalesce(sum(u.pending), 0) FROM unquoted AS u
    WHERE u.rank > :labels
), refusals AS (
    -- pg_sequence_last_value: NULL before a counter's first refusal. A connection's first read
    -- of a counter loads its catalog entry; later scrapes on it read the counter's page alone.
    SELECT q.tenant_key,
           coalesce(pg_sequence_last_value(to_regclass(
               hubd_refusal_counter(q.counter_id, 'max_active'))), 0) AS refused_max_active,
           coalesce(pg_sequence_last_value(to_regclass(
               hubd_refusal_counter(q.counter_id, 'max_pending'))), 0) AS refused_max_pending,
           coalesce(pg_sequence_last_value(to_regclass(
               hubd_refusal_counter(q.counter_id, 'rate'))), 0) AS refused_rate
    FROM hubd_tenant_quotas AS q
)
SELECT coalesce(g.tenant_key, r.tenant_key) AS tenant_key, g.active::bigint, g.pending::bigint,
       r.refused_max_active, r.refused_max_pending, r.refused_rate
FROM gauges AS g
FULL JOIN refusals AS r ON r.tenant_key = g.tenant_key;
