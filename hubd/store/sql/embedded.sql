-- Statements on the embedded server's maintenance database, run before hubd's own exists.

-- name: database_exists
SELECT 1 FROM pg_database WHERE datname = :name;

-- name: create_database
-- CREATE DATABASE takes no parameters: the name is hubd's fixed DATABASE_NAME.
CREATE DATABASE hubd;
