-- 0017_owned_locks: the orphan sweepers elect one per provisioner by a row lock on a table only
-- hubd may lock, no longer by an advisory key any role of the database could take and keep
-- (docs/security.md, "The application API").
CREATE TABLE hubd_sweep_locks (
    name text PRIMARY KEY
);
