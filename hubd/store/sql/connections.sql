-- Statements on hubd_sidecar_connections: the durable record of which sidecar is connected where,
-- so any replica can answer "is this sidecar ready?" from the database.

-- name: identity
-- What a handshake is checked against: the allocation's status, generation and current identity.
SELECT id, status, generation, sidecar_id, token_hash
FROM hubd_allocations WHERE id = $1;

-- name: record
-- Connection $1 of allocation $2, generation $3, sidecar $4 on instance $5 becomes the current one,
-- and 'hubd_connected' is notified with '<allocation>:<generation>' in the same statement, so a
-- replica that hears it can trust the record is committed. Written only while the allocation still
-- accepts exactly that sidecar (current generation and identity, provisioning or allocated), and
-- never over the record of a newer generation. FOR SHARE makes a concurrent transition that
-- abandons the sidecar either wait for this statement or be seen by it: a record can never
-- survive its own fencing. Returns the allocation's status and generation (no row: no such
-- allocation) and whether the record was written.
WITH alloc AS (
    SELECT id, status, generation, sidecar_id FROM hubd_allocations WHERE id = $2 FOR SHARE
), written AS (
    INSERT INTO hubd_sidecar_connections
        (connection_id, allocation_id, generation, sidecar_id, instance_id)
    SELECT $1, alloc.id, $3, $4, $5 FROM alloc
    WHERE alloc.generation = $3 AND alloc.sidecar_id = $4
      AND alloc.status IN ('provisioning', 'allocated')
    ON CONFLICT (allocation_id) DO UPDATE SET
        connection_id = EXCLUDED.connection_id,
        generation = EXCLUDED.generation,
        sidecar_id = EXCLUDED.sidecar_id,
        instance_id = EXCLUDED.instance_id,
        connected_at = now()
    WHERE hubd_sidecar_connections.generation <= EXCLUDED.generation
    RETURNING allocation_id, generation
), notified AS (
    SELECT pg_notify('hubd_connected', allocation_id || ':' || generation) FROM written
)
SELECT alloc.status, alloc.generation, (SELECT count(*) FROM notified) > 0 AS recorded
FROM alloc;

-- name: clear
-- Forget a connection only if it is still the current one: a takeover must not be undone by the
-- late close of the socket it replaced.
DELETE FROM hubd_sidecar_connections WHERE allocation_id = $1 AND connection_id = $2
RETURNING connection_id;

-- name: clear_instance
-- Forget every connection held by an instance (it stopped, or its heartbeat expired).
DELETE FROM hubd_sidecar_connections WHERE instance_id = $1 RETURNING allocation_id, generation;

-- name: is_connected
-- Whether generation $2's sidecar has a current connection on an instance whose heartbeat is
-- within $3 seconds.
SELECT EXISTS (
    SELECT 1 FROM hubd_sidecar_connections AS c
    JOIN hubd_instances AS i ON i.id = c.instance_id
    WHERE c.allocation_id = $1 AND c.generation = $2
      AND i.heartbeat_at > now() - make_interval(secs => $3)
);

-- name: stale
-- Connections whose instance is gone or whose heartbeat is older than $1 seconds.
SELECT c.allocation_id, c.generation, c.connection_id, c.instance_id
FROM hubd_sidecar_connections AS c
LEFT JOIN hubd_instances AS i ON i.id = c.instance_id
WHERE i.id IS NULL OR i.heartbeat_at <= now() - make_interval(secs => $1)
ORDER BY c.allocation_id;
