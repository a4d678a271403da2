-- Statements on hubd_allocation_ledger, the append-only evidence of transitions and plugin calls.
-- Transitions write their own rows and, normally, the rows of the plugin calls they bracket
-- (transitions.sql); record_effect writes one phase of a call on its own, fenced
-- like every claim-owned write (:allocation_id, :lease_id, :generation; :instance_id the hub).

-- name: record_effect
-- One :phase of a plugin call (:effect_id, :kind) in :status, written only while the claim
-- still owns the row.
INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, effect_id,
    kind, from_status, to_status, phase, error_code, message, duration_ms)
SELECT id, generation, :lease_id, :instance_id, :effect_id, :kind, :status, :status, :phase,
    :error_code, :message, :duration_ms
FROM hubd_allocations
WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
  AND lease_expires_at > clock_timestamp()
RETURNING seq;

-- name: settle_open_effects
-- Intents of earlier leases with no recorded outcome: their process died or lost its lease while
-- the call ran, so the outcome cannot be known. Recorded once, as ambiguous, by the new owner.
INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, effect_id,
    kind, from_status, to_status, phase, error_code, message)
SELECT i.allocation_id, i.generation, i.lease_id, :instance_id, i.effect_id, i.kind, i.from_status,
    i.to_status, 'ambiguous', 'outcome_unknown', 'no outcome was recorded before the lease ended'
FROM hubd_allocation_ledger AS i
WHERE i.allocation_id = :allocation_id
  AND i.effect_id IS NOT NULL
  AND i.phase = 'intent'
  AND i.lease_id IS DISTINCT FROM :lease_id
  AND NOT EXISTS (
      SELECT 1 FROM hubd_allocation_ledger AS o
      WHERE o.allocation_id = i.allocation_id AND o.effect_id = i.effect_id AND o.phase <> 'intent')
  AND EXISTS (
      SELECT 1 FROM hubd_allocations
      WHERE id = :allocation_id AND lease_id = :lease_id AND generation = :generation
        AND lease_expires_at > clock_timestamp())
RETURNING seq;

-- name: history
-- An allocation's ledger, oldest first.
SELECT * FROM hubd_allocation_ledger WHERE allocation_id = :allocation_id ORDER BY seq;

-- name: record_orphan
-- Orphan collection's evidence: :sidecar_id of :allocation_id (at :generation, or the
-- allocation's own when NULL) belongs to no current generation; :kind ('orphan_found',
-- 'orphan_destroyed'), :phase, :error_code and :message (prefixed with the sidecar id). Nothing is
-- written for an allocation this database does not know.
INSERT INTO hubd_allocation_ledger (allocation_id, generation, instance_id, kind, from_status,
    to_status, phase, error_code, message)
SELECT id, COALESCE(:generation, generation), :instance_id, :kind, status, status, :phase,
    :error_code, left(:sidecar_id::text || ': ' || :message, 500)
FROM hubd_allocations WHERE id = :allocation_id
RETURNING seq;
