-- Statements on hubd_allocation_ledger, the append-only evidence of transitions and plugin calls.
-- Transitions write their own rows (allocations.sql); these record plugin-call effects, fenced
-- like every claim-owned write ($1 id, $2 lease, $3 generation, $4 hub instance).

-- name: record_effect
-- One phase ($7) of a plugin call ($5 effect id, $6 kind) in status $11, written only while the
-- claim still owns the row.
INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, effect_id,
    kind, from_status, to_status, phase, error_code, message, duration_ms)
SELECT id, generation, $2, $4, $5, $6, $11, $11, $7, $8, $9, $10
FROM hubd_allocations
WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp()
RETURNING seq;

-- name: settle_open_effects
-- Intents of earlier leases with no recorded outcome: their process died or lost its lease while
-- the call ran, so the outcome cannot be known. Recorded once, as ambiguous, by the new owner.
INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, instance_id, effect_id,
    kind, from_status, to_status, phase, error_code, message)
SELECT i.allocation_id, i.generation, i.lease_id, $4, i.effect_id, i.kind, i.from_status,
    i.to_status, 'ambiguous', 'outcome_unknown', 'no outcome was recorded before the lease ended'
FROM hubd_allocation_ledger AS i
WHERE i.allocation_id = $1
  AND i.effect_id IS NOT NULL
  AND i.phase = 'intent'
  AND i.lease_id IS DISTINCT FROM $2
  AND NOT EXISTS (
      SELECT 1 FROM hubd_allocation_ledger AS o
      WHERE o.allocation_id = i.allocation_id AND o.effect_id = i.effect_id AND o.phase <> 'intent')
  AND EXISTS (
      SELECT 1 FROM hubd_allocations
      WHERE id = $1 AND lease_id = $2 AND generation = $3 AND lease_expires_at > clock_timestamp())
RETURNING seq;

-- name: history
-- An allocation's ledger, oldest first.
SELECT * FROM hubd_allocation_ledger WHERE allocation_id = $1 ORDER BY seq;

-- name: record_orphan
-- Orphan collection's evidence: sidecar $2 of allocation $1 (generation $3, or the allocation's
-- own when NULL) belongs to no current generation; $5 kind ('orphan_found', 'orphan_destroyed'),
-- $6 phase, $7/$8 error code and message (prefixed with the sidecar id). Nothing is written for an allocation this database
-- does not know.
INSERT INTO hubd_allocation_ledger (allocation_id, generation, instance_id, kind, from_status,
    to_status, phase, error_code, message)
SELECT id, COALESCE($3, generation), $4, $5, status, status, $6, $7,
    left($2::text || ': ' || $8, 500)
FROM hubd_allocations WHERE id = $1
RETURNING seq;
