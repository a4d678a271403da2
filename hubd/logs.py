"""structlog set-up: JSON lines in production, console in development, secrets redacted.

The redaction processor sees every field a caller passed or bound before rendering, so nothing
(a token by mistake, an ``Authorization`` header, a DSN with its password, a record whose repr
holds one) reaches the output; only the level and the time are added after it. Records of
the standard library's loggers (asyncio's accept errors and "exception never retrieved",
asyncpg, websockets) go through the same processors and renderer, and through a sampling
filter: a flood of one message is a few lines with a count, never a line per event. asyncpg's
pool, which logs a traceback for every reconnect it fails during an outage, says each in one
line instead (:class:`QuietReconnects`).

When standard error is the journal (systemd sets ``JOURNAL_STREAM`` to its device and inode),
every line starts with its syslog priority, ``<3>`` for an error, which journald reads
(``SyslogLevelPrefix=``, on by default) and strips: ``journalctl -p warning`` shows warnings
and errors only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, Final, TextIO, cast

import structlog

from hubd.logstream import CoalescingStream, LineLogger
from hubd.redaction import REDACTED, scrub

__all__ = [
    "QuietReconnects",
    "Sampler",
    "configure_logging",
    "flush_logs",
    "journal_prefix",
    "redact_event",
    "render_json",
    "stderr_is_journal",
]

_SECRET_KEYS: Final = frozenset({"token", "authorization", "password", "hubd_token", "secret"})
_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


# Whether a field name is a secret's, by name as given: the names are few (the code's own and
# the standard library's record attributes), and lower-casing each on every line added up.
_SECRET_NAMES: dict[str, bool] = {}


def _secret_name(key: str) -> bool:
    secret = _SECRET_NAMES.get(key)
    if secret is None:
        secret = key.lower() in _SECRET_KEYS
        if len(_SECRET_NAMES) < 4096:
            _SECRET_NAMES[key] = secret
    return secret


def _redact_value(key: str, value: Any) -> Any:
    return REDACTED if _secret_name(key) else _redact_plain(key, value)


def _redact_plain(key: str, value: Any) -> Any:
    """``value`` of a field whose name is no secret's."""
    # Exact types first: most values are plain strings and numbers.
    kind = type(value)
    if kind is str:
        return scrub(value)
    if kind is int or kind is bool or kind is float or value is None:
        return value
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, Mapping):
        return {str(k): _redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(key, item) for item in value]
    if isinstance(value, BaseException):
        return scrub(f"{type(value).__name__}: {value}")
    if isinstance(value, int | float):
        # Rendered as a number whatever the subclass (an IntEnum close code, say).
        return value
    # Anything else would be rendered through its repr (an attrs record with a token field,
    # say), so the repr is what is scrubbed.
    return scrub(repr(value))


def redact_event(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: replace secret-named fields and token-shaped text."""
    redacted: dict[str, Any] = {}
    for key, value in event_dict.items():
        # The common fields (ids, numbers) without a call each; the rest as _redact_value says.
        kind = type(value)
        if _secret_name(key):
            redacted[key] = REDACTED
        elif kind is str:
            redacted[key] = scrub(value)
        elif kind is int or kind is bool or value is None:
            redacted[key] = value
        else:
            redacted[key] = _redact_plain(key, value)
    return redacted


# One encoder for every line: ``json.dumps`` with an argument builds a new one per call. The
# fallback is only for values redaction passed through unchanged that JSON has no type for.
_ENCODER: Final = json.JSONEncoder(default=repr)


def render_json(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> str:
    """structlog processor: the event as one JSON line."""
    return _ENCODER.encode(event_dict)


# syslog(3) priorities by structlog level name ("exception" is logged as "error").
_PRIORITIES: Final = {
    "debug": 7,
    "info": 6,
    "warning": 4,
    "warn": 4,
    "error": 3,
    "exception": 3,
    "critical": 2,
}


def stderr_is_journal(env: Mapping[str, str] | None = None) -> bool:
    """Whether standard error is connected to journald: ``JOURNAL_STREAM`` names the device
    and inode of that stream, and they are standard error's (a child that inherited the
    variable but writes elsewhere, a pipe or a file, is not)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        status = os.fstat(sys.stderr.fileno())
        return (status.st_dev, status.st_ino) == (int(device), int(inode))
    except (OSError, ValueError, AttributeError):
        return False


