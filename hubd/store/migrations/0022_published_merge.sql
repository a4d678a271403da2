-- 0022_published_merge: the provisioner's metadata and the sidecar's merge in either order
-- (docs/api.md: the provisioner's keys, then the sidecar's over them). A sidecar may publish
-- before its provisioner's acceptance is recorded; the acceptance then needs what the sidecar
-- published, keys it removed included, to put the provisioner's keys under it.

-- sidecar_patch: what the current generation's sidecar published before the acceptance, as one
-- merge patch of the top level (a key it removed holds null); the acceptance merges the
-- provisioner's metadata under it and clears it, and a new generation clears it too.
ALTER TABLE hubd_allocations ADD COLUMN sidecar_patch hubd_metadata;

CREATE OR REPLACE FUNCTION hubd_clear_published() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.endpoint := NULL;
    NEW.metadata := NULL;
    NEW.sidecar_patch := NULL;
    RETURN NEW;
END;
$$;

-- The metadata an acceptance records (mark_allocated, park with accept): the provisioner's
-- (provided; NULL: it gave none, and what is stored stays) with what the generation's sidecar
-- published over it, whichever was written first: patch, the sidecar's publishes before the
-- acceptance (a key given null stays removed), or, where none was kept, what is stored. A merge
-- that would pass the 16 KiB of hubd_metadata keeps what the sidecar published alone: its own
-- word is the later one.
CREATE FUNCTION hubd_accepted_metadata(provided jsonb, patch jsonb, stored jsonb)
RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN provided IS NULL OR octet_length(m.merged::text) > 16384 THEN stored
                ELSE m.merged END
    FROM (SELECT (provided || coalesce(patch, stored, '{}'::jsonb))
                 - ARRAY(SELECT key FROM jsonb_each(coalesce(patch, '{}'::jsonb))
                         WHERE value = 'null'::jsonb) AS merged) AS m
$$;

-- Both on the fixed path of every hubd function (0016), executable by no one but the owner:
-- a replaced function takes the settings its CREATE names, none, so the path is set again.
DO $$
DECLARE
    fixed text := format('pg_catalog, %I, pg_temp', current_schema());
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY['hubd_clear_published()'::regprocedure,
                             'hubd_accepted_metadata(jsonb, jsonb, jsonb)'::regprocedure]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f, fixed);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END;
$$;
