"""When the reference sidecar reconnects, and how long it waits: pure functions over values.

The rule of the protocol (architecture §4): a sidecar that was superseded (4000), retired (4001) or
fenced (4002), or refused with 401 / 403 / 409, must never come back — a superseded peer that
reconnects would steal the socket back from its successor, forever. Everything that says "the
hub is away or busy" (1001, 1006, 1011, 503, a refused TCP connection) is retried after a capped
exponential backoff with full jitter, so a hub restart does not bring every sidecar back in the
same instant.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

__all__ = [
    "EXIT_OK",
    "EXIT_STOPPED",
    "EXIT_USAGE",
    "Action",
    "Decision",
    "after_close",
    "after_connect_error",
    "after_http_status",
    "parse_retry_after",
]

EXIT_OK: Final = 0
EXIT_STOPPED: Final = 1
"""The hub told the sidecar to go away for good (or refused it): an operator may look."""
EXIT_USAGE: Final = 2


class Action(enum.StrEnum):
    RECONNECT = "reconnect"
    STOP = "stop"


@attrs.frozen
class Decision:
    action: Action
    reason: str
    ordinary: bool = False
    """The hub ended this sidecar on purpose in the normal course (a release, a replacement):
    worth a line in the log, not a warning."""

    @property
    def reconnect(self) -> bool:
        return self.action is Action.RECONNECT


_STOP_CLOSES: Final = {
    4000: "superseded by a newer connection of this sidecar",
    4001: "retired: the allocation was released or failed",
    # A release, like a replacement, starts a new generation, so an ordinary release closes
    # the sidecar with 4002 too: say both, in words that do not read as an error.
    4002: "released or replaced: the hub ended this generation of the allocation",
    4003: "the hub refused a message of this sidecar (protocol error)",
}
_ORDINARY_CLOSES: Final = frozenset({4001, 4002})
_RECONNECT_CLOSES: Final = {
    1001: "hub going away",
    1006: "connection lost",
    1011: "hub internal error",
    1012: "hub restarting",
    1013: "hub busy",
    1014: "bad gateway",
}
_STOP_STATUSES: Final = {
    400: "hub refused the handshake as malformed (400)",
    401: "hub refused the credentials (401)",
    403: "hub refused the origin (403)",
    404: "no sidecar endpoint at HUBD_URL (404)",
    409: "hub says this sidecar was replaced or its allocation is finished (409)",
}


def after_close(code: int | None) -> Decision:
    """After an established connection closed with ``code`` (``None``: no close frame)."""
    if code is None:
        code = 1006
    if code in _STOP_CLOSES:
        return Decision(
            Action.STOP,
            f"closed {code}: {_STOP_CLOSES[code]}",
            ordinary=code in _ORDINARY_CLOSES,
        )
    if 4000 <= code <= 4999:
        # An application code this sidecar does not know: a newer hub asking for something.
        # Coming back could be exactly what it forbids, so stop and let an operator look.
        return Decision(Action.STOP, f"closed {code}: unknown application close code")
    reason = _RECONNECT_CLOSES.get(code, "closed by the hub")
    return Decision(Action.RECONNECT, f"closed {code}: {reason}")


def after_http_status(status: int) -> Decision:
    """After the hub answered the handshake with ``status`` instead of upgrading."""
    if status in _STOP_STATUSES:
        return Decision(Action.STOP, _STOP_STATUSES[status])
    if status in (408, 429) or 500 <= status <= 599:
        return Decision(Action.RECONNECT, f"hub unavailable ({status})")
    # Any other answer will not change by asking again.
    return Decision(Action.STOP, f"hub refused the handshake ({status})")


def after_connect_error(error: BaseException) -> Decision:
    """After the connection could not be opened at all (refused, reset, timed out, DNS)."""
    if isinstance(error, ConnectionRefusedError):
        return Decision(Action.RECONNECT, "connection refused")
    if isinstance(error, TimeoutError):
        return Decision(Action.RECONNECT, "connection timed out")
    return Decision(Action.RECONNECT, f"cannot connect ({type(error).__name__})")


def parse_retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` in seconds; the HTTP-date form and garbage count as absent."""
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or len(text) > 6:
        return None
    return float(text)
