-- 0020_notice_macs: the daemons' internal notifications ('hubd_sockets', 'hubd_connected') carry
-- a mac under the notice key: any role of the server may NOTIFY on any channel, an application
-- role included, and a daemon believed a payload naming a tag it had heard (docs/security.md,
-- "The application API").

-- An allocation's notice on the daemons' channels, whole: '<tag>:<fields>:<mac>', where the tag
-- is hubd_notice_tag's and the mac is the first 32 hex digits of
-- sha256(key || 'hubd-notice:' || '<tag>:<fields>' as UTF-8). The prefix keeps a mac from ever
-- being a tag (no id starts with it). A daemon checks the mac (hubd.store.channels.NoticeKey)
-- before it reads anything else. One function, the key read once, so a statement that notifies
-- pays one call per row: its path is set per call, which costs more than either hash.
CREATE FUNCTION hubd_notice(allocation text, fields text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT n.body || ':'
           || left(encode(sha256(n.key || convert_to('hubd-notice:' || n.body, 'UTF8')), 'hex'), 32)
    FROM (SELECT k.key,
                 left(encode(sha256(k.key || convert_to(allocation, 'UTF8')), 'hex'), 32) || ':'
                 || fields AS body
          FROM hubd_notice_key AS k) AS n
$$;

CREATE OR REPLACE FUNCTION hubd_socket_control() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    terminal boolean := NEW.status IN ('released', 'failed', 'destroy_failed');
BEGIN
    -- A finished allocation has no connection, and an older generation's record can never be
    -- current again (a record is written only for the current generation).
    DELETE FROM hubd_sidecar_connections
    WHERE allocation_id = NEW.id AND (terminal OR generation < NEW.generation);
    PERFORM pg_notify('hubd_sockets', hubd_notice(NEW.id, NEW.generation || ':' ||
        CASE WHEN terminal THEN 'retire' ELSE 'fence' END));
    RETURN NULL;
END;
$$;

-- hubd_notice_tag stays: a daemon of the previous release, still running during a rolling
-- restart, records its sidecars' connections with it (its notices, with no mac, are dropped).

-- Both on the fixed path of every hubd function (0016), executable by no one but the owner:
-- a replaced function takes the settings its CREATE names, none, so the path is set again.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY['hubd_notice(text, text)'::regprocedure,
                             'hubd_socket_control()'::regprocedure]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END;
$$;
