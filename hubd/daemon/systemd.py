"""systemd's notify protocol (sd_notify) without libsystemd: one datagram per state change."""

from __future__ import annotations

import os
import socket

import structlog

__all__ = ["notify", "watchdog_interval"]

log = structlog.get_logger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to ``$NOTIFY_SOCKET``; ``False`` when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify_failed", state=state, error=str(exc))
        return False
    return True


def watchdog_interval() -> float | None:
    """Half the watchdog period systemd asked for (``WATCHDOG_USEC``), or ``None``."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2_000_000, 0.1)
    except ValueError:
        return None
