"""``/readyz`` as a balancer or an orchestrator sees it, across a partition that drops every
connection for good (tests/proxykit.py ``drop()``): sampled from before the fault, so that
"ready again" is told from "not noticed yet", and timed from the heal.

The suite runs it at CI size (tests/test_failover_daemon.py); ``python -m bench.readyz_heal``
runs it at full size.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import attrs

from tests.daemonkit import http_get
from tests.proxykit import Blackhole

__all__ = ["READY", "UNREACHABLE", "Healed", "ReadyzSampler", "dropped_partition", "sampling"]

READY = "ready"
UNREACHABLE = "not ready: database unreachable"


class ReadyzSampler:
    """``GET /readyz`` every ``every`` seconds, each on a fresh connection with a 2 s budget:
    ``(monotonic time, what it said)``, the body or ``no answer (...)``."""

    def __init__(self, url: str, *, every: float = 0.1) -> None:
        self._url = url
        self._every = every
        self.samples: list[tuple[float, str]] = []
        self._sampled = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(2):
                    _, body = await http_get(self._url)
                said = body.strip()
            except (OSError, TimeoutError, ValueError, IndexError) as exc:
                said = f"no answer ({type(exc).__name__})"
            self.samples.append((time.monotonic(), said))
            self._sampled.set()
            await asyncio.sleep(self._every)

    async def until(self, wanted: str, *, since: float, within: float) -> float | None:
        """Seconds from ``since`` to the first sample taken after it that said ``wanted``;
        ``None`` when none did by ``since + within``."""
        deadline = since + within
        while True:
            for at, said in self.samples:
                if at >= since and said == wanted:
                    return at - since
            if time.monotonic() > deadline:
                return None
            self._sampled.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline - time.monotonic(), 0) + 0.5):
                    await self._sampled.wait()

    def said_after(self, since: float, wanted: str = READY) -> list[str]:
        """What the samples after ``since`` said other than ``wanted``, in order, repeats
        dropped."""
        said: list[str] = []
        for at, text in self.samples:
            if at > since and text != wanted and (not said or said[-1] != text):
                said.append(text)
        return said


@contextlib.asynccontextmanager
async def sampling(url: str, *, every: float = 0.1) -> AsyncIterator[ReadyzSampler]:
    """A sampler running for the block."""
    sampler = ReadyzSampler(url, every=every)
    task = asyncio.create_task(sampler.run(), name="readyz-sampler")
    try:
        yield sampler
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@attrs.frozen(kw_only=True)
class Healed:
    """One dropped partition, timed."""

    lasted: float
    """Seconds from the drop to the heal."""
    noticed: float
    """Seconds from the drop until ``/readyz`` said the database is unreachable."""
    ready: float | None
    """Seconds from the heal to the first 200; ``None``: not within the bound."""
    flapped: list[str]
    """What ``/readyz`` said after that first 200 and within ``steady`` seconds of it, other
    than ready (empty: ready for good)."""
    said: list[str]
    """What ``/readyz`` said other than ready from the drop on, in order (the first ten)."""


async def dropped_partition(
    proxy: Blackhole,
    sampler: ReadyzSampler,
    *,
    outage: float = 0.0,
    notice_within: float = 120.0,
    bound: float = 60.0,
    steady: float = 3.0,
) -> Healed:
    """Drop every connection through ``proxy`` until ``/readyz`` says the database is
    unreachable and at least ``outage`` seconds have passed; heal; wait up to ``bound`` seconds
    for a 200, then ``steady`` seconds more to see it stay."""
    dropped = time.monotonic()
    proxy.drop()
    try:
        noticed = await sampler.until(UNREACHABLE, since=dropped, within=notice_within)
        if noticed is None:
            raise AssertionError(
                f"/readyz never said {UNREACHABLE!r} within {notice_within:g}s of the drop: "
                f"{sampler.said_after(dropped)}"
            )
        remaining = dropped + outage - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)  # the fault's length, not a wait for a condition
    finally:
        proxy.heal()
    healed = time.monotonic()
    ready = await sampler.until(READY, since=healed, within=bound)
    flapped: list[str] = []
    if ready is not None:
        first = healed + ready
        # Watching it stay ready for `steady` seconds, not waiting for a condition.
        await asyncio.sleep(max(first + steady - time.monotonic(), 0))
        flapped = [
            said for at, said in sampler.samples if first < at <= first + steady and said != READY
        ]
    return Healed(
        lasted=healed - dropped,
        noticed=noticed,
        ready=ready,
        flapped=flapped,
        said=sampler.said_after(dropped)[:10],
    )
