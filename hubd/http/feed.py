"""One follower of the event feed for the whole HTTP API: it wakes event streams and waits.

An HTTP caller's stream or wait must not hold a database connection of its own while it waits
(a thousand waits would be a thousand connections), so one follower (``LISTEN hubd_events``,
:meth:`hubd.client.Client.events`) reads every event as it commits and tells the waiters: each
stream learns that the feed moved past what it has read, each wait that its allocation has a new
event. They then read under their own wall. The follower reconnects on its own; a cursor the
feed no longer keeps (a follower that fell that far behind) starts again from the newest event,
after waking everyone, who read what they missed from the feed itself.

A stream is woken by its own tenant's events only (an operator's by every event): each wake-up
costs a read of the feed, and with every stream woken by every event, 40 idle streams of other
tenants took a tenant's delivery p99 from 26 to 102 ms (``python -m bench.http``), the reads
queueing for the API's few connections. Where the follower cannot know whose events it missed
(at each start), it raises a floor that wakes every stream once.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Iterator

import structlog

from hubd.client import Client
from hubd.errors import EventCursorExpired, HubdError
from hubd.redaction import describe_error

__all__ = ["FeedSignal"]

log = structlog.get_logger(__name__)

RETRY_AFTER = 1.0
"""Seconds before the follower starts again after an error it cannot ride out."""


class FeedSignal:
    def __init__(self, client: Client) -> None:
        self._client = client
        self.position = 0
        """The newest position heard of: every event up to it has committed."""
        self._floor = 0
        """Every tenant's events may have moved up to here (the follower's last start)."""
        self._tenants: dict[str, int] = {}
        """The newest position of each tenant's events: one number per tenant heard of."""
        self._moved: dict[str | None, asyncio.Event] = {}
        """Set at the next event of a tenant (``None``: of anyone); made when first waited for."""
        self._watchers: dict[str, weakref.WeakSet[asyncio.Event]] = {}
        self.stopped = False
        """The follower has ended: :meth:`moved_past` waits no more."""

    async def run(self) -> None:
        """Follow the feed until cancelled (when the API closes)."""
        try:
            while True:
                try:
                    self._restart(await self._client.cursor())
                    events = self._client.events(since=self.position)
                    async with contextlib.aclosing(events):
                        async for event in events:
                            self._wake_watchers(event.allocation_id)
                            self._advance(event.position, event.tenant)
                except EventCursorExpired:
                    self._wake_all()
                except HubdError as exc:
                    log.warning("http_feed_follower_failed", error=describe_error(exc))
                    self._wake_all()
                    await asyncio.sleep(RETRY_AFTER)
        finally:
            # Nothing moves the feed any more: every stream waiting for it is let go, and finds
            # the API closing. Streams need no timer of their own to notice (each woke once a
            # second with one: 1,000 wake-ups a second for 1,000 idle streams).
            self.stopped = True
            self._wake_all()

    def position_of(self, tenant: str | None) -> int:
        """The newest position of an event ``tenant`` may see (``None``: every tenant's)."""
        if tenant is None:
            return self.position
        return max(self._floor, self._tenants.get(tenant, 0))

    async def moved_past(self, position: int, tenant: str | None = None) -> None:
        """Return once the feed has an event ``tenant`` may see after ``position``."""
        while self.position_of(tenant) <= position and not self.stopped:
            moved = self._moved.get(tenant)
            if moved is None:
                moved = self._moved[tenant] = asyncio.Event()
            await moved.wait()

    @contextlib.contextmanager
    def watching(self, allocation_id: str) -> Iterator[asyncio.Event]:
        """An event set at the next event of ``allocation_id`` (or when the follower had to
        start again): register before reading the allocation, then wait on it."""
        woken = asyncio.Event()
        self._watchers.setdefault(allocation_id, weakref.WeakSet()).add(woken)
        try:
            yield woken
        finally:
            watchers = self._watchers.get(allocation_id)
            if watchers is not None:
                watchers.discard(woken)
                if not watchers:
                    del self._watchers[allocation_id]

    def _advance(self, position: int, tenant: str | None) -> None:
        if position <= self.position:
            return
        self.position = position
        self._set(None)
        if tenant is not None:
            self._tenants[tenant] = position
            self._set(tenant)

    def _restart(self, position: int) -> None:
        """The follower starts at ``position``: whose events came since its last is unknown."""
        if position > self.position:
            self.position = self._floor = position
            self._set_all()

    def _set(self, tenant: str | None) -> None:
        # Popped: the woken make a new one if they wait again, so only tenants with a stream
        # waiting keep one.
        moved = self._moved.pop(tenant, None)
        if moved is not None:
            moved.set()

    def _set_all(self) -> None:
        moved, self._moved = self._moved, {}
        for each in moved.values():
            each.set()

    def _wake_watchers(self, allocation_id: str) -> None:
        for woken in self._watchers.get(allocation_id, ()):
            woken.set()

    def _wake_all(self) -> None:
        for watchers in self._watchers.values():
            for woken in watchers:
                woken.set()
        self._set_all()
