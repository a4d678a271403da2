-- Statements on hubd_api_keys, the HTTP API's keys (docs/http.md). Only a hash of each key's
-- secret is stored; the key itself is shown once, when it is made.

-- name: create_key
-- A new key :id with secret hash :secret_hash for tenant :tenant_id, or for every tenant
-- (:tenant_id NULL), named :name.
INSERT INTO hubd_api_keys (id, secret_hash, tenant_id, every_tenant, name)
VALUES (:id, :secret_hash, :tenant_id, :tenant_id::text IS NULL, :name)
RETURNING id, tenant_id, every_tenant, name, created_at, revoked_at;

-- name: find_key
-- The live key :id, for the caller to compare its secret's hash; no row when unknown or revoked.
SELECT id, secret_hash, tenant_id, every_tenant FROM hubd_api_keys
WHERE id = :id AND revoked_at IS NULL;

-- name: revoke_key
-- Key :id is refused from now on; a key revoked already keeps its moment. No row: no such key.
UPDATE hubd_api_keys SET revoked_at = coalesce(revoked_at, now())
WHERE id = :id
RETURNING id, tenant_id, every_tenant, name, created_at, revoked_at;

-- name: list_keys
-- Every key, newest first (never a hash).
SELECT id, tenant_id, every_tenant, name, created_at, revoked_at FROM hubd_api_keys
ORDER BY created_at DESC, id;
