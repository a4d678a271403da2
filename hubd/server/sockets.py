"""A socket as the router holds it, and the statements a socket's life needs that the router
retries or shares (clearing a record, acknowledging a secret)."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from typing import Any, Protocol

import attrs
import structlog

from hubd.backoff import Retries
from hubd.errors import StoreError
from hubd.redaction import describe_error
from hubd.routing import Target
from hubd.server.batching import Batcher
from hubd.server.handshake import CloseCode
from hubd.store.connection_values import Disconnect, RecordOutcome
from hubd.store.secrets import Acknowledgement

__all__ = [
    "REFUSED_RECORD_CLOSES",
    "SidecarSocket",
    "SocketEntry",
    "acknowledge_secret",
    "clear_record",
    "new_connection_id",
]

log = structlog.get_logger(__name__)

# How a socket whose connection record was refused is closed.
REFUSED_RECORD_CLOSES = {
    RecordOutcome.RETIRED: CloseCode.RETIRED,
    RecordOutcome.FENCED: CloseCode.FENCED,
    # Another handshake with the same credential won the rotation: it holds the new secret.
    RecordOutcome.SUPERSEDED: CloseCode.SUPERSEDED,
}


# A connection id names a socket in records, notifications and logs, and is never a
# credential: a random prefix per process and a counter keep it unique across processes and
# restarts without a call to the system's random source per handshake.
_connection_prefix = secrets.token_hex(8)
_connection_numbers = itertools.count(1)


def _new_connection_prefix() -> None:
    # A forked child would otherwise count on from its parent's prefix and number.
    global _connection_prefix, _connection_numbers  # noqa: PLW0603
    _connection_prefix = secrets.token_hex(8)
    _connection_numbers = itertools.count(1)


os.register_at_fork(after_in_child=_new_connection_prefix)


def new_connection_id() -> str:
    return f"cn_{_connection_prefix}{next(_connection_numbers):016x}"


class SidecarSocket(Protocol):
    """What the router needs of a websocket connection."""

    async def send(self, message: str) -> None:
        """Send one text message. Bounded by the socket itself, never waiting for ever: the
        listener's :class:`~hubd.server.connection.SidecarConnection` aborts a socket whose
        writes stall (its peer stopped reading), and websockets bounds a send that meets a
        closing socket by its close timeout."""

    async def close(self, code: int, reason: str) -> None: ...


@attrs.define(eq=False)
class SocketEntry:
    """One accepted socket, from registration until its handler is done with it."""

    connection_id: str
    target: Target
    sidecar_id: str
    ws: SidecarSocket = attrs.field(repr=False)
    log: Any = attrs.field(repr=False)
    closed_by_hub: CloseCode | None = None
    """Set (before the close frame is sent) when the hub closes the socket, and why."""
    recorded: bool = False
    seq: int | None = None
    """The connection number its record was written with (the higher of two sockets wins)."""
    gone: bool = False
    """Set when its handler is done with it: no record may be written for it again."""
    secret_hash: bytes | None = attrs.field(default=None, repr=False)
    """The digest of the reconnect secret its welcome carried (v2), until acknowledged."""
    seen_seq: int | None = None
    """While its admission runs (its own number not yet known): the highest number of another
    connection's record of its generation announced meanwhile."""
    upgraded: bool = False
    """Set once the websocket is open: until then a close is only marked (closed_by_hub)."""
    abandoned: bool = False
    """Its handshake ended without an open socket after its admission was asked for."""
    acknowledged: bool = False
    """Its welcome was acknowledged (v1: sent): the hub may send it more than the welcome."""


async def clear_record(
    clears: Batcher[Disconnect, bool],
    holder: SocketEntry,
    *,
    budget: float,
    log: Any,
) -> bool | None:
    """Clear ``holder``'s connection record and mark the sidecar lost in the same statement
    (shared with the other sockets that closed meanwhile), retrying a failing database for up
    to ``budget`` seconds. Whether the record was still ``holder``'s; ``None`` when it could
    not be cleared: the record then outlives the socket until its instance stops heartbeating,
    so that is logged as an error.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget
    retries = Retries.doubling(0.05, 2.0)
    closed = Disconnect(holder.target.allocation_id, holder.connection_id)
    while True:
        delay = retries.next_delay()
        try:
            # Each attempt is bounded by the batcher's own timeout.
            return bool(await clears.request(closed))
        except (StoreError, TimeoutError) as exc:
            if loop.time() + delay >= deadline:
                # The message says it all; a traceback would add nothing.
                log.error("connection_record_left_behind", error=describe_error(exc))  # noqa: TRY400
                return None
            log.warning("connection_clear_retry", error=describe_error(exc))
        await asyncio.sleep(delay)


async def acknowledge_secret(
    acknowledgements: Batcher[Acknowledgement, bool], entry: SocketEntry, secret_hash: bytes
) -> None:
    """Acknowledge the secret of ``entry``'s welcome (in the next batched statement); a failure
    is logged, not raised."""
    try:
        await acknowledgements.request(Acknowledgement(entry.target, entry.sidecar_id, secret_hash))
    except (StoreError, TimeoutError) as exc:
        # The previous credential stays valid a while longer; nothing else depends on it.
        entry.log.warning("secret_not_acknowledged", error=describe_error(exc))
