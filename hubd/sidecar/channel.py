"""What the command run by ``hubd sidecar`` tells it at run time: lines on the descriptor that
``HUBD_PUBLISH_FD`` names.

The command inherits the write end of a pipe; ``hubd sidecar`` reads the other end. Each line is
one JSON object, shaped as the protocol's own messages (architecture §4):

* ``{"type": "publish", "endpoint": "...", "metadata": {...}}``: either field, or both, published
  at once and after every reconnect, over what the options published (metadata merged key by
  key, a key given null removed; the same limits as every publish);
* ``{"type": "ready"}`` and ``{"type": "not_ready"}``: whether the command can serve, acted on
  with ``--ready-check command`` only (another check decides otherwise);
* ``{"type": "activity"}``: the command is in use (it served a request, say): the allocation's
  idle clock starts again. Reports closer together than a second go to the hub as one.

A line that is not one of these, or breaks the limits, is logged and dropped: the hub never sees
it, so a command's mistake cannot make the hub close the sidecar. Lines are read up to 64 KiB;
a line written in one ``write`` of at most 4 KiB (``PIPE_BUF``) never mixes with another
writer's. The descriptor is the command's and its children's: when all of them have closed it,
nothing more is read.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import structlog

from hubd.published import check_endpoint, check_metadata

__all__ = ["PUBLISH_FD_VARIABLE", "PublishChannel", "Said", "parse_line"]

log = structlog.get_logger(__name__)

PUBLISH_FD_VARIABLE: Final = "HUBD_PUBLISH_FD"
MAX_LINE: Final = 64 * 1024


@attrs.frozen(kw_only=True)
class Said:
    """What one line said: a publish (``endpoint`` and ``metadata``, ``None``: unchanged), a
    readiness (``ready``) or activity."""

    endpoint: str | None = None
    metadata: Mapping[str, Any] | None = None
    ready: bool | None = None
    activity: bool = False


def parse_line(line: bytes) -> Said:
    """One line of the descriptor; :class:`ValueError` saying what is wrong with it."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        raise ValueError("not a JSON object") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")  # noqa: TRY004 -- every refusal is a ValueError
    kind = data.get("type")
    if kind in ("ready", "not_ready"):
        return Said(ready=kind == "ready")
    if kind == "activity":
        return Said(activity=True)
    if kind != "publish":
        raise ValueError(f"type {kind!r:.40}: expected publish, ready, not_ready or activity")
    endpoint, metadata = data.get("endpoint"), data.get("metadata")
    if endpoint is None and metadata is None:
        raise ValueError("publish: neither endpoint nor metadata")
    return Said(
        endpoint=None if endpoint is None else check_endpoint(endpoint),
        metadata=None if metadata is None else check_metadata(metadata),
    )


class PublishChannel:
    """The pipe: its write end for the command (:attr:`write_fd`, kept open across its
    ``exec``), its read end read here until every writer has closed it."""

    def __init__(self) -> None:
        # Neither end is inheritable (os.pipe); the command gets the write end by pass_fds.
        self._read_fd, self.write_fd = os.pipe()
        self._write_open = True
        self._reading = False

    def handed_over(self) -> None:
        """The command has the write end: this process's copy goes, so the end of every
        writer is the end of the stream."""
        if self._write_open:
            self._write_open = False
            os.close(self.write_fd)

    async def read(self, on_said: Callable[[Said], None]) -> None:
        """Hand each line's :class:`Said` to ``on_said`` until every writer has closed the
        pipe; a bad line is logged and dropped. Closes the read end when done."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_LINE, loop=loop)
        # The transport owns the file from here: closing it closes the read end.
        self._reading = True
        pipe = os.fdopen(self._read_fd, "rb", buffering=0)
        try:
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe
            )
        except BaseException:
            pipe.close()
            raise
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:
                    # Longer than MAX_LINE: the reader dropped what it held; the rest of the
                    # line reads as a bad line of its own.
                    log.warning("sidecar_command_line_dropped", reason="line too long")
                    continue
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    said = parse_line(line)
                except ValueError as exc:
                    log.warning("sidecar_command_line_dropped", reason=str(exc)[:200])
                    continue
                on_said(said)
        finally:
            transport.close()

    def close(self) -> None:
        """Close what this process still holds of the pipe (the command never started: both
        ends; otherwise :meth:`read` closes its end)."""
        self.handed_over()
        if not self._reading:
            self._reading = True
            os.close(self._read_fd)
