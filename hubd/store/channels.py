"""The NOTIFY channels hubd's statements and triggers announce on, each named once.

The ``.sql`` files spell the channel in SQL; :mod:`tests.test_channels` holds every
``pg_notify('…')`` there to one of these names. The daemon's wake-up listener subscribes to them
by these names. ``CONNECTED_CHANNEL`` and ``SOCKETS_CHANNEL`` are defined beside the payloads
they carry, in :mod:`hubd.store.connections`.
"""

from __future__ import annotations

from typing import Final

from hubd.store.connections import CONNECTED_CHANNEL, SOCKETS_CHANNEL

__all__ = [
    "CHANNELS",
    "CONNECTED_CHANNEL",
    "EVENTS_CHANNEL",
    "SELFCHECK_CHANNEL",
    "SOCKETS_CHANNEL",
    "WAKE_CHANNEL",
]

WAKE_CHANNEL: Final = "hubd_wake"
"""Something became due (a request, a release, a sidecar connected); payload: the provisioner id
of the allocation, so that PostgreSQL delivers one notification for the many alike of one
transaction (a batch of requests, a batch of connection records)."""

SELFCHECK_CHANNEL: Final = "hubd_selfcheck"
"""A listener's own probe, sent through the ordinary pool; payload: a nonce."""

CHANNELS: Final = (WAKE_CHANNEL, CONNECTED_CHANNEL, SOCKETS_CHANNEL, SELFCHECK_CHANNEL)
"""Every channel a daemon listens on."""

EVENTS_CHANNEL: Final = "hubd_events"
"""The application's channel (docs/api.md): an event entered the feed; payload: its position
and what it says. Sent by the feed's trigger, heard by applications (``hubd.client``), never by
a daemon."""
