"""The reference sidecar's connection: dial the hub, hold the connection, reconnect with jitter,
stop when told.

It dials as its :class:`~hubd.sidecar.settings.SidecarSettings` say. The token travels only in
the ``Authorization`` header of the handshake; it is never logged, printed or put in an
exception.

After each welcome it tells the hub what it publishes and, where the allocation is ready once
its sidecar says so, whether it can serve; what changes while it is connected (a run-time
:meth:`SidecarClient.publish`, a :meth:`SidecarClient.set_ready`) is told at once, and all of it
again after every reconnect (:mod:`hubd.sidecar.announcements`).

Protocol v2: each welcome carries a reconnect secret, kept in memory only, presented in the
next handshake and acknowledged at once. Once the sidecar has connected, the token in its
environment no longer opens a connection by itself, so another process that reads it cannot
take this sidecar's place. A sidecar restarted from its environment has lost its secret: it is
refused (401) and stops, and the hub replaces it when its connect deadline passes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import secrets
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import attrs
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.typing import Subprotocol

from hubd.backoff import Backoff
from hubd.liveness import SIDECAR_PING_INTERVAL, SIDECAR_PING_TIMEOUT
from hubd.sidecar.announcements import Announcements, Publication, Told
from hubd.sidecar.policy import (
    EXIT_OK,
    EXIT_STOPPED,
    Action,
    Decision,
    after_close,
    after_connect_error,
    after_http_status,
    parse_retry_after,
)
from hubd.sidecar.settings import SidecarSettings
from hubd.sidecar.welcome import Welcome, handed_over, parse_welcome

__all__ = [
    "ACTIVITY_SPACING",
    "SUBPROTOCOL",
    "Publication",
    "SessionHandler",
    "SidecarClient",
    "SidecarExit",
    "WelcomeHandler",
]

log = structlog.get_logger(__name__)

# The protocol's constants, repeated rather than imported: the sidecar is a client program and
# must not pull in the hub's server and store (the tests hold the two equal).
SUBPROTOCOL: Final = "hubd.sidecar.v2"
SECRET_HEADER: Final = "Hubd-Reconnect-Secret"  # noqa: S105 -- a header name
_MAX_MESSAGE_SIZE: Final = 128 * 1024
"""What the sidecar accepts from the hub: a welcome carries a spec of up to 64 KiB."""
ACTIVITY_SPACING: Final = 1.0
"""Seconds between two ``activity`` messages at least: the hub writes about once a second per
allocation anyway."""
_ACTIVITY: Final = json.dumps({"type": "activity"})
_SESSION_ACK: Final = json.dumps({"type": "session_ack"})


class _WireLogger(logging.LoggerAdapter[logging.Logger]):
    """websockets logs every handshake header at DEBUG, ``Authorization`` included; this
    logger lets through warnings and errors only, whatever level is configured."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("hubd.sidecar.wire"), {})

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 -- overrides logging's name
        return level >= logging.WARNING and self.logger.isEnabledFor(level)


@attrs.frozen
class SidecarExit:
    """How :meth:`SidecarClient.run` ended: an exit code and a one-line reason."""

    code: int
    reason: str


SessionHandler = Callable[[Mapping[str, Any]], Awaitable[None]]
"""Called with the context as a hand-over changed it (a pool member was taken: tenant and
session are new), before the sidecar acknowledges it to the hub (architecture §4)."""

WelcomeHandler = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
"""Called after each welcome is acknowledged with its context (allocation_id, sidecar_id,
generation, spec, tenant, session, ready_when); returns metadata to publish with it. The
sidecar says whether it can serve (where the welcome's ready_when is ``declared``; see
``ready``) once it returns."""


@attrs.frozen
class _Ended:
    decision: Decision
    retry_after: float | None = None
    welcomed: bool = False


