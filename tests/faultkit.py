"""Reading what fault runs against real replicas left behind: generations, the ledger's
abandoning writes, and stopping every daemon whatever state it was left in. A :class:`Baseline`
taken before a fault says what the fault must have left as it was."""

from __future__ import annotations

import contextlib
import signal

import asyncpg
import attrs

from hubd.store import AllocationStore
from tests.daemonkit import DaemonProcess, sidecar_pids

ABANDONING = ("begin_replacement", "begin_unrecoverable_release", "mark_released", "release")
"""Ledger kinds that give up a sidecar: none may follow a fault that left sidecars healthy."""


async def stop_all(*daemons: DaemonProcess) -> None:
    for daemon in daemons:
        if daemon.process is not None and daemon.process.returncode is None:
            await daemon.signal(signal.SIGCONT)
            await daemon.signal(signal.SIGTERM)
    for daemon in daemons:
        with contextlib.suppress(TimeoutError):
            await daemon.wait(within=30)
        await daemon.kill()


async def abandoning_writes(dsn: str, ids: list[str], after_seq: int) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT allocation_id, kind, error_code FROM hubd_allocation_ledger "
            "WHERE allocation_id = ANY($1::text[]) AND seq > $2 AND kind = ANY($3::text[])",
            ids,
            after_seq,
            list(ABANDONING),
        )
        return [f"{r['allocation_id']} {r['kind']} {r['error_code']}" for r in rows]
    finally:
        await conn.close()


