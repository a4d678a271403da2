"""Reading what fault runs against real replicas left behind: generations, the ledger's
abandoning writes, and stopping every daemon whatever state it was left in."""

from __future__ import annotations

import contextlib
import signal

import asyncpg

from hubd.store import AllocationStore
from tests.daemonkit import DaemonProcess

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