class SidecarClient:
    """One sidecar's connection to the hub, kept until the hub or :meth:`stop` ends it."""

    def __init__(
        self,
        settings: SidecarSettings,
        *,
        backoff: Backoff | None = None,
        random: Callable[[], float] | None = None,
        open_timeout: float = 10.0,
        ping_interval: float = SIDECAR_PING_INTERVAL,
        ping_timeout: float = SIDECAR_PING_TIMEOUT,
        close_timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        publication: Publication | None = None,
        on_welcome: WelcomeHandler | None = None,
        on_session: SessionHandler | None = None,
        ready: bool = True,
    ) -> None:
        """``ready``: whether the sidecar can serve from the start (``False``: not until
        :meth:`set_ready` says so)."""
        self._settings = settings
        self._announcements = Announcements(publication, ready=ready)
        self._changed = asyncio.Event()
        # Activity reported and not told yet; when it was last told (the loop's clock).
        self._active = False
        self._active_told = -math.inf
        self._on_welcome = on_welcome
        self._on_session = on_session
        # A hand-over heard and not yet acknowledged: the context it brings.
        self._handed: dict[str, Any] | None = None
        self._backoff = backoff or Backoff()
        self._random = random or secrets.SystemRandom().random
        self._open_timeout = open_timeout
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._close_timeout = close_timeout
        self._ssl = ssl_context
        self._stop = asyncio.Event()
        self._ws: ClientConnection | None = None
        self._closer: asyncio.Task[None] | None = None
        self._log = log.bind(
            allocation_id=settings.allocation_id,
            sidecar_id=settings.sidecar_id,
            generation=settings.generation,
        )
        self.attempts = 0
        """Connection attempts made so far."""
        self.url_index = 0
        """Which of the settings' URLs the next attempt dials."""
        self.welcomes = 0
        """Welcomes received so far (one per successful connection)."""
        self._secret: str | None = None
        """The reconnect secret of the latest welcome: the next handshake's credential."""
        self.connected = False
        self.context: Mapping[str, Any] | None = None
        """What the latest welcome said the sidecar serves (``None``: not welcomed yet)."""
        self.published = 0
        """Publishes the hub answered ``published``."""
        self.declared = 0
        """Declarations of readiness the hub answered."""
        self.withdrawn = 0
        """Declarations that the sidecar can no longer serve (``not_ready``) the hub answered."""
        self.handovers = 0
        """Hand-overs the hub recorded (``session_recorded``)."""
        self.activity_counted: bool | None = None
        """The hub's last answer to an ``activity``: whether it restarted an idle clock
        (``None``: none answered yet)."""
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=32)
        """The latest decisions taken after a connection ended, newest last."""

    @property
    def endpoint(self) -> str | None:
        """The endpoint published now (the run-time one, else the starting one)."""
        return self._announcements.endpoint

    @property
    def ready(self) -> bool:
        """Whether the sidecar says it can serve."""
        return self._announcements.ready

    def publish(
        self, *, endpoint: str | None = None, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """Publish ``endpoint`` and ``metadata`` (merged over what was published, a key given
        ``None`` removed) now and after every welcome from now on. :class:`ValueError` when
        either is malformed, or when all run-time metadata would pass 16 KiB."""
        if self._announcements.publish(endpoint=endpoint, metadata=metadata):
            self._changed.set()

    def set_ready(self, ready: bool) -> None:
        """Whether the sidecar can serve: told to the hub (``ready`` / ``not_ready``) now and
        after every welcome, where the allocation is ready once its sidecar says so."""
        if self._announcements.set_ready(ready):
            self._log.info("sidecar_ready" if ready else "sidecar_not_ready")
            self._changed.set()

    def report_activity(self) -> None:
        """The sidecar is in use: its allocation's idle clock starts again. Reports closer
        together than :data:`ACTIVITY_SPACING` go to the hub as one, at most that late."""
        self._active = True
        self._changed.set()

    def stop(self) -> None:
        """Close the connection with 1000 and make :meth:`run` return ``EXIT_OK``; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        ws = self._ws
        if ws is not None:
            # Closing makes the pending recv() return, which ends the session; run() awaits
            # this task before it returns, so it is never left behind.
            self._closer = asyncio.get_running_loop().create_task(
                ws.close(1000, "sidecar stopping"), name="sidecar-close"
            )

    async def run(self) -> SidecarExit:
        """Connect, and reconnect as the policy says, until told to stop for good."""
        attempt = 0
        try:
            while not self._stop.is_set():
                ended = await self._session()
                self.decisions.append(ended.decision)
                if self._stop.is_set():
                    break
                if ended.decision.action is Action.STOP:
                    say = self._log.info if ended.decision.ordinary else self._log.warning
                    say("sidecar_stopping", reason=ended.decision.reason)
                    return SidecarExit(EXIT_STOPPED, ended.decision.reason)
                if ended.welcomed:
                    attempt = 0
                # Every reconnect goes to the next URL: the replica that just failed or went
                # away is the least likely to answer first. With one URL this changes nothing.
                self.url_index = (self.url_index + 1) % len(self._settings.urls)
                delay = self._backoff.delay(attempt, self._random, floor=ended.retry_after or 0.0)
                attempt += 1
                self._log.info(
                    "sidecar_reconnecting",
                    reason=ended.decision.reason,
                    attempt=attempt,
                    delay_s=round(delay, 3),
                )
                await self._pause(delay)
            return SidecarExit(EXIT_OK, "stopped")
        finally:
            if self._closer is not None:
                await self._closer

    async def _pause(self, delay: float) -> None:
        try:
            async with asyncio.timeout(delay):
                await self._stop.wait()
        except TimeoutError:
            pass

    async def _session(self) -> _Ended:
        """One connection, from dialing to its close, reduced to what happens next."""
        self.attempts += 1
        welcomed = False
        headers = {
            "Authorization": f"Bearer {self._settings.token}",
            "Hubd-Allocation-Id": self._settings.allocation_id,
            "Hubd-Sidecar-Id": self._settings.sidecar_id,
            "Hubd-Generation": str(self._settings.generation),
        }
        if self._secret is not None:
            headers[SECRET_HEADER] = self._secret
        try:
            async with connect(
                self._settings.urls[self.url_index],
                additional_headers=headers,
                subprotocols=[Subprotocol(SUBPROTOCOL)],
                compression=None,
                # Dialed directly: a proxy from the environment would see the bearer token.
                proxy=None,
                open_timeout=self._open_timeout,
                ping_interval=self._ping_interval,
                ping_timeout=self._ping_timeout,
                close_timeout=self._close_timeout,
                max_size=_MAX_MESSAGE_SIZE,
                logger=_WireLogger(),
                ssl=self._ssl,
            ) as ws:
                self._ws = ws
                try:
                    if self._stop.is_set():
                        return _Ended(Decision(Action.STOP, "stopped"))
                    welcome = await self._welcome(ws)
                    if welcome is None:
                        await ws.close(1008, "welcome does not match")
                        mismatch = "the hub's welcome is not for this sidecar"
                        return _Ended(Decision(Action.STOP, mismatch))
                    # Kept before it is acknowledged: once the hub reads the ack, the secret
                    # this handshake presented opens nothing any more.
                    self._secret = welcome.secret
                    await ws.send(json.dumps({"type": "welcome_ack"}))
                    welcomed = True
                    self.welcomes += 1
                    self.connected = True
                    self.context = welcome.context
                    self._log.info("sidecar_welcomed")
                    extra: Mapping[str, Any] = {}
                    if self._on_welcome is not None:
                        extra = await self._on_welcome(welcome.context)
                    await self._hold(ws, welcome, extra)
                finally:
                    self.connected = False
                    self._ws = None
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            return _Ended(after_close(code), welcomed=welcomed)
        except InvalidStatus as exc:
            retry_after = parse_retry_after(exc.response.headers.get("Retry-After"))
            return _Ended(after_http_status(exc.response.status_code), retry_after=retry_after)
        except InvalidURI:
            return _Ended(Decision(Action.STOP, "HUBD_URL is not a valid websocket URL"))
        except (InvalidHandshake, OSError, TimeoutError) as exc:
            return _Ended(after_connect_error(exc))
        # _hold only returns once the connection closed without an exception reaching here.
        return _Ended(after_close(None), welcomed=welcomed)

    async def _welcome(self, ws: ClientConnection) -> Welcome | None:
        """The hub's welcome; ``None`` if it is not for us."""
        async with asyncio.timeout(self._open_timeout):
            message = await ws.recv()
        return parse_welcome(message, self._settings)

    async def _hold(self, ws: ClientConnection, welcome: Welcome, extra: Mapping[str, Any]) -> None:
        """Stay connected: tell the hub what it has not been told (first of all the
        publication and, where the allocation waits for the sidecar's word, ``ready`` or
        ``not_ready``), answer pings (websockets does), read the hub's answers, and send a
        heartbeat after every interval in which nothing came or went. This one task sends
        everything, so the messages go out in the order they are due; the two tasks it waits
        on only wait."""
        told = Told()
        declared = welcome.context.get("ready_when") == "declared"
        heartbeat = json.dumps({"type": "heartbeat"})
        loop = asyncio.get_running_loop()
        receiving: asyncio.Task[str | bytes] | None = None
        try:
            while True:
                # Cleared before the look: a change made while the messages go out sets it
                # again, and the wait below returns at once.
                self._changed.clear()
                for due in self._announcements.due(told, declared=declared, extra=extra):
                    await ws.send(due)
                wait = welcome.interval
                if self._active:
                    since = loop.time() - self._active_told
                    if since >= ACTIVITY_SPACING:
                        self._active, self._active_told = False, loop.time()
                        await ws.send(_ACTIVITY)
                    else:
                        wait = min(wait, ACTIVITY_SPACING - since)
                if receiving is None:
                    # Kept across turns: recv() is safe to cancel, but there is no need to.
                    receiving = loop.create_task(ws.recv(), name="sidecar-receive")
                changed = loop.create_task(self._changed.wait(), name="sidecar-changed")
                waiting: set[asyncio.Future[Any]] = {receiving, changed}
                try:
                    done, _ = await asyncio.wait(
                        waiting,
                        timeout=wait,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    changed.cancel()
                if receiving in done:
                    message = receiving.result()  # ConnectionClosed ends the session
                    receiving = None
                    self._answered(message)
                    if self._handed is not None:
                        handed, self._handed = self._handed, None
                        self.context = handed
                        self._log.info("sidecar_session_handed_over")
                        if self._on_session is not None:
                            await self._on_session(handed)
                        await ws.send(_SESSION_ACK)
                elif not done and not self._active:
                    await ws.send(heartbeat)
        finally:
            if receiving is not None and not receiving.cancel() and not receiving.cancelled():
                # It ended already (the connection closed while a message went out): that
                # close is the session's end, which the caller learns from the send.
                receiving.exception()

    def _answered(self, message: str | bytes) -> None:
        """The hub's answer to a publish, a ready, a not_ready or an activity, or a hand-over
        (acknowledged by the caller); anything else is ignored."""
        try:
            data: Any = json.loads(message)
        except ValueError:
            return
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "published":
            self.published += 1
            self._log.info("sidecar_published")
        elif kind == "ready_recorded":
            self.declared += 1
            self._log.info("sidecar_declared_ready")
        elif kind == "not_ready_recorded":
            self.withdrawn += 1
            self._log.info("sidecar_declared_not_ready")
        elif kind == "activity_recorded":
            self.activity_counted = data.get("counted") is True
        elif kind == "session_recorded":
            self.handovers += 1
        elif kind == "session" and self.context is not None:
            self._handed = handed_over(data, self._settings, self.context)
