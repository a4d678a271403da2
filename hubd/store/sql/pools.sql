-- Statements on hubd_pools (docs/pools.md): the warm pools the daemons keep. A request takes a
-- member in hubd_request_allocation; these write the pools and keep them full.

-- name: set_pools
-- The pools of this daemon's configuration: :pool_ids[i] of :provisioner_ids[i] with
-- :specs[i], :sizes[i] members, refilled at :refill_rates[i] a second, a request that finds
-- none ready doing :misses[i] ('cold', 'wait' up to :miss_waits[i] seconds, 'refuse'). A pool of a provisioner
-- in :served that the configuration no longer names is removed (its members are released by
-- release_orphaned_members); the last daemon to start wins, as for the provisioners' limits.
WITH wanted AS (
    SELECT w.pool_id, w.provisioner_id, w.spec::jsonb AS spec, w.size, w.refill_rate, w.miss,
           w.miss_wait
    FROM unnest(:pool_ids::text[], :provisioner_ids::text[], :specs::text[],
                :sizes::integer[], :refill_rates::float8[], :misses::text[],
                :miss_waits::float8[])
        AS w (pool_id, provisioner_id, spec, size, refill_rate, miss, miss_wait)
), removed AS (
    DELETE FROM hubd_pools AS p
    WHERE p.provisioner_id = ANY(:served::text[])
      AND NOT EXISTS (SELECT 1 FROM wanted AS w WHERE w.pool_id = p.pool_id)
    RETURNING p.pool_id
), written AS (
    INSERT INTO hubd_pools AS p (pool_id, provisioner_id, spec, size, refill_rate, miss,
        miss_wait)
    SELECT * FROM wanted
    ON CONFLICT (pool_id) DO UPDATE SET
        provisioner_id = EXCLUDED.provisioner_id,
        spec = EXCLUDED.spec,
        size = EXCLUDED.size,
        refill_rate = EXCLUDED.refill_rate,
        miss = EXCLUDED.miss,
        miss_wait = EXCLUDED.miss_wait,
        updated_at = now()
    WHERE (p.provisioner_id, p.spec, p.size, p.refill_rate, p.miss, p.miss_wait)
          IS DISTINCT FROM (EXCLUDED.provisioner_id, EXCLUDED.spec, EXCLUDED.size,
                            EXCLUDED.refill_rate, EXCLUDED.miss, EXCLUDED.miss_wait)
    RETURNING p.pool_id
)
SELECT (SELECT count(*) FROM removed) AS removed, (SELECT count(*) FROM written) AS written;

-- name: refill
-- Pool :pool_id kept at its size by one daemon at a time: up to :most new members as its
-- refill rate allows, the surplus released (hubd_refill_pool).
SELECT r.made, r.released, r.lacking FROM hubd_refill_pool(:pool_id, :most, :instance_id) AS r;

-- name: release_orphaned_members
-- The members of pools no longer configured, released; how many.
SELECT hubd_release_orphaned_members(:instance_id) AS released;

-- name: pool_stats
-- Each pool's size and members not taken (ready, or on their way), and its takes and misses
-- counted so far (pg_sequence_last_value: NULL before the first).
SELECT p.pool_id, p.provisioner_id, p.size, p.refill_rate,
       count(m.id) FILTER (WHERE m.status = 'allocated' AND m.connection_ready) AS ready,
       count(m.id) FILTER (WHERE NOT (m.status = 'allocated' AND m.connection_ready))
           AS starting,
       coalesce(pg_sequence_last_value(to_regclass(hubd_pool_counter(p.counter_id, 'taken'))),
                0) AS taken,
       coalesce(pg_sequence_last_value(to_regclass(hubd_pool_counter(p.counter_id, 'missed'))),
                0) AS missed
FROM hubd_pools AS p
LEFT JOIN hubd_allocations AS m
  ON m.pool_id = p.pool_id AND m.taken_at IS NULL
 AND m.status IN ('pending', 'provisioning', 'allocated', 'replacing')
GROUP BY p.pool_id
ORDER BY p.pool_id;

-- name: untaken_members
-- Members no tenant took, not yet ended, and those of them pending: hubd's, left out of the
-- allocations with no tenant in the per-tenant metrics.
SELECT count(*) AS active, count(*) FILTER (WHERE m.status = 'pending') AS pending
FROM hubd_allocations AS m
WHERE m.pool_id IS NOT NULL AND m.taken_at IS NULL
  AND m.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');
