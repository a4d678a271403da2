-- Statements on hubd_events, the application event feed (docs/api.md). The feed is written by
-- the deferred trigger hubd_record_event (schema.sql) at the commit of every change an
-- application can wait on; the daemon only prunes it.

-- name: prune
-- Delete at most :batch events older than :keep seconds and move the horizon past them, so a
-- reader whose cursor they covered is told (HU410) instead of skipping them.
SELECT hubd_prune_events(:keep, :batch);
