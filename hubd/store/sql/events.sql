-- Statements on hubd_events, the application event feed (docs/api.md), and on the lock its
-- writers take. The feed is written by the deferred trigger hubd_record_event (schema.sql) at the
-- commit of every change an application can wait on; the daemon prunes it and watches its lock.

-- name: prune
-- Delete at most :batch events older than :keep seconds and move the horizon past them, so a
-- reader whose cursor they covered is told (HU410) instead of skipping them.
SELECT hubd_prune_events(:keep, :batch);

-- name: feed_lock
-- The feed's lock (hubd_feed_lock, EXCLUSIVE, held from a commit's first event to its end) as
-- pg_locks shows it in this database: how many wait for it, how long the first of them has
-- waited (database clock; a waiter's waitstart is NULL for a moment after it queues), and who
-- holds it, with the holder's login role and whether that is this connection's role. A holder
-- without a pid is a prepared transaction. ACCESS SHARE (a plain read of the empty table) blocks
-- no commit, so it holds nothing here. pg_locks takes no heavyweight lock, so this reads while
-- the lock is contended.
WITH here AS (
    SELECT l.pid, l.granted, l.mode, l.waitstart
    FROM pg_locks AS l
    WHERE l.locktype = 'relation'
      AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
      AND l.relation = 'hubd_feed_lock'::regclass
),
holder AS (
    SELECT h.pid, a.usename::text AS role, a.state
    FROM here AS h
    LEFT JOIN pg_stat_activity AS a ON a.pid = h.pid
    WHERE h.granted AND h.mode <> 'AccessShareLock'
    ORDER BY h.mode = 'ExclusiveLock' DESC, h.pid NULLS LAST
    LIMIT 1
)
SELECT
    (SELECT count(*) FROM here WHERE NOT here.granted)::integer AS waiters,
    coalesce(extract(epoch FROM clock_timestamp()
        - (SELECT min(here.waitstart) FROM here WHERE NOT here.granted)), 0)::float8
        AS longest_wait,
    EXISTS (SELECT 1 FROM holder) AS held,
    holder.pid AS holder_pid,
    holder.role AS holder_role,
    holder.state AS holder_state,
    coalesce(holder.role = current_user::text, false) AS holder_own_role,
    current_user::text AS own_role
FROM (SELECT 1) AS one
LEFT JOIN holder ON true;

-- name: terminate_feed_lock_holder
-- End the backend :pid if it still holds the feed's lock, is not of this connection's role (nor
-- this connection), and, when :waited is given, a commit has waited for the lock at least that
-- many seconds now: a reading taken before the daemon paused cannot end a holder whose hold is
-- a new, short one. True once signalled, no row when the holder no longer qualifies. Raises
-- insufficient_privilege when this role may not signal it (it needs pg_signal_backend, or to be
-- a superuser for a superuser's backend).
SELECT pg_terminate_backend(l.pid)
FROM pg_locks AS l
JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'relation'
  AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
  AND l.relation = 'hubd_feed_lock'::regclass
  AND l.granted
  AND l.mode <> 'AccessShareLock'
  AND l.pid = :pid
  AND l.pid <> pg_backend_pid()
  AND a.usename IS DISTINCT FROM current_user
  AND (:waited::float8 IS NULL OR EXISTS (
      SELECT 1 FROM pg_locks AS w
      WHERE w.locktype = 'relation' AND w.database = l.database AND w.relation = l.relation
        AND NOT w.granted
        AND w.waitstart <= clock_timestamp() - make_interval(secs => :waited::float8)));
