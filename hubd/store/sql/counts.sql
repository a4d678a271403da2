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
