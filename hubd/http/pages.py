"""The recent events of each tenant with open streams, read once for all of its streams.

Fifty streams of one tenant woken by one of its events each read the feed under the tenant's
wall: fifty transactions for one event, queued for the API's few connections (delivery p99
145 ms in ``bench.http``). Here one read, walled into the tenant as every stream's own would
be, serves them all: the tenant's newest events are kept in memory while a stream of the tenant
is open, and each stream takes from them what comes after its own cursor. What a stream gets
is what its own read would have given: the same walled statement, made by whichever of the
tenant's streams asked first. Nothing read for one tenant is ever handed to another's stream
(the pages are kept by tenant, an operator's key's apart), so the wall stays in SQL.

A stream whose cursor is older than what is kept reads the feed itself, as before.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from collections.abc import Iterator
from typing import Final

import attrs

from hubd.client import Client, Event

__all__ = ["KEEP", "TenantPages"]

KEEP: Final = 2_000
"""Events kept for one tenant: the newest, enough for every stream not far behind."""
READ: Final = 500
"""Events one read takes at most."""


@attrs.define
class _Kept:
    since: int
    """Every event of the tenant after this position and up to ``upto`` is in ``events``."""
    upto: int
    events: list[Event] = attrs.field(factory=list)
    streams: int = 0
    reading: asyncio.Lock = attrs.field(factory=asyncio.Lock)


class TenantPages:
    def __init__(self, *, keep: int = KEEP) -> None:
        self._keep = keep
        self._kept: dict[str | None, _Kept] = {}

    @contextlib.contextmanager
    def streaming(self, tenant: str | None, position: int) -> Iterator[None]:
        """A stream of ``tenant`` (``None``: an operator's key) is open; its pages start after
        ``position`` (every event up to it committed) when it is the tenant's first."""
        kept = self._kept.get(tenant)
        if kept is None:
            kept = self._kept[tenant] = _Kept(since=position, upto=position)
        kept.streams += 1
        try:
            yield
        finally:
            kept.streams -= 1
            if not kept.streams and self._kept.get(tenant) is kept:
                del self._kept[tenant]

    async def after(
        self,
        client: Client,
        tenant: str | None,
        cursor: int,
        *,
        heard: int,
        allocation_id: str | None,
        limit: int,
    ) -> list[Event]:
        """The tenant's events after ``cursor`` (of ``allocation_id`` when given), at most
        ``limit``, read through ``client`` (walled into ``tenant``) once for every stream of
        the tenant: every event up to ``heard`` is among them, or among the next pages."""
        kept = self._kept.get(tenant)
        if kept is None or cursor < kept.since:
            return await client.events_page(after=cursor, allocation_id=allocation_id, limit=limit)
        if kept.upto < heard:
            async with kept.reading:
                # Another stream of the tenant may have read it meanwhile.
                while kept.upto < heard:
                    last = kept.events[-1].position if kept.events else kept.since
                    read = await client.events_page(after=max(last, kept.since), limit=READ)
                    kept.events.extend(read)
                    if len(read) < READ:
                        kept.upto = max(heard, read[-1].position if read else heard)
                    else:
                        kept.upto = read[-1].position
                    if len(kept.events) > self._keep:
                        dropped = len(kept.events) - self._keep
                        kept.since = kept.events[dropped - 1].position
                        del kept.events[:dropped]
            if cursor < kept.since:
                return await client.events_page(
                    after=cursor, allocation_id=allocation_id, limit=limit
                )
        found = []
        start = bisect.bisect_right(kept.events, cursor, key=_position)
        for event in itertools.islice(kept.events, start, None):
            if allocation_id is None or event.allocation_id == allocation_id:
                found.append(event)
                if len(found) == limit:
                    break
        return found


def _position(event: Event) -> int:
    return event.position
