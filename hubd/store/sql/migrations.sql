-- Statements on hubd_schema_migrations, the record of applied schema migrations.

-- name: lock
-- Held for the migration transaction so replicas starting together apply each migration once.
-- Once the record exists, its table's lock: no application role may lock it, as any role of
-- the database could take and keep an advisory key and so stop every daemon from starting.
-- Before (a database nothing has migrated yet, that no application uses), an advisory key.
SELECT CASE WHEN to_regclass('hubd_schema_migrations') IS NULL
            THEN pg_advisory_xact_lock(hashtext('hubd.migrate')) END;

-- name: lock_table
LOCK TABLE hubd_schema_migrations IN SHARE ROW EXCLUSIVE MODE;

-- name: create_table
CREATE TABLE IF NOT EXISTS hubd_schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: applied
SELECT version FROM hubd_schema_migrations ORDER BY version;

-- name: record
INSERT INTO hubd_schema_migrations (version, name) VALUES (:version, :name);
