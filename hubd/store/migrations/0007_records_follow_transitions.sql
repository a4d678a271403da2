-- 0007_records_follow_transitions: the transition that fences or retires an allocation's
-- sockets also removes the connection record they leave behind, in its own transaction; the
-- closing socket then has nothing left to clear.
CREATE OR REPLACE FUNCTION hubd_socket_control() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    terminal boolean := NEW.status IN ('released', 'failed', 'destroy_failed');
BEGIN
    -- A finished allocation has no connection, and an older generation's record can never be
    -- current again (a record is written only for the current generation).
    DELETE FROM hubd_sidecar_connections
    WHERE allocation_id = NEW.id AND (terminal OR generation < NEW.generation);
    PERFORM pg_notify('hubd_sockets', NEW.id || ':' || NEW.generation || ':' ||
        CASE WHEN terminal THEN 'retire' ELSE 'fence' END);
    RETURN NULL;
END;
$$;

-- Records such transitions left behind before this migration.
DELETE FROM hubd_sidecar_connections AS c
USING hubd_allocations AS a
WHERE a.id = c.allocation_id
  AND (a.status IN ('released', 'failed', 'destroy_failed') OR c.generation < a.generation);
