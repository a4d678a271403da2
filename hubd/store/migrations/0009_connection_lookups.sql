-- 0009_connection_lookups: the look at an allocation's own connection record
-- (hubd_sidecar_live) and connection records by instance, usable only by a statement that names
-- an instance (schema.sql says why of both).
DROP INDEX hubd_sidecar_connections_instance_idx;
CREATE INDEX hubd_sidecar_connections_instance_idx ON hubd_sidecar_connections (instance_id)
    WHERE instance_id IS NOT NULL;

CREATE FUNCTION hubd_sidecar_live(
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
$$;

