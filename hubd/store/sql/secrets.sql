-- Statements on hubd_sidecar_secrets: the reconnect secret that binds a generation's identity to
-- its latest connection (protocol v2). Only SHA-256 digests are stored; every comparison of a
-- presented value happens in constant time before these run, so the equalities here compare the
-- server's own digests, never a guess. A secret is rotated by the statement that records the
-- connection (record, in connections.sql), so the two commit or vanish together.

-- name: acknowledge_secret
-- The sidecar of :generation / :sidecar_id confirmed it holds the secret :secret_hash: the secret
-- that authenticated its connection (or the token alone, on a first connection) stops being
-- accepted. Nothing when a newer rotation happened meanwhile.
UPDATE hubd_sidecar_secrets SET previous_hash = NULL, acknowledged = true
WHERE allocation_id = :allocation_id AND generation = :generation AND sidecar_id = :sidecar_id
  AND secret_hash = :secret_hash AND NOT acknowledged
RETURNING allocation_id;
