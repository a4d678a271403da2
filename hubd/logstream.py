"""The stream log lines go to: what one event-loop iteration logs leaves in one write.

Written straight through, each JSON line cost two ``write`` system calls (``print`` sends the
line and its newline apart), and each woke whatever reads the daemon's standard error
(journald, a supervisor's pipe). A lifecycle logs three lines per allocation (connected,
disconnected, released), so that was six system calls and six wake-ups of the reader per
allocation, more than all of its sends to PostgreSQL and to the sidecar together (4.5). Claims and
handshakes finish in batches, so the lines of one loop iteration are many: they now leave in
one write at the end of that iteration.

What may be lost: a process killed with SIGKILL loses the lines of the iteration it was in;
everything else (a normal exit, an exception that ends the process, a line logged outside the
event loop or by another thread) is written out, in order. Lines pile up to at most
:data:`LIMIT` characters before they are written whatever the loop is doing.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Final, TextIO

__all__ = ["LIMIT", "CoalescingStream", "LineLogger"]

LIMIT: Final = 64 * 1024
"""Characters held back at most; more are written at once."""


class CoalescingStream:
    """A text stream for loggers: ``flush`` inside a running event loop defers the write to
    the end of the loop's current iteration; outside one it writes at once."""

    def __init__(self, target: TextIO, *, limit: int = LIMIT) -> None:
        self._target = target
        self._limit = limit
        self._pending: list[str] = []
        self._size = 0
        # Lines may come from several threads (asyncio.to_thread, the standard library's
        # loggers); one lock keeps their order and the buffer whole.
        self._lock = threading.Lock()
        self._scheduled: asyncio.AbstractEventLoop | None = None
        atexit.register(self.write_out)

    def write(self, text: str) -> int:
        with self._lock:
            self._pending.append(text)
            self._size += len(text)
        return len(text)

    def write_line(self, line: str) -> None:
        """``line`` and its newline, as :meth:`write` then :meth:`flush` would: what
        :class:`LineLogger` calls, once per line, under one acquisition of the lock."""
        self._hold(line + "\n")

    def flush(self) -> None:
        """What loggers call after each line: the write is deferred to the end of the loop's
        iteration when there is one, and done now otherwise."""
        self._hold("")

    def _hold(self, text: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            if text:
                self._pending.append(text)
                self._size += len(text)
            if loop is not None and self._size < self._limit:
                if self._scheduled is not loop and self._pending:
                    self._scheduled = loop
                    # After the callbacks already due in this iteration, whose lines it takes.
                    loop.call_soon(self.write_out)
                return
        self.write_out()

    def write_out(self) -> None:
        """Write every line held back, in one call, and flush the target."""
        with self._lock:
            self._scheduled = None
            if not self._pending:
                return
            text = "".join(self._pending)
            self._pending.clear()
            self._size = 0
            try:
                self._target.write(text)
                self._target.flush()
            except (OSError, ValueError):
                # The reader went away (a closed pipe) or the stream was closed at exit:
                # there is nowhere left to say so.
                return


class LineLogger:
    """structlog's logger for hubd: a rendered line goes to the stream in one call (structlog's
    own ``PrintLogger`` prints, a line and its newline apart, under a lock of its own)."""

    def __init__(self, stream: CoalescingStream) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        self._stream.write_line(message)

    debug = info = warning = warn = error = err = critical = exception = failure = fatal = log = msg
