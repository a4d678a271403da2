"""structlog set-up: JSON lines in production, console in development, secrets redacted.

The redaction processor runs last before rendering, so nothing a caller binds (a token by
mistake, an ``Authorization`` header, a DSN with its password) reaches the output.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, Final, TextIO

import structlog

from hubd.redaction import REDACTED, scrub

__all__ = ["Sampler", "configure_logging", "redact_event"]

_SECRET_KEYS: Final = frozenset({"token", "authorization", "password", "hubd_token", "secret"})
_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _redact_value(key: str, value: Any) -> Any:
    if key.lower() in _SECRET_KEYS:
        return REDACTED
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, Mapping):
        return {str(k): _redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(key, item) for item in value]
    if isinstance(value, BaseException):
        return scrub(f"{type(value).__name__}: {value}")
    return value


def redact_event(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: replace secret-named fields and token-shaped text."""
    for key in list(event_dict):
        event_dict[key] = _redact_value(key, event_dict[key])
    return event_dict


def configure_logging(
    *, fmt: str = "json", level: str = "info", stream: TextIO | None = None
) -> None:
    renderer: Any
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


class Sampler:
    """Keeps a flood of one kind of event to a few lines: the first ``burst`` of a key in each
    ``window`` seconds go through, the rest are counted and the count rides on the first line
    of the next window. The clock is passed in.
    """

    def __init__(self, *, burst: int = 5, window: float = 10.0, max_keys: int = 256) -> None:
        self._burst = burst
        self._window = window
        self._max_keys = max_keys
        # key -> [window start, lines let through, events suppressed]
        self._keys: dict[str, list[float]] = {}

    def admit(self, key: str, now: float) -> int | None:
        """``None``: drop this line. Otherwise log it, with this many suppressed before it."""
        state = self._keys.get(key)
        if state is None or now - state[0] >= self._window:
            if state is None and len(self._keys) >= self._max_keys:
                self._forget(now)
            suppressed = int(state[2]) if state is not None else 0
            self._keys[key] = [now, 1, 0]
            return suppressed
        if state[1] < self._burst:
            state[1] += 1
            return 0
        state[2] += 1
        return None

    def _forget(self, now: float) -> None:
        for key in [k for k, s in self._keys.items() if now - s[0] >= self._window]:
            del self._keys[key]
        while len(self._keys) >= self._max_keys:
            del self._keys[next(iter(self._keys))]
