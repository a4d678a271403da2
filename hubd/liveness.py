"""How long a sidecar that follows the protocol (architecture §4) needs to notice a hub that went
silent and dial again: the bound that the reconnect window after a replica is lost must cover.

A frozen hub (SIGSTOP, a VM paused, a stalled host) keeps its TCP connections open: the kernel
still acknowledges, nothing is closed, and only the sidecar's own keepalive can tell. Its peers
sweep the frozen replica's connection records after ``instance.ttl``; what the sidecars are given
from then on must include this bound, or a healthy sidecar is given up before it can know it
should reconnect.
"""

from __future__ import annotations

from typing import Final

from hubd.backoff import Backoff

__all__ = [
    "FIRST_RECONNECT_CEILING",
    "SIDECAR_PING_INTERVAL",
    "SIDECAR_PING_TIMEOUT",
    "SILENT_HUB_BOUND",
    "swept_reconnect_window",
]

SIDECAR_PING_INTERVAL: Final = 20.0
"""A sidecar pings the hub at least this often (seconds)."""
SIDECAR_PING_TIMEOUT: Final = 20.0
"""A ping not answered within this time means the hub is lost: the sidecar closes and dials."""
FIRST_RECONNECT_CEILING: Final = Backoff().ceiling(0)
"""The longest wait before the first reconnect after a lost connection (full jitter below it)."""

SILENT_HUB_BOUND: Final = SIDECAR_PING_INTERVAL + SIDECAR_PING_TIMEOUT + FIRST_RECONNECT_CEILING
"""From the moment a hub goes silent until its sidecar dials again, at most."""


def swept_reconnect_window(connect_timeout: float) -> float:
    """The seconds a sidecar is given to come back after its replica's records were swept: the
    time to notice the silent hub, then ``connect_timeout`` as after any disconnect."""
    return SILENT_HUB_BOUND + connect_timeout
