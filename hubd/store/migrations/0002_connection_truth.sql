-- 0002_connection_truth: connection facts that any replica can fence on, and socket control
-- that reaches the replica holding the socket.

-- Bumped by every statement that records or clears a connection of the allocation. A claim reads
-- it when it looks at readiness; the writes that act on that look (park, mark ready, give up on
-- the sidecar) are fenced on it, so a connect or disconnect that happened anywhere since makes
-- them fall through to "due now" instead of acting on stale knowledge.
ALTER TABLE hubd_allocations ADD COLUMN connection_seq bigint NOT NULL DEFAULT 0;

-- The allocation's connection_seq when this record was written: of two sockets of one
-- generation, the one with the higher number took over.
ALTER TABLE hubd_sidecar_connections ADD COLUMN seq bigint NOT NULL DEFAULT 0;

-- Serves the sweep of dead instances' records and their own deletion.
CREATE INDEX hubd_instances_heartbeat_idx ON hubd_instances (heartbeat_at);

-- Whenever an allocation moves to a newer generation or becomes terminal, every replica hears
-- it on 'hubd_sockets' ('<allocation>:<generation>:fence|retire') and closes the sockets it holds
-- that no longer belong: the replica that wrote the transition is rarely the one holding them.
-- A trigger, so that no transition (the reconciler's, a user's release, a future one) can forget.
CREATE FUNCTION hubd_socket_control() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('hubd_sockets', NEW.id || ':' || NEW.generation || ':' ||
        CASE WHEN NEW.status IN ('released', 'failed', 'destroy_failed') THEN 'retire'
             ELSE 'fence' END);
    RETURN NULL;
END;
$$;

CREATE TRIGGER hubd_allocations_socket_control
    AFTER UPDATE OF generation, status ON hubd_allocations
    FOR EACH ROW
    WHEN (OLD.generation IS DISTINCT FROM NEW.generation
          OR (NEW.status IN ('released', 'failed', 'destroy_failed')
              AND OLD.status NOT IN ('released', 'failed', 'destroy_failed')))
    EXECUTE FUNCTION hubd_socket_control();
