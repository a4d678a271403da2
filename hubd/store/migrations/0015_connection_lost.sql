-- 0015_connection_lost: the rule that marks a sidecar lost when its connection record goes,
-- written once for every statement that clears records (schema.sql says what it does).
CREATE FUNCTION hubd_connection_lost(lost_ids text[], lost_generations integer[],
    lost_messages text[], ledger_kind text, connect_timeout double precision, instance text)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    seen jsonb;
    logged integer;
BEGIN
    SELECT jsonb_object_agg(l.id, jsonb_build_array(l.generation, l.message)) INTO seen
    FROM unnest(lost_ids, lost_generations, lost_messages) AS l (id, generation, message);
    WITH updated AS (
        UPDATE hubd_allocations AS a SET
            connection_seq = a.connection_seq + 1,
            connection_ready = false,
            connect_deadline = CASE WHEN a.status = 'allocated'
                                    THEN now() + make_interval(secs => connect_timeout)
                                    ELSE a.connect_deadline END,
            next_attempt_at = CASE WHEN a.status = 'allocated'
                                        AND (a.lease_expires_at IS NULL
                                             OR a.lease_expires_at <= clock_timestamp())
                                   THEN now() + make_interval(secs => connect_timeout)
                                   ELSE a.next_attempt_at END,
            updated_at = now()
        WHERE a.id = ANY (lost_ids)
          AND (seen -> a.id ->> 0)::integer = a.generation
          AND a.status IN ('provisioning', 'allocated')
        RETURNING a.id, a.generation, a.status
    ), written AS (
        INSERT INTO hubd_allocation_ledger
            (allocation_id, generation, instance_id, kind, from_status, to_status, phase, message)
        SELECT u.id, u.generation, instance, ledger_kind, u.status, u.status, 'committed',
            seen -> u.id ->> 1
        FROM updated AS u WHERE u.status = 'allocated'
        RETURNING 1
    )
    SELECT count(*) INTO logged FROM written;
    RETURN logged;
END;
$$;
