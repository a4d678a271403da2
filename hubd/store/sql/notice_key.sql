-- Statements on hubd_notice_key: the key the daemons' notifications tag allocations with and
-- are authenticated with (hubd_notice in schema.sql). Only the daemon's role may read it.

-- name: notice_key
-- The key, read once by a daemon at its start. No row: the database was not migrated.
SELECT key FROM hubd_notice_key;
