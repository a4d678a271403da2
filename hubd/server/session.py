"""An open sidecar socket's session, websockets' connection handler: the welcome, then the
sidecar's messages one at a time (architecture §4), within the socket's message budget.

A ``heartbeat`` is counted, a ``welcome_ack`` retires the credential that opened the socket, a
``publish``, a ``ready`` or a ``not_ready`` is written through the router, fenced on the
socket's record, and an ``activity`` restarts the allocation's idle clock; a malformed or early
one closes the socket with 4003, a peer over its budget is closed with 1008. Anything else is
ignored and counted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any, Final

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from hubd.logs import Sampler
from hubd.published import MAX_METADATA_BYTES
from hubd.redaction import describe_error, scrub
from hubd.server.connection import SidecarConnection, drain
from hubd.server.handshake import CloseCode
from hubd.server.keepalive import Keepalive
from hubd.server.limits import TokenBucket
from hubd.server.messages import ProtocolError, parse_publish, parse_ready
from hubd.server.router import SocketRouter
from hubd.server.sockets import SocketEntry
from hubd.server.wire import ServerStats
from hubd.store.connection_values import Handover, PublishOutcome, Served

__all__ = ["SessionHandler", "welcome_message"]

# The hub's answers to a publish, a ready and a not_ready that landed.
_PUBLISHED: Final = json.dumps({"type": "published"})
_READY: Final = json.dumps({"type": "ready_recorded"})
_NOT_READY: Final = json.dumps({"type": "not_ready_recorded"})
_SESSION: Final = json.dumps({"type": "session_recorded"})
# Whether the activity restarted an idle clock (one runs) or not (none does).
_ACTIVITY: Final = {
    True: json.dumps({"type": "activity_recorded", "counted": True}),
    False: json.dumps({"type": "activity_recorded", "counted": False}),
}
_ACKNOWLEDGED: Final[dict[str, Any]] = {"type": "welcome_ack"}


class SessionHandler:
    """The listener's connection handler: one call per admitted socket, for as long as it
    is open."""

    def __init__(
        self,
        *,
        router: SocketRouter,
        keepalive: Keepalive | None,
        stats: ServerStats,
        sampler: Sampler,
        heartbeat_interval: float,
        message_rate: float,
        message_burst: int,
    ) -> None:
        self._router = router
        self._keepalive = keepalive
        self._stats = stats
        self._sampler = sampler
        self._heartbeat_interval = heartbeat_interval
        self._message_rate = message_rate
        self._message_burst = message_burst

    async def handle(self, connection: ServerConnection) -> None:
        assert isinstance(connection, SidecarConnection)
        entry, secret = connection.hubd_entry, connection.hubd_secret
        served = connection.hubd_served
        connection.hubd_entry = connection.hubd_secret = connection.hubd_served = None
        # The request's headers hold the raw token; nothing after the admission needs them.
        connection.forget_handshake()
        if entry is None:  # pragma: no cover -- process_request always sets it
            await connection.close(int(CloseCode.INTERNAL_ERROR), CloseCode.INTERNAL_ERROR.reason)
            return
        self._router.upgraded(entry)
        if self._keepalive is not None:
            self._keepalive.add(connection)
        loop = asyncio.get_running_loop()
        # From the upgrade on, control frames spend it too (see SidecarConnection).
        connection.budget = TokenBucket(self._message_rate, self._message_burst, loop.time())
        connection.on_violation = functools.partial(self._violation, entry)
        welcome = welcome_message(entry, served, self._heartbeat_interval, secret)
        try:
            if await self._router.open(entry, welcome=welcome):
                self._stats.accepted += 1
                owed = None
                if served is not None and served.handover_pending:
                    owed = Handover(
                        target=entry.target, tenant=served.tenant, session=served.session
                    )
                if secret is None:
                    # v1 sends no acknowledgement: its welcome is all it gets.
                    self._acknowledged(entry, owed)
                await self._read(connection, entry, acknowledged=secret is None, owed=owed)
            else:
                # The router is closing it (or the peer left): let the close frame it chose go
                # out before websockets closes the socket with 1000 on our return.
                await drain(connection)
        finally:
            # The callback holds the entry, which holds the connection: a cycle left to the
            # collector for every socket that ever opened.
            connection.on_violation = None
            await self._router.unregister(entry)

    async def _read(
        self,
        connection: SidecarConnection,
        entry: SocketEntry,
        *,
        acknowledged: bool,
        owed: Handover | None,
    ) -> None:
        """Act on the socket's messages one at a time, in order: a publish is stored (or
        refused) before the message after it is read, so a ``ready`` after a ``publish`` finds
        the publish written, and a sidecar that writes faster than the database is slowed to
        it (its messages wait in websockets' bounded queue)."""
        loop = asyncio.get_running_loop()
        budget = connection.budget
        assert budget is not None
        try:
            async for message in connection:
                if entry.closed_by_hub is not None:
                    # Closing: keep reading (see drain) but act on nothing more.
                    continue
                if not budget.take(loop.time()):
                    connection.on_violation = None
                    self._violation(entry, "message rate exceeded")
                    continue
                data = self._dispatch(entry, message, acknowledged=acknowledged)
                if data is _ACKNOWLEDGED:
                    acknowledged = True
                    self._acknowledged(entry, owed)
                elif data is not None:
                    await self._act(entry, data, acknowledged=acknowledged)
        except ConnectionClosed:
            pass

    def _acknowledged(self, entry: SocketEntry, owed: Handover | None) -> None:
        """The welcome is acknowledged: the hub may send more, first the hand-over the
        admission found owed (a pool member taken since its sidecar last acknowledged one)."""
        entry.acknowledged = True
        if owed is not None:
            self._router.handover.owed(entry, owed)

    async def _act(self, entry: SocketEntry, data: dict[str, Any], *, acknowledged: bool) -> None:
        """A ``publish``, a ``ready``, a ``not_ready`` or an ``activity``: refused with 4003
        when malformed or early, else written, fenced on the socket's record (architecture §4,
        *Publish and ready*, *Activity*)."""
        if data["type"] == "session_ack":
            if not acknowledged:
                self._protocol_error(entry, ProtocolError("session_ack before welcome_ack"))
                return
            if await self._router.handover.acknowledge(entry):
                await self._answer(entry, _SESSION)
        elif data["type"] == "activity":
            if not acknowledged:
                self._protocol_error(entry, ProtocolError("activity before welcome_ack"))
                return
            counted = await self._router.activity.record(entry)
            if counted is not None:
                self._stats.activity += 1
                await self._answer(entry, _ACTIVITY[counted])
        elif data["type"] == "publish":
            publish = parse_publish(data, acknowledged=acknowledged)
            if isinstance(publish, ProtocolError):
                self._protocol_error(entry, publish)
                return
            outcome = await self._router.publish(entry, publish)
            if outcome is PublishOutcome.TOO_LARGE:
                too_large = f"publish: merged metadata is larger than {MAX_METADATA_BYTES} bytes"
                self._protocol_error(entry, ProtocolError(too_large))
            elif outcome is PublishOutcome.PUBLISHED:
                self._stats.published += 1
                await self._answer(entry, _PUBLISHED)
        else:
            ready = parse_ready(acknowledged=acknowledged, serving=data["type"] == "ready")
            if isinstance(ready, ProtocolError):
                self._protocol_error(entry, ready)
                return
            if not await self._router.declare_ready(entry, serving=ready.serving):
                return
            if ready.serving:
                self._stats.declared_ready += 1
            else:
                self._stats.declared_not_ready += 1
            await self._answer(entry, _READY if ready.serving else _NOT_READY)

    async def _answer(self, entry: SocketEntry, answer: str) -> None:
        if entry.closed_by_hub is not None:
            return
        try:
            await entry.ws.send(answer)
        except Exception as exc:  # noqa: BLE001 -- a peer that vanished is not an error
            entry.log.info("answer_not_sent", error=describe_error(exc))

    def _protocol_error(self, entry: SocketEntry, error: ProtocolError) -> None:
        """A message the hub refuses: the socket is closed with 4003, nothing written."""
        self._stats.protocol_errors += 1
        if self._sampler.admit("protocol-error", time.monotonic()) is not None:
            entry.log.warning("sidecar_protocol_error", reason=scrub(error.reason))
        self._router.close_socket(entry, CloseCode.PROTOCOL_ERROR, error.reason)

    def _violation(self, entry: SocketEntry, why: str) -> None:
        """The peer broke its budget: closed with 1008. A peer that does not read the close
        frame is aborted by the write-stall bound instead of holding the socket."""
        if entry.closed_by_hub is not None:
            return
        if self._sampler.admit(f"policy-{why}", time.monotonic()) is not None:
            entry.log.warning("sidecar_policy_violation", reason=why)
        self._router.close_socket(entry, CloseCode.POLICY)

    def _dispatch(
        self, entry: SocketEntry, message: str | bytes, *, acknowledged: bool
    ) -> dict[str, Any] | None:
        """Act on a message that needs no database, or hand back the one that does (a
        ``publish``, a ``ready``, a ``not_ready``); ``_ACKNOWLEDGED`` for the welcome's
        acknowledgement."""
        if isinstance(message, bytes):
            self._ignore(entry, "binary")
            return None
        try:
            data = json.loads(message)
        except (ValueError, RecursionError):
            # RecursionError: 64 KiB of "[" is valid-looking JSON nested too deep to parse.
            self._ignore(entry, "not_json")
            return None
        kind = data.get("type") if isinstance(data, dict) else None
        if not isinstance(kind, str):
            self._ignore(entry, "no_type")
        elif kind == "heartbeat":
            self._stats.heartbeats += 1
        elif kind == "welcome_ack" and not acknowledged:
            self._router.acknowledge(entry)
            return _ACKNOWLEDGED
        elif kind in ("publish", "ready", "not_ready", "activity", "session_ack"):
            result: dict[str, Any] = data
            return result
        else:
            self._ignore(entry, "unknown_type")
        return None

    def _ignore(self, entry: SocketEntry, kind: str) -> None:
        self._stats.ignored_messages += 1
        self._stats.ignored_by_kind[kind] += 1
        entry.log.debug("sidecar_message_ignored", kind=kind)


def welcome_message(
    entry: SocketEntry, served: Served | None, heartbeat_interval: float, secret: str | None
) -> str:
    """The welcome of an admitted socket (architecture §4): its identity, what its sidecar
    serves, and on v2 its reconnect secret. Every field is sent to v1 and v2 alike: a sidecar
    ignores the fields it does not know."""
    served = served or Served()
    welcome: dict[str, Any] = {
        "type": "welcome",
        "allocation_id": entry.target.allocation_id,
        "sidecar_id": entry.sidecar_id,
        "generation": entry.target.generation,
        "heartbeat_interval_s": heartbeat_interval,
        "spec": served.spec,
        "tenant": served.tenant,
        "session": served.session,
        "ready_when": served.ready_when,
    }
    if secret is not None:
        welcome["reconnect_secret"] = secret
    return json.dumps(welcome)
