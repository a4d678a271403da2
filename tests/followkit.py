"""A follower under fire: writers commit out of order while the follower's backends are
terminated and its reads cancelled, and an account of what it received.

``tests/test_client_faults.py`` runs :func:`under_fire` at CI size, ``bench/follow_faults.py``
at full size. Everything is real: a PostgreSQL server, the Python client on a pool of its own
(its connections named :data:`FOLLOWER` in ``pg_stat_activity``), writers on connections of
their own, and the faults dealt by a superuser's connection.

The faults, dealt in turn:

- ``listening``: the follower's backend is terminated while it waits for a notification;
- ``reading``: terminated in the middle of a feed read (the read is held on a lock of the
  feed's horizon until the backend is gone);
- ``cancelled``: the same read cancelled (``pg_cancel_backend``) instead;
- ``opening``: terminated, and then the next backend too as soon as it appears (while the pool
  connects it, or the follower runs ``LISTEN`` or its first read).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
import random
import time
from collections.abc import Mapping
from typing import Any, Final

import asyncpg
import attrs

from hubd.client import Client
from tests.polling import eventually

__all__ = ["FAULTS", "FOLLOWER", "Account", "Fire", "follower_backends", "named", "under_fire"]

FOLLOWER: Final = "hubd-follower"
"""The ``application_name`` of the followed client's connections."""
WRITER: Final = "hubd-writer"
FAULTS: Final = ("listening", "reading", "cancelled", "opening")
_BACKENDS: Final = """
SELECT pid, state, wait_event_type FROM pg_stat_activity
WHERE application_name = $1 AND datname = current_database() AND pid <> pg_backend_pid()"""


@attrs.frozen(kw_only=True)
class Fire:
    seconds: float
    """How long the writers commit (the faults go on as long)."""
    writers: int
    fault_every: tuple[float, float]
    """A fault after a uniformly random wait in this range (seconds)."""
    hold: float = 0.02
    """At most this long, each writer's first transaction stays open after its second one
    committed (so the first commits last, with the later position)."""
    seed: int = 0


@attrs.frozen(kw_only=True)
class Account:
    committed: int
    """Events the feed holds after the start (each writer loop commits four)."""
    received: int
    missing: int
    """Positions committed and never received."""
    repeated: int
    """Receptions of a position received before."""
    out_of_order: int
    """Receptions of a position not after the one before it."""
    faults: Mapping[str, int]
    """Faults dealt, by kind."""
    backends: int
    """Distinct backends the follower had (each fault costs it one)."""
    died: str | None
    """The error the follower died of before it was closed, if it did."""
    close_seconds: float
    """How long ``Client.close()`` took (infinite: it did not return within the deadline)."""
    ended_with: str
    """How the follower ended once its client closed (``ClientClosed`` expected)."""

    @property
    def exact(self) -> bool:
        return (
            self.died is None
            and self.received == self.committed
            and self.missing == self.repeated == self.out_of_order == 0
        )


def named(dsn: str, application_name: str) -> str:
    """``dsn`` with ``application_name`` (asyncpg sends unknown DSN parameters as settings)."""
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={application_name}"


async def follower_backends(admin: asyncpg.Connection) -> list[asyncpg.Record]:
    """The follower client's backends: pid, state, wait_event_type."""
    return list(await admin.fetch(_BACKENDS, FOLLOWER))


async def under_fire(
    admin_dsn: str, app_dsn: str, fire: Fire, *, catch_up: float, close_deadline: float
) -> Account:
    """Follow the feed from its head while ``fire`` lasts, then until every committed event
    arrived (``catch_up`` seconds at most), then close the client (``close_deadline`` at most)
    and account for what arrived."""
    admin = await asyncpg.connect(admin_dsn)
    client = await Client.connect(named(app_dsn, FOLLOWER))
    received: list[tuple[int, str, str]] = []
    faults: collections.Counter[str] = collections.Counter()
    pids: set[int] = set()
    try:
        start = await client.cursor()

        async def follow() -> None:
            async for event in client.events(since=start):
                received.append((event.position, event.allocation_id, event.event))

        follower = asyncio.create_task(follow(), name="follower")
        stop = asyncio.Event()
        rng = random.Random(fire.seed)
        writers = [
            asyncio.create_task(_write(app_dsn, n, stop, rng, fire.hold), name=f"writer-{n}")
            for n in range(fire.writers)
        ]
        faulting = asyncio.create_task(
            _deal(admin_dsn, stop, rng, fire.fault_every, faults, pids), name="faults"
        )
        try:
            await asyncio.wait([follower, *writers], timeout=fire.seconds)
            stop.set()
            await asyncio.gather(*writers, faulting)
            truth = [
                (row["position"], row["allocation_id"], row["event"])
                for row in await admin.fetch(
                    "SELECT position, allocation_id, event FROM hubd_v1.events "
                    "WHERE position > $1 ORDER BY position",
                    start,
                )
            ]
            last = truth[-1][0] if truth else start
            with contextlib.suppress(AssertionError):  # what did not arrive is accounted for
                await eventually(
                    lambda: follower.done() or (bool(received) and received[-1][0] >= last),
                    within=catch_up,
                    what="the follower to catch up",
                )
            died = _died(follower)
            started = time.monotonic()
            close_seconds, ended_with = math.inf, "still following"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(close_deadline):
                    await client.close()
                    close_seconds = time.monotonic() - started
                    (ended,) = await asyncio.gather(follower, return_exceptions=True)
                    ended_with = type(ended).__name__
        finally:
            stop.set()
            for task in (follower, *writers, faulting):
                task.cancel()
            await asyncio.gather(follower, *writers, faulting, return_exceptions=True)
    finally:
        await client.close()
        await admin.close()
    positions = [position for position, _, _ in received]
    return Account(
        committed=len(truth),
        received=len(received),
        missing=len(set(truth) - set(received)),
        repeated=len(positions) - len(set(positions)),
        out_of_order=sum(1 for a, b in itertools.pairwise(positions) if b <= a),
        faults=dict(faults),
        backends=len(pids),
        died=died,
        close_seconds=close_seconds,
        ended_with=ended_with,
    )