async def ledger_head(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT coalesce(max(seq), 0) FROM hubd_allocation_ledger"))
    finally:
        await conn.close()


async def generations(store: AllocationStore, ids: list[str]) -> dict[str, int]:
    return {i: (await store.get(i)).generation for i in ids}


@attrs.frozen(kw_only=True)
class Baseline:
    """Healthy allocations before a fault: their generations, the live sidecar processes of
    ``marker``, and the ledger's last row (what follows it was written during or after the
    fault)."""

    ids: list[str]
    generations: dict[str, int]
    pids: set[int]
    head: int

    @classmethod
    async def take(
        cls, dsn: str, observer: AllocationStore, ids: list[str], marker: str
    ) -> Baseline:
        return cls(
            ids=ids,
            generations=await generations(observer, ids),
            pids=sidecar_pids(marker),
            head=await ledger_head(dsn),
        )

    async def assert_kept(
        self, dsn: str, observer: AllocationStore, marker: str, *daemons: DaemonProcess
    ) -> None:
        """Nothing healthy was given up: every allocation at its generation, the same sidecar
        processes, no abandoning write since; and no invariant broken, no traceback logged."""
        assert await generations(observer, self.ids) == self.generations
        assert sidecar_pids(marker) == self.pids
        assert await abandoning_writes(dsn, self.ids, self.head) == []
        assert broken(await violations(dsn)) == {}
        assert tracebacks(*daemons) == []


# -- the checker -----------------------------------------------------------------------------
#
# Observer triggers record every version of every allocation row (with the clock time it was
# written and the lease it carried); after a run, invariants are checked against that record and
# the ledger only. Nothing the daemons logged is trusted.

OBSERVE = """
CREATE TABLE IF NOT EXISTS hubd_observed_versions (
    seq            bigserial PRIMARY KEY,
    allocation_id  text NOT NULL,
    txid           bigint NOT NULL,
    at             timestamptz NOT NULL,
    old_status     text,
    new_status     text NOT NULL,
    old_generation integer,
    new_generation integer NOT NULL,
    lease_id       text,
    lease_expires_at timestamptz
);
-- The stale-write check looks up, for every ledger row, the version just before it: without
-- this index that is a scan of the whole history per row, minutes at full chaos size.
CREATE INDEX IF NOT EXISTS hubd_observed_versions_by_allocation
    ON hubd_observed_versions (allocation_id, seq);
CREATE OR REPLACE FUNCTION hubd_observe_version() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO hubd_observed_versions (allocation_id, txid, at, old_status, new_status,
        old_generation, new_generation, lease_id, lease_expires_at)
    VALUES (NEW.id, txid_current(), clock_timestamp(),
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.status END, NEW.status,
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.generation END, NEW.generation,
        NEW.lease_id, NEW.lease_expires_at);
    RETURN NULL;
END;
$$;
DROP TRIGGER IF EXISTS hubd_observe_versions ON hubd_allocations;
CREATE TRIGGER hubd_observe_versions AFTER INSERT OR UPDATE ON hubd_allocations
    FOR EACH ROW EXECUTE FUNCTION hubd_observe_version();
"""

# A ledger row written under lease L must have been written while L was live: the allocation's
# latest version written before the row carries L, granted until after the row, or the row was
# written by the transaction that granted L (a claim statement writes the destroy's intent under
# the lease it grants; the version is recorded at the end of that statement, after the row).
# Rows that settle a dead lease's open call carry that lease by design and are left out.
_STALE_WRITES = """
SELECT l.seq, l.allocation_id, l.kind, l.lease_id
FROM hubd_allocation_ledger AS l
LEFT JOIN LATERAL (
    SELECT v.lease_id, v.lease_expires_at FROM hubd_observed_versions AS v
    WHERE v.allocation_id = l.allocation_id AND v.at <= l.at
    ORDER BY v.seq DESC LIMIT 1
) AS before ON true
WHERE l.lease_id IS NOT NULL AND l.error_code IS DISTINCT FROM 'outcome_unknown'
  AND (before.lease_id IS DISTINCT FROM l.lease_id OR before.lease_expires_at <= l.at)
  AND NOT EXISTS (
      SELECT 1 FROM hubd_observed_versions AS granted
      WHERE granted.allocation_id = l.allocation_id AND granted.lease_id = l.lease_id
        AND granted.txid % 4294967296 = l.xmin::text::bigint
        AND granted.lease_expires_at > l.at)
ORDER BY l.seq
"""

_VERSIONS = """
SELECT allocation_id, old_status, new_status, new_generation, lease_id
FROM hubd_observed_versions ORDER BY seq
"""

TERMINAL = ("released", "failed", "destroy_failed")


async def install_observer(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(OBSERVE)
    finally:
        await conn.close()


async def violations(dsn: str) -> dict[str, list[str]]:
    """Every invariant broken in the observed history, by invariant (empty lists: none)."""
    conn = await asyncpg.connect(dsn)
    try:
        stale = await conn.fetch(_STALE_WRITES)
        versions = await conn.fetch(_VERSIONS)
    finally:
        await conn.close()
    found: dict[str, list[str]] = {
        "stale_lease_writes": [
            f"{r['allocation_id']} ledger {r['seq']} {r['kind']} under {r['lease_id']}"
            for r in stale
        ],
        "generation_regressions": [],
        "interleaved_leases": [],
        "terminal_rows_changed": [],
    }
    generation: dict[str, int] = {}
    leases: dict[str, list[str]] = {}
    for v in versions:
        aid = v["allocation_id"]
        if v["old_status"] in TERMINAL:
            found["terminal_rows_changed"].append(f"{aid} changed after {v['old_status']}")
        if v["new_generation"] < generation.get(aid, 0):
            found["generation_regressions"].append(
                f"{aid} {generation[aid]} -> {v['new_generation']}"
            )
        generation[aid] = max(generation.get(aid, 0), v["new_generation"])
        lease = v["lease_id"]
        if lease is None:
            continue
        seen = leases.setdefault(aid, [])
        if seen and seen[-1] == lease:
            continue
        if lease in seen:
            found["interleaved_leases"].append(f"{aid} lease {lease} came back")
        seen.append(lease)
    return found


def broken(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: items for name, items in found.items() if items}


def tracebacks(*daemons: DaemonProcess) -> list[str]:
    """Every Python traceback the daemons wrote, each with the lines that follow it."""
    found = []
    for daemon in daemons:
        for index, line in enumerate(daemon.raw):
            if "Traceback (most recent call last)" in line:
                found.append("\n".join(daemon.raw[max(0, index - 2) : index + 25]))
    return found
