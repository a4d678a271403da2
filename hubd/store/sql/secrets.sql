-- Statements on hubd_sidecar_secrets: the reconnect secret that binds a generation's identity to
-- its latest connection (protocol v2). Only SHA-256 digests are stored; every comparison of a
-- presented value happens in constant time before these run, so the equalities here compare the
-- server's own digests, never a guess. A secret is rotated by the statement that records the
-- connection (record, in connections.sql), so the two commit or vanish together.

-- name: acknowledge_secrets
-- Sidecars confirmed they hold the secrets of their welcomes: for each i, the sidecar of
-- :generations[i] / :sidecar_ids[i] of :allocation_ids[i] holds the secret :secret_hashes[i], so
-- the secret that authenticated its connection (or the token alone, on a first connection) stops
-- being accepted. Each one, exactly as if it ran alone, takes effect only if no newer rotation
-- happened meanwhile. The rows are locked in one order first, so two replicas acknowledging
-- overlapping sets wait for each other instead of deadlocking. Returns each acknowledgement that
-- took effect.
WITH wanted AS (
    SELECT *
    FROM unnest(:allocation_ids::text[], :generations::integer[], :sidecar_ids::text[],
                :secret_hashes::bytea[]) AS w (allocation_id, generation, sidecar_id, secret_hash)
), locked AS (
    SELECT allocation_id FROM hubd_sidecar_secrets
    WHERE allocation_id = ANY (:allocation_ids::text[])
    ORDER BY allocation_id
    FOR UPDATE
)
UPDATE hubd_sidecar_secrets AS s SET previous_hash = NULL, acknowledged = true
FROM locked, wanted AS w
WHERE s.allocation_id = locked.allocation_id AND w.allocation_id = s.allocation_id
  AND s.generation = w.generation AND s.sidecar_id = w.sidecar_id
  AND s.secret_hash = w.secret_hash AND NOT s.acknowledged
RETURNING w.allocation_id, w.generation, w.sidecar_id, w.secret_hash;
