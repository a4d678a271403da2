"""Waking the claim loop: LISTEN/NOTIFY as a hint, never as the only path.

A dedicated connection of the store's (:func:`hubd.store.notifications.listen`) listens for
``hubd_wake`` (new request, release, sidecar connected), ``hubd_connected`` (a sidecar connected
to some replica) and ``hubd_sockets`` (an allocation moved to a newer generation or a terminal
status: sockets held here may have to close) and ``hubd_handover`` (a pool member was taken: its
sidecar, if held here, is told its session). When that connection is lost, or is not listening
within :data:`LISTEN_SETUP_TIMEOUT` of its connect, it is re-opened with backoff and a full poll
follows, since notifications sent meanwhile are gone. A self-notification sent through the
ordinary pool every ``selfcheck_interval`` proves the path end to end; when it does not come back
in time the connection is recycled and readiness reports it. The self-check's statement is freed
at its timeout whatever the network does: an interrupted statement closes its connection rather
than wait for a cancellation to be acknowledged
(:meth:`hubd.store.database.Database.connection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable

import structlog

from hubd.aio import raise_if_cancelled, run_unless
from hubd.backoff import Retries
from hubd.errors import StoreError
from hubd.store.channels import (
    CHANNELS,
    CONNECTED_CHANNEL,
    HANDOVER_CHANNEL,
    SELFCHECK_CHANNEL,
    SOCKETS_CHANNEL,
    WAKE_CHANNEL,
)
from hubd.store.database import Database
from hubd.store.notifications import listen

__all__ = ["NotificationListener", "Waker"]

log = structlog.get_logger(__name__)

LISTEN_SETUP_TIMEOUT = 10.0
"""Seconds a new LISTEN connection may take from connect to listening on every channel: one the
network swallowed after its connect answered is given up and another tried, as a connect is."""


class Waker:
    """Wakes the claim dispatcher: level-triggered, so a wake-up that arrives while the
    dispatcher is busy claiming is kept for its next wait, never lost."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._notified = False
        self.requested = asyncio.Event()
        """Set by every ``hubd_wake`` (and a re-opened listener's catch-up), cleared by its one
        reader, the deadline sweep, which waits on it while no allocation is active: a new
        allocation is announced by one."""

    def wake(self) -> None:
        """Local work settled: something may be claimable here."""
        self._event.set()

    def notify(self) -> None:
        """The database said something became due (``hubd_wake``)."""
        self._notified = True
        self._event.set()
        self.requested.set()

    async def wait(self, limit: float) -> bool:
        """Return when woken (now, if woken since the last wait) or after ``limit`` seconds
        (the poll fallback); whether a notification from the database was among the wake-ups."""
        raise_if_cancelled()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                await self._event.wait()
        self._event.clear()
        notified, self._notified = self._notified, False
        return notified


class NotificationListener:
    def __init__(
        self,
        *,
        dsn: str,
        db: Database,
        on_wake: Callable[[], None],
        on_connected: Callable[[str], None],
        on_sockets: Callable[[str], None] = lambda _payload: None,
        on_handover: Callable[[str], None] = lambda _payload: None,
        on_reconnected: Callable[[], None] = lambda: None,
        selfcheck_interval: float = 10.0,
        selfcheck_timeout: float = 5.0,
        on_selfcheck_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self._dsn = dsn
        self._db = db
        self._on_wake = on_wake
        self._on_connected = on_connected
        self._on_sockets = on_sockets
        self._on_handover = on_handover
        self._on_reconnected = on_reconnected
        self._selfcheck_interval = selfcheck_interval
        self._selfcheck_timeout = selfcheck_timeout
        self._on_selfcheck_failure = on_selfcheck_failure
        self._nonces: dict[str, asyncio.Future[None]] = {}
        self.healthy = False
        self.up = asyncio.Event()  # set once the first connection listens
        self._recycle = asyncio.Event()

    def _notified(self, channel: str, payload: str) -> None:
        if channel == WAKE_CHANNEL:
            self._on_wake()
        elif channel == CONNECTED_CHANNEL:
            # No wake: the statement that wrote the record sent ``hubd_wake`` itself whenever a
            # claim has something to do (it did not make the allocation ready). A storm of
            # reconnects must not cost a claim each.
            self._on_connected(payload)
        elif channel == SOCKETS_CHANNEL:
            self._on_sockets(payload)
        elif channel == HANDOVER_CHANNEL:
            self._on_handover(payload)
        elif channel == SELFCHECK_CHANNEL:
            waiter = self._nonces.get(payload)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def recycle(self) -> None:
        """Drop the LISTEN connection and open a new one now, whatever it is doing (listening,
        connecting, waiting to retry); a full poll follows as after any reconnect. For when
        the connection may be dead without knowing it: the database answered again after an
        outage."""
        self._recycle.set()

    async def run(self) -> None:
        """Listen forever; reconnect with capped backoff whenever the connection is lost, at
        once when recycled."""
        # Capped low: the first connect after a partition heals ends the wait for the poll.
        retries = Retries.doubling(0.5, 5.0)
        while True:
            raise_if_cancelled()
            self._recycle.clear()
            try:
                if not await run_unless(self._recycle, self._listen(retries)):
                    log.info("wake_listener_recycled")
                    continue
            except StoreError as exc:
                # The driver's own words: the store's translation names only the kind of outage.
                cause = exc.__cause__ or exc
                log.warning(
                    "wake_listener_connection_lost", error=str(cause) or type(cause).__name__
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retries.next_delay()):
                    await self._recycle.wait()

    async def _listen(self, retries: Retries) -> None:
        """One connection: listen on it until it is lost or stops delivering."""
        try:
            async with listen(
                self._dsn,
                CHANNELS,
                self._notified,
                setup_timeout=LISTEN_SETUP_TIMEOUT,
            ) as lost:
                self.healthy = True
                self.up.set()
                retries.reset()
                log.info("wake_listener_listening")
                # Anything notified while we were not listening is lost: poll everything once,
                # and compare the sockets held here with the database.
                self._on_wake()
                self._on_reconnected()
                await self._watch(lost)
        finally:
            self.healthy = False

    async def _watch(self, lost: asyncio.Event) -> None:
        """Return when the connection is lost or stops delivering our own notifications."""
        while not lost.is_set():
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._selfcheck_interval):
                    await lost.wait()
            if lost.is_set():
                return
            if not await self._selfcheck():
                self._on_selfcheck_failure()
                log.warning("wake_selfcheck_missed_reconnecting")
                return

    async def _selfcheck(self) -> bool:
        nonce = secrets.token_hex(8)
        arrived: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._nonces[nonce] = arrived
        try:
            async with asyncio.timeout(self._selfcheck_timeout):
                async with self._db.connection("wake self-check") as conn:
                    await conn.execute("SELECT pg_notify($1, $2)", SELFCHECK_CHANNEL, nonce)
                await arrived
            return True
        except (TimeoutError, StoreError):
            return False
        finally:
            del self._nonces[nonce]
