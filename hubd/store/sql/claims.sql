-- Claims and leases on hubd_allocations: the dispatcher's claim of due rows (which also binds
-- the pending ones among them and makes a bound sidecar's destroy due), the heartbeat's renewal
-- of every lease a daemon holds, and a claim's early return of its lease. Leases run on the
-- database clock. The table's other statements are in allocations.sql (requests, reads),
-- sweeps.sql (deadlines, repair) and transitions.sql (a claim's fenced transitions).

-- name: claim_due
-- Lease up to one due active row per lease id in :lease_ids, oldest first, skipping rows not
-- in :exclude and rows another claimer has locked: one statement fills every free
-- claim slot. Each row gets the lease id at its position. hubd_due_allocations (schema.sql)
-- picks and locks the rows, walking hubd_allocations_due_idx in order; no tenant gets more
-- than its room: :rooms[i] for :listed[i] ('' for no tenant), :room for any other (NULL: no
-- bound).
-- A claimed row whose step is to destroy its bound sidecar (replacing, releasing) gets the
-- destroy's intent here, under the new lease, with the effect id at its position in
-- :effect_ids (destroy_effect_id): the claim is the write that makes the call due. A claim
-- that ends without calling settles it (a failed row, see drop_lease and the provisioner
-- check); one that stops leaves it open, and the next owner records it ambiguous.
-- A pending row whose provisioner is in :bindings ({"<id>": [api_version, fingerprint,
-- ready_when]}, the claimer's provisioners, ready_when the provisioner's default for a row that
-- did not ask for one) and not bound to another version or fingerprint is bound here as
-- bind_initial_sidecar (transitions.sql) binds it, with the identity at its
-- position (:sidecar_ids, :token_hashes; none given: no row is bound) and the ensure's intent
-- under the effect id at its position (ensure_effect_id): the claim is the write that makes
-- that call due too.
WITH due AS (
    SELECT id, row_number() OVER (ORDER BY next_attempt_at, id) AS slot
    FROM hubd_due_allocations(:exclude::text[], cardinality(:lease_ids::text[]), :room::integer,
                              :listed::text[], :rooms::integer[]) AS locked
), claimed AS (
    UPDATE hubd_allocations AS a SET
        lease_id = leases.lease_id,
        lease_expires_at = now() + make_interval(secs => :lease_duration),
        updated_at = now(),
        -- Decided on the row version being updated (the locked one), never on a read of it.
        (status, provisioner_api_version, provisioner_binding_fingerprint, sidecar_id,
         token_hash, external_ref, connect_deadline, connection_ready, ready_when) = (
            SELECT CASE WHEN bind THEN 'provisioning' ELSE a.status END,
                   CASE WHEN bind THEN version ELSE a.provisioner_api_version END,
                   CASE WHEN bind THEN fingerprint ELSE a.provisioner_binding_fingerprint END,
                   CASE WHEN bind THEN leases.sidecar_id ELSE a.sidecar_id END,
                   CASE WHEN bind THEN leases.token_hash ELSE a.token_hash END,
                   CASE WHEN bind THEN NULL ELSE a.external_ref END,
                   CASE WHEN bind THEN now() + make_interval(secs => :connect_timeout)
                        ELSE a.connect_deadline END,
                   CASE WHEN bind THEN false ELSE a.connection_ready END,
                   CASE WHEN bind THEN COALESCE(a.ready_when, decided.ready_when)
                        ELSE a.ready_when END
            FROM (
                SELECT COALESCE(a.status = 'pending' AND leases.sidecar_id IS NOT NULL
                           AND COALESCE(a.provisioner_api_version, wanted.version)
                               = wanted.version
                           AND COALESCE(a.provisioner_binding_fingerprint, wanted.fingerprint)
                               = wanted.fingerprint, false) AS bind,
                       wanted.version, wanted.fingerprint, wanted.ready_when
                FROM (SELECT :bindings::text::jsonb -> a.provisioner_id ->> 0 AS version,
                             :bindings::text::jsonb -> a.provisioner_id ->> 1 AS fingerprint,
                             :bindings::text::jsonb -> a.provisioner_id ->> 2 AS ready_when)
                    AS wanted
            ) AS decided)
    FROM due
    JOIN unnest(:lease_ids::text[], :effect_ids::text[], :sidecar_ids::text[],
                :token_hashes::bytea[]) WITH ORDINALITY
        AS leases (lease_id, effect_id, sidecar_id, token_hash, slot) ON leases.slot = due.slot
    -- By key: planned on a table it believes empty, the join alone walked the whole primary
    -- key once a claim (schema.sql, hubd_due_allocations).
    WHERE a.id = due.id AND a.id = ANY (ARRAY(SELECT id FROM due))
    RETURNING a.*,
        CASE WHEN a.status IN ('replacing', 'releasing') AND a.sidecar_id IS NOT NULL
             THEN leases.effect_id END AS destroy_effect_id,
        -- This statement's own binding: the new identity is unique to it.
        CASE WHEN a.status = 'provisioning' AND a.sidecar_id = leases.sidecar_id
             THEN leases.effect_id END AS ensure_effect_id,
        -- Whether an earlier lease left a plugin call with no outcome (only a status that calls
        -- plugins can have one): the claim settles those first, and skips the statement
        -- otherwise. Exact: no other lease can write an intent while this one is live, and
        -- this statement's own intents are not in its snapshot. A row bound here has none.
        a.status IN ('provisioning', 'replacing', 'releasing')
            AND a.sidecar_id IS DISTINCT FROM leases.sidecar_id
            AND hubd_has_open_effects(a.id) AS open_effects
), intents AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id,
        effect_id, kind, from_status, to_status, phase)
    SELECT id, generation, lease_id, :instance_id, effect_id, kind, from_status, status, phase
    FROM (
        SELECT id, generation, lease_id, destroy_effect_id AS effect_id, 'destroy' AS kind,
            status AS from_status, status, 'intent' AS phase, 1 AS place
        FROM claimed WHERE destroy_effect_id IS NOT NULL
        UNION ALL
        SELECT id, generation, lease_id, NULL, 'bind_sidecar', 'pending', status, 'committed', 1
        FROM claimed WHERE ensure_effect_id IS NOT NULL
        UNION ALL
        SELECT id, generation, lease_id, ensure_effect_id, 'ensure', status, status, 'intent', 2
        FROM claimed WHERE ensure_effect_id IS NOT NULL
    ) AS rows
    ORDER BY id, place
)
SELECT * FROM claimed;

