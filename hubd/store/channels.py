"""The NOTIFY channels hubd's statements and triggers announce on, each named once, and what the
payloads of the two the daemon parses say.

The ``.sql`` files spell the channel in SQL; :mod:`tests.test_channels` holds every
``pg_notify('…')`` there to one of these names. The daemon's wake-up listener subscribes to them
by these names.
"""

from __future__ import annotations

from typing import Final

import attrs

from hubd.routing import Target

__all__ = [
    "CHANNELS",
    "CONNECTED_CHANNEL",
    "EVENTS_CHANNEL",
    "SELFCHECK_CHANNEL",
    "SOCKETS_CHANNEL",
    "WAKE_CHANNEL",
    "ConnectedNotice",
    "SocketControl",
    "parse_connected_payload",
    "parse_sockets_payload",
]

WAKE_CHANNEL: Final = "hubd_wake"
"""Something became due (a request, a release, a sidecar connected); payload: the provisioner id
of the allocation, so that PostgreSQL delivers one notification for the many alike of one
transaction (a batch of requests, a batch of connection records)."""

CONNECTED_CHANNEL: Final = "hubd_connected"
"""The NOTIFY channel a connection record announces itself on; payload
``<allocation>:<generation>:<seq>:<connection>``."""

SOCKETS_CHANNEL: Final = "hubd_sockets"
"""The NOTIFY channel on which every move to a newer generation or to a terminal status is
announced (a trigger on ``hubd_allocations``); payload ``<allocation>:<gen>:fence|retire``."""

SELFCHECK_CHANNEL: Final = "hubd_selfcheck"
"""A listener's own probe, sent through the ordinary pool; payload: a nonce."""

CHANNELS: Final = (WAKE_CHANNEL, CONNECTED_CHANNEL, SOCKETS_CHANNEL, SELFCHECK_CHANNEL)
"""Every channel a daemon listens on."""

EVENTS_CHANNEL: Final = "hubd_events"
"""The application's channel (docs/api.md): an event entered the feed; payload: its position
and what it says. Sent by the feed's trigger, heard by applications (``hubd.client``), never by
a daemon."""


@attrs.frozen
class ConnectedNotice:
    """A ``hubd_connected`` notification: connection ``connection_id``'s record of ``target``
    was written with number ``seq``."""

    target: Target
    seq: int
    connection_id: str


@attrs.frozen
class SocketControl:
    """A ``hubd_sockets`` notification: sockets of older generations must go (``fence``), or
    every socket of the allocation (``retire``)."""

    allocation_id: str
    generation: int
    retire: bool


def parse_connected_payload(payload: str) -> ConnectedNotice | None:
    """What a ``hubd_connected`` notification says, or ``None`` if it is malformed."""
    parts = payload.split(":")
    if (
        len(parts) != 4
        or not parts[0]
        or not parts[1].isdigit()
        or not parts[2].isdigit()
        or not parts[3]
    ):
        return None
    generation, seq = int(parts[1]), int(parts[2])
    if generation < 1:
        return None
    return ConnectedNotice(Target(parts[0], generation), seq, parts[3])


def parse_sockets_payload(payload: str) -> SocketControl | None:
    """What a ``hubd_sockets`` notification says, or ``None`` if it is malformed."""
    parts = payload.split(":")
    if (
        len(parts) != 3
        or not parts[0]
        or not parts[1].isdigit()
        or parts[2]
        not in (
            "fence",
            "retire",
        )
    ):
        return None
    generation = int(parts[1])
    if generation < 1:
        return None
    return SocketControl(parts[0], generation, retire=parts[2] == "retire")
