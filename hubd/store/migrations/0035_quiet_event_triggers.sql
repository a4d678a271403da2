-- 0035_quiet_event_triggers: the event triggers are queued only for rows whose update can write
-- an event. hubd_record_event wrote nothing for a pool member no tenant has taken, for a take
-- not yet announced, or for a hand-over acknowledged where the allocation was ready already,
-- but each such row still queued a deferred trigger, run at commit: a call per take, per step
-- of every member's provisioning and per acknowledgement, in the commits a burst of takes
-- waits behind (architecture §8).

DROP TRIGGER hubd_allocations_event_insert ON hubd_allocations;
CREATE CONSTRAINT TRIGGER hubd_allocations_event_insert
    AFTER INSERT ON hubd_allocations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN ((NEW.pool_id IS NULL OR NEW.taken_at IS NOT NULL) AND NOT NEW.take_unannounced)
    EXECUTE FUNCTION hubd_record_event();

DROP TRIGGER hubd_allocations_event_update ON hubd_allocations;
CREATE CONSTRAINT TRIGGER hubd_allocations_event_update
    AFTER UPDATE ON hubd_allocations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN ((NEW.pool_id IS NULL OR NEW.taken_at IS NOT NULL) AND NOT NEW.take_unannounced
          AND (OLD.status IS DISTINCT FROM NEW.status
               OR OLD.connection_ready IS DISTINCT FROM NEW.connection_ready
               OR OLD.generation IS DISTINCT FROM NEW.generation
               OR OLD.endpoint IS DISTINCT FROM NEW.endpoint
               OR OLD.metadata IS DISTINCT FROM NEW.metadata
               OR OLD.expiring IS DISTINCT FROM NEW.expiring
               OR OLD.expires_at IS DISTINCT FROM NEW.expires_at
               OR OLD.taken_at IS DISTINCT FROM NEW.taken_at
               OR (OLD.handover_pending IS DISTINCT FROM NEW.handover_pending
                   AND (OLD.ready_when = 'declared' OR NEW.ready_when = 'declared'))
               OR OLD.take_unannounced IS DISTINCT FROM NEW.take_unannounced))
    EXECUTE FUNCTION hubd_record_event();