-- name: renew_leases
-- Extend, in one statement, every lease in the pairs (:allocation_ids, :lease_ids) that is still held
-- and live; returns the ids renewed. Rows are locked in id order, so two renewals (or a
-- renewal and a set statement) never deadlock.
-- Each side of a join also names its rows by key (a.id = ANY ...): a plan made on a table the
-- statistics call empty may otherwise read the whole table and filter it, every renewal.
WITH held AS (
    SELECT a.id FROM hubd_allocations AS a
    JOIN unnest(:allocation_ids::text[], :lease_ids::text[]) AS mine (id, lease_id)
      ON a.id = mine.id AND a.lease_id = mine.lease_id
    WHERE a.id = ANY (:allocation_ids::text[])
      AND a.lease_expires_at > clock_timestamp()
    ORDER BY a.id
    FOR UPDATE OF a
)
UPDATE hubd_allocations AS a
SET lease_expires_at = now() + make_interval(secs => :lease_duration)
FROM held
WHERE a.id = held.id AND a.id = ANY (:allocation_ids::text[])
  AND a.lease_expires_at > clock_timestamp()
RETURNING a.id;

-- name: drop_lease
-- Give a live lease back without any other change, so the row is claimable at once: a claim that
-- found local work still running on its allocation must not hold the row for a whole lease. The
-- intents its claim statement wrote are settled as never called (:instance_id the hub).
WITH dropped AS (
    UPDATE hubd_allocations
    SET lease_id = NULL, lease_expires_at = NULL
    WHERE id = :allocation_id AND lease_id = :lease_id AND lease_expires_at > clock_timestamp()
    RETURNING id
), settled AS (
    INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id,
        effect_id, kind, from_status, to_status, phase, error_code, message)
    SELECT i.allocation_id, i.generation, i.lease_id, :instance_id, i.effect_id, i.kind,
        i.from_status, i.to_status, 'failed', 'not_called', 'the claim gave its lease back first'
    FROM hubd_allocation_ledger AS i JOIN dropped ON i.allocation_id = dropped.id
    WHERE i.lease_id = :lease_id AND i.effect_id IS NOT NULL AND i.phase = 'intent'
)
SELECT id FROM dropped;

-- name: give_back_lease
-- A claim that stopped because its lease no longer fenced its writes (a release or a peer moved
-- the row on) ends :lease_id early: the row is claimable at once instead of after the lease runs
-- out. Nothing else changes, its open intents included: the next claim settles them as it would
-- after an expired lease. Only while the lease is still :lease_id.
UPDATE hubd_allocations SET lease_id = NULL, lease_expires_at = NULL
WHERE id = :allocation_id AND lease_id = :lease_id
RETURNING id;

