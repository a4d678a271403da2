-- Statements on hubd_sidecar_secrets: the reconnect secret that binds a generation's identity to
-- its latest connection (protocol v2). Only SHA-256 digests are stored; every comparison of a
-- presented value happens in constant time before these run, so the equalities here compare the
-- server's own digests, never a guess.

-- name: rotate_secret
-- A handshake of generation :generation's sidecar :sidecar_id was accepted with the secret state it
-- saw (:seen_hash, NULL: no secret): the welcome's new secret :secret_hash (NULL for a v1 sidecar,
-- which cannot be told one) replaces it, and :presented_hash (what the handshake presented, NULL:
-- the token alone) stays valid until the welcome is acknowledged. Run in the transaction that
-- records the connection, before the record. The conflict clause decides a race: it sees the row
-- as the winner committed it, so of two handshakes that saw the same state only the first writes
-- (no row returned: this one lost, and must not record). A row of an older generation or sidecar
-- counts as no secret.
INSERT INTO hubd_sidecar_secrets AS s
    (allocation_id, generation, sidecar_id, secret_hash, previous_hash, acknowledged)
VALUES (:allocation_id, :generation, :sidecar_id, :secret_hash, :presented_hash,
        :secret_hash::bytea IS NULL)
ON CONFLICT (allocation_id) DO UPDATE SET
    generation = EXCLUDED.generation,
    sidecar_id = EXCLUDED.sidecar_id,
    secret_hash = EXCLUDED.secret_hash,
    previous_hash = EXCLUDED.previous_hash,
    acknowledged = EXCLUDED.acknowledged,
    rotated_at = now()
WHERE CASE WHEN s.generation = EXCLUDED.generation AND s.sidecar_id = EXCLUDED.sidecar_id
           THEN s.secret_hash IS NOT DISTINCT FROM :seen_hash::bytea
           ELSE :seen_hash::bytea IS NULL END
RETURNING s.allocation_id;

-- name: acknowledge_secret
-- The sidecar of :generation / :sidecar_id confirmed it holds the secret :secret_hash: the secret
-- that authenticated its connection (or the token alone, on a first connection) stops being
-- accepted. Nothing when a newer rotation happened meanwhile.
UPDATE hubd_sidecar_secrets SET previous_hash = NULL, acknowledged = true
WHERE allocation_id = :allocation_id AND generation = :generation AND sidecar_id = :sidecar_id
  AND secret_hash = :secret_hash AND NOT acknowledged
RETURNING allocation_id;
