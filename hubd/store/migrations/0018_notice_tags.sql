-- 0018_notice_tags: the daemons' internal notifications ('hubd_sockets', 'hubd_connected') name
-- an allocation by a tag, no longer by its id: any role of the server may LISTEN on any channel,
-- an application role included (docs/security.md, "The application API").

-- The key tags are made with: random, made once here, never shown to an application role (it
-- has no privilege on the table) and never changed (a daemon reads it once, at its start).
CREATE TABLE hubd_notice_key (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key       hubd_sha256 NOT NULL
);
-- gen_random_uuid() draws on the server's strong random source (122 random bits each).
INSERT INTO hubd_notice_key (key)
VALUES (sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8')));

-- An allocation's tag in the daemons' notifications: the first 32 hex digits of
-- sha256(key || the id's UTF-8). A daemon computes the same tag (hubd.store.channels.NoticeKey)
-- for the allocations it holds sockets or waiters of; without the key a tag names nothing.
CREATE FUNCTION hubd_notice_tag(allocation text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT left(encode(sha256(k.key || convert_to(allocation, 'UTF8')), 'hex'), 32)
    FROM hubd_notice_key AS k
$$;

CREATE OR REPLACE FUNCTION hubd_socket_control() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    terminal boolean := NEW.status IN ('released', 'failed', 'destroy_failed');
BEGIN
    -- A finished allocation has no connection, and an older generation's record can never be
    -- current again (a record is written only for the current generation).
    DELETE FROM hubd_sidecar_connections
    WHERE allocation_id = NEW.id AND (terminal OR generation < NEW.generation);
    PERFORM pg_notify('hubd_sockets', hubd_notice_tag(NEW.id) || ':' || NEW.generation || ':' ||
        CASE WHEN terminal THEN 'retire' ELSE 'fence' END);
    RETURN NULL;
END;
$$;

-- Both on the fixed path of every hubd function (0016), executable by no one but the owner:
-- a replaced function takes the settings its CREATE names, none, so the path is set again.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY['hubd_notice_tag(text)'::regprocedure,
                             'hubd_socket_control()'::regprocedure]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END;
$$;
