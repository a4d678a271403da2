-- 0006_ledger_rows: a transition and the plugin-call rows it brackets are written by one
-- statement; this orders them.
-- The ledger rows a transition writes, in order: its own row (own_kind, own_from → own_to,
-- committed, with own_code and own_message) and the rows of the plugin calls it brackets
-- (effects, a JSON array of rows, each with a place: negative before the transition's own row,
-- positive after it).
CREATE FUNCTION hubd_ledger_rows(effects jsonb, own_kind text, own_from text, own_to text,
    own_code text DEFAULT NULL, own_message text DEFAULT NULL)
RETURNS TABLE (kind text, from_status text, to_status text, phase text, error_code text,
    message text, effect_id text, duration_ms double precision)
LANGUAGE sql IMMUTABLE AS $$
    SELECT r.kind, r.from_status, r.to_status, r.phase, r.error_code, r.message, r.effect_id,
        r.duration_ms
    FROM (
        SELECT 0 AS place, own_kind AS kind, own_from AS from_status, own_to AS to_status,
            'committed' AS phase, own_code AS error_code, own_message AS message,
            NULL::text AS effect_id, NULL::double precision AS duration_ms
        UNION ALL
        SELECT e.place, e.kind, e.from_status, e.to_status, e.phase, e.error_code, e.message,
            e.effect_id, e.duration_ms
        FROM jsonb_to_recordset(effects) AS e (place integer, kind text, from_status text,
            to_status text, phase text, error_code text, message text, effect_id text,
            duration_ms double precision)
    ) AS r
    ORDER BY r.place
$$;