def _died(task: asyncio.Task[None]) -> str | None:
    if not task.done():
        return None
    if task.cancelled():
        return "cancelled"
    error = task.exception()
    return f"{type(error).__name__}: {error}" if error is not None else "returned"


async def _write(dsn: str, n: int, stop: asyncio.Event, rng: random.Random, hold: float) -> None:
    """Pairs of transactions that commit out of order: the first requests, the second requests
    and releases and commits, then the first releases its own and commits, after the second
    (four events, the first transaction's two positions after the second's)."""
    early = await asyncpg.connect(named(dsn, WRITER))
    late = await asyncpg.connect(named(dsn, WRITER))
    try:
        loop = 0
        while not stop.is_set():
            loop += 1
            async with early.transaction():
                first = await early.fetchval(
                    "SELECT id FROM hubd_v1.request('fake', session => $1)", f"w{n}-{loop}-a"
                )
                async with late.transaction():
                    second = await late.fetchval(
                        "SELECT id FROM hubd_v1.request('fake', session => $1)", f"w{n}-{loop}-b"
                    )
                    await late.execute("SELECT hubd_v1.release($1, 'done')", second)
                await asyncio.sleep(rng.uniform(0, hold))
                await early.execute("SELECT hubd_v1.release($1, 'done')", first)
    finally:
        await early.close()
        await late.close()


async def _deal(
    admin_dsn: str,
    stop: asyncio.Event,
    rng: random.Random,
    every: tuple[float, float],
    faults: collections.Counter[str],
    pids: set[int],
) -> None:
    """One fault of each kind in turn, until ``stop``."""
    admin = await asyncpg.connect(admin_dsn)
    try:
        kinds = iter(FAULTS * 1_000_000)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rng.uniform(*every)):
                    await stop.wait()
            if stop.is_set():
                return
            kind = next(kinds)
            if await _DEALERS[kind](admin, pids):
                faults[kind] += 1
    finally:
        await admin.close()


async def _backends(admin: asyncpg.Connection, pids: set[int]) -> list[asyncpg.Record]:
    rows = await follower_backends(admin)
    pids.update(row["pid"] for row in rows)
    return rows


async def _terminate(admin: asyncpg.Connection, pid: int) -> bool:
    return bool(await admin.fetchval("SELECT pg_terminate_backend($1)", pid))


async def _listening(admin: asyncpg.Connection, pids: set[int]) -> bool:
    """Terminate the follower's backend while it waits (idle, listening)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            while True:
                idle = [r["pid"] for r in await _backends(admin, pids) if r["state"] == "idle"]
                if idle:
                    return any([await _terminate(admin, pid) for pid in idle])
                await asyncio.sleep(0.005)
    return False


async def _held_read(admin: asyncpg.Connection, pids: set[int], end: str) -> bool:
    """Hold the follower's next read on a lock of the feed's horizon (the writers do not take
    it), and end it with ``end`` (``pg_terminate_backend`` or ``pg_cancel_backend``)."""
    async with admin.transaction():
        await admin.execute("LOCK TABLE hubd_event_horizon IN ACCESS EXCLUSIVE MODE")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                while True:
                    rows = await _backends(admin, pids)
                    waiting = [r["pid"] for r in rows if r["wait_event_type"] == "Lock"]
                    if waiting:
                        return bool(await admin.fetchval(f"SELECT {end}($1)", waiting[0]))
                    await asyncio.sleep(0.005)
    return False


async def _reading(admin: asyncpg.Connection, pids: set[int]) -> bool:
    return await _held_read(admin, pids, "pg_terminate_backend")


async def _cancelled(admin: asyncpg.Connection, pids: set[int]) -> bool:
    return await _held_read(admin, pids, "pg_cancel_backend")


async def _opening(admin: asyncpg.Connection, pids: set[int]) -> bool:
    """Terminate the follower's backends, then the next one the moment it appears."""
    before = {row["pid"] for row in await _backends(admin, pids)}
    for pid in before:
        await _terminate(admin, pid)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            while True:
                fresh = [r["pid"] for r in await _backends(admin, pids) if r["pid"] not in before]
                if fresh:
                    return await _terminate(admin, fresh[0])
                await asyncio.sleep(0.001)
    return False


_DEALERS: Final[dict[str, Any]] = {
    "listening": _listening,
    "reading": _reading,
    "cancelled": _cancelled,
    "opening": _opening,
}
