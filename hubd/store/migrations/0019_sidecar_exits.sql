-- 0019_sidecar_exits: a sidecar's death, as its provisioner reports it (architecture §5,
-- "Sidecar exits"), is kept on the row and acted on at once; an allocation whose sidecars keep
-- failing is given up instead of replaced forever.

-- exit_message and exited_at: the current generation's sidecar died (what it said, when); a
-- bind of a new sidecar clears both. replacements counts the sidecars abandoned since
-- replacements_since (a window of [reconciler] replacement_window); give_up marks a release
-- that ends 'failed' because that count passed [reconciler] replacement_limit.
ALTER TABLE hubd_allocations
    ADD COLUMN exit_message text,
    ADD COLUMN exited_at timestamptz,
    ADD COLUMN replacements integer NOT NULL DEFAULT 0,
    ADD COLUMN replacements_since timestamptz,
    ADD COLUMN give_up boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT hubd_allocations_exit_message_check
        CHECK (octet_length(exit_message) <= 8192);

-- A sidecar reported dead holds no live connection, whatever record its socket left: every
-- statement that asks whether a generation is connected asks this function.
CREATE OR REPLACE FUNCTION hubd_sidecar_live(
    allocation text, wanted_generation integer, ttl double precision, instance text)
RETURNS boolean
LANGUAGE sql STABLE
SET enable_seqscan = off
AS $$
    SELECT EXISTS (
        SELECT 1 FROM hubd_sidecar_connections AS c
        LEFT JOIN hubd_instances AS i ON i.id = c.instance_id
        WHERE c.allocation_id = allocation AND c.generation = wanted_generation
          AND (i.heartbeat_at > now() - make_interval(secs => ttl) OR c.instance_id = instance))
    AND NOT EXISTS (
        SELECT 1 FROM hubd_allocations AS a
        WHERE a.id = allocation AND a.generation = wanted_generation
          AND a.exited_at IS NOT NULL)
$$;

-- The connection of a sidecar reported dead is no reason to wait for it to come back: its
-- row stays due at once, with its deadline passed.
CREATE OR REPLACE FUNCTION hubd_connection_lost(lost_ids text[], lost_generations integer[],
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
            connect_deadline = CASE WHEN a.exited_at IS NOT NULL
                                    THEN least(a.connect_deadline, now())
                                    WHEN a.status = 'allocated'
                                    THEN now() + make_interval(secs => connect_timeout)
                                    ELSE a.connect_deadline END,
            next_attempt_at = CASE WHEN a.status = 'allocated'
                                        AND (a.lease_expires_at IS NULL
                                             OR a.lease_expires_at <= clock_timestamp())
                                   THEN CASE WHEN a.exited_at IS NOT NULL THEN now()
                                             ELSE now() + make_interval(secs => connect_timeout)
                                        END
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

-- CREATE OR REPLACE sets a function's settings anew: the fixed path of 0016 again.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
BEGIN
    EXECUTE format('ALTER FUNCTION hubd_sidecar_live(text, integer, double precision, text) '
                   'SET search_path = %s', fixed);
    EXECUTE format('ALTER FUNCTION hubd_connection_lost(text[], integer[], text[], text, '
                   'double precision, text) SET search_path = %s', fixed);
END;
$$;
