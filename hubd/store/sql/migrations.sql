-- Statements on hubd_schema_migrations, the record of applied schema migrations.

-- name: lock
-- Held for the migration transaction so replicas starting together apply each migration once.
SELECT pg_advisory_xact_lock(hashtext('hubd.migrate'));

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
