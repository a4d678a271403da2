-- Statements on hubd_instances: one row per running daemon, kept alive by a heartbeat.

-- name: register
INSERT INTO hubd_instances (id, hostname, pid, ws_url) VALUES ($1, $2, $3, $4)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now();

-- name: heartbeat
-- Returns no row when the instance was removed (by an operator, or as dead by a peer).
UPDATE hubd_instances SET heartbeat_at = now() WHERE id = $1 RETURNING heartbeat_at;

-- name: remove
DELETE FROM hubd_instances WHERE id = $1;

-- name: list
-- Every instance and whether its heartbeat is within $1 seconds by the database clock.
SELECT id, hostname, pid, ws_url, started_at, heartbeat_at,
       heartbeat_at > now() - make_interval(secs => $1) AS alive
FROM hubd_instances ORDER BY started_at;
