-- Statements on hubd_instances: one row per running daemon, kept alive by a heartbeat.

-- name: register
-- Announce :instance_id (:hostname, :pid, sidecar URL :ws_url, the :provisioners it serves);
-- registering again refreshes the row.
INSERT INTO hubd_instances (id, hostname, pid, ws_url, provisioners)
VALUES (:instance_id, :hostname, :pid, :ws_url, :provisioners)
ON CONFLICT (id) DO UPDATE SET
    hostname = EXCLUDED.hostname,
    pid = EXCLUDED.pid,
    ws_url = EXCLUDED.ws_url,
    provisioners = EXCLUDED.provisioners,
    heartbeat_at = now();

-- name: heartbeat
-- Returns no row when the instance was removed (by an operator, or as dead by a peer).
UPDATE hubd_instances SET heartbeat_at = now() WHERE id = :instance_id RETURNING heartbeat_at;

-- name: remove
-- A clean stop: the instance's connection records become stale at once (see stale in
-- connections.sql), so peers sweep them without waiting for the heartbeat to expire.
DELETE FROM hubd_instances WHERE id = :instance_id;

-- name: list
-- Every instance and whether its heartbeat is within :ttl seconds by the database clock.
SELECT id, hostname, pid, ws_url, provisioners, started_at, heartbeat_at,
       heartbeat_at > now() - make_interval(secs => :ttl) AS alive
FROM hubd_instances ORDER BY started_at, id;

-- name: delete_dead
-- Forget instances whose heartbeat is older than :older_than seconds (a crash leaves its row
-- behind; without this, one row per crash would stay forever). Their records were swept long
-- before.
DELETE FROM hubd_instances WHERE heartbeat_at < now() - make_interval(secs => :older_than)
RETURNING id;