def journal_prefix(level: str) -> str:
    """The ``<N>`` syslog priority prefix journald reads at the start of a line."""
    return f"<{_PRIORITIES.get(level, 6)}>"


def _with_priority(renderer: Any) -> Any:
    def render(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> str:
        level = event_dict.get("level", method)
        return journal_prefix(str(level)) + str(renderer(logger, method, event_dict))

    return render


def configure_logging(
    *, fmt: str = "json", level: str = "info", stream: TextIO | None = None
) -> None:
    renderer: Any = structlog.dev.ConsoleRenderer(colors=False) if fmt == "console" else render_json
    if stream is None and stderr_is_journal():
        renderer = _with_priority(renderer)
    flush_logs()
    output = CoalescingStream(stream or sys.stderr)
    _outputs[:] = [output]
    threshold = _LEVELS.get(level, logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.format_exc_info,
            # Redaction sees everything a caller passed, the traceback text included; the
            # level and the time are added after it, as nothing secret can be in them.
            redact_event,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=_shared(LineLogger(output)),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(renderer, output, threshold)
    _quiet_reconnects()


def _shared(logger: LineLogger) -> Any:
    """A logger factory that hands out one logger: it holds nothing but the stream."""
    return lambda *_args: logger


_outputs: Final[list[CoalescingStream]] = []
"""The stream the latest :func:`configure_logging` set up."""


def flush_logs() -> None:
    """Write out the lines held back (before a message printed straight to standard error)."""
    for output in _outputs:
        output.write_out()


def _route_stdlib(renderer: Any, stream: CoalescingStream, level: int) -> None:
    """Send the standard library's records through structlog's processors (redaction
    included) to the same stream; replaces whatever an earlier call installed."""
    handler = logging.StreamHandler(cast(TextIO, stream))
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                redact_event,
                renderer,
            ],
        )
    )
    handler.addFilter(SamplingFilter())
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    # Libraries' chatter stays out below WARNING whatever hubd's own level: websockets logs
    # every handshake header at DEBUG, the Authorization header among them.
    root.setLevel(max(level, logging.WARNING))


_HANDLER_NAME: Final = "hubd"


def _quiet_reconnects() -> None:
    """Install :class:`QuietReconnects` on asyncpg's pool logger, once however often the
    logging is configured."""
    pool = logging.getLogger("asyncpg.pool")
    for old in [f for f in pool.filters if isinstance(f, QuietReconnects)]:
        pool.removeFilter(old)
    pool.addFilter(QuietReconnects())


class QuietReconnects(logging.Filter):
    """asyncpg's pool logs a full traceback each time it fails to restore its connection floor,
    which it does many times during any database restart. An outage is an expected condition,
    reported by hubd's own warnings: keep asyncpg's record, without the traceback, as a warning
    that names the error in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            # Imported here: only the driver's pool logs to this filter, so the driver is loaded
            # already, and a process that never opens a pool (a sidecar) never loads it.
            from hubd.store.driver_errors import READ_ONLY, UNAVAILABLE

            error = record.exc_info[1]
            if isinstance(error, (*UNAVAILABLE, *READ_ONLY)):
                record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
                record.args = ()
                record.exc_info = None
                record.exc_text = None
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class SamplingFilter(logging.Filter):
    """Lets a few records of each (logger, message template) through per window; the count of
    the others rides on the next one let through, as ``suppressed``."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        super().__init__()
        self._sampler = sampler or Sampler()

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.msg}"[:200]
        suppressed = self._sampler.admit(key, time.monotonic())
        if suppressed is None:
            return False
        if suppressed:
            record.msg = f"{record.msg} (and {suppressed} more like it)"
        return True


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
