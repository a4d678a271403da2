-- 0005_reconnect_secrets: a generation's identity is bound to its first successful connection.
-- Each welcome of protocol v2 carries a fresh reconnect secret; only its SHA-256 is kept here.
-- Once a generation has one, a handshake must present it: the token alone (which any process of
-- the sidecar's uid can read from its environment) no longer takes over the connection.
CREATE TABLE hubd_sidecar_secrets (
    allocation_id text PRIMARY KEY REFERENCES hubd_allocations (id),
    -- The identity the secret belongs to: a row of an older generation or sidecar counts as no
    -- secret at all, so a replacement starts with none and needs no statement to forget it.
    generation    integer NOT NULL,
    sidecar_id    text NOT NULL,
    -- The secret of the latest welcome; NULL while only v1 sidecars (which cannot be told one)
    -- have connected.
    secret_hash   bytea,
    -- The secret that authenticated the latest connection (NULL: the token alone did). It stays
    -- valid until that connection acknowledges its welcome: a sidecar whose welcome was lost
    -- still holds it.
    previous_hash bytea,
    acknowledged  boolean NOT NULL DEFAULT false,
    rotated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT hubd_sidecar_secrets_generation_check CHECK (generation >= 1),
    CONSTRAINT hubd_sidecar_secrets_hash_check CHECK (
        (secret_hash IS NULL OR octet_length(secret_hash) = 32)
        AND (previous_hash IS NULL OR octet_length(previous_hash) = 32))
);
