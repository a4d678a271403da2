"""``sidecar_output`` for the ``container`` provisioner: what a sidecar's container wrote, read
from the engine's logs call as it comes, in bounded pieces.

The container is the one ``ensure`` recorded (its id, from ``external_ref``), else the one by
the sidecar's name, and only when its labels say it is this deployment's container for that
sidecar (:func:`~hubd.plugins.container.spec.is_ours`), as for ``destroy``. Without a terminal
(every sidecar's container: ``Tty`` is false) both engines send stdout and stderr as frames of
an 8-byte header (the stream, then the length, big-endian, in its last four bytes) and the
bytes; with one, the bytes alone. Each line is scrubbed of the sidecar's token and of anything
token-shaped before it leaves; a line longer than MAX_LINE is passed on in pieces.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Final

from hubd.plugins.container.engine import EngineSession, EngineStream, EngineUnavailable
from hubd.plugins.container.removal import recorded_id
from hubd.plugins.container.spec import container_name, is_ours, token_of
from hubd.redaction import REDACTED, scrub

__all__ = ["MAX_LINE", "Lines", "container_output", "find_container"]

MAX_LINE: Final = 64 * 1024
"""Characters of a line held back waiting for its end; a longer one is passed on in pieces."""
_READ: Final = 64 * 1024
_HEADER: Final = 8
_MIN_SECRET: Final = 8


class Lines:
    """Text cut into whole lines, each scrubbed: ``feed`` what was read, ``end`` at the end."""

    def __init__(self, secret: str | None) -> None:
        self._secret = secret if secret and len(secret) >= _MIN_SECRET else None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def _scrubbed(self, text: str) -> str:
        if self._secret is not None:
            text = text.replace(self._secret, REDACTED)
        return "".join(scrub(line) for line in text.splitlines(keepends=True))

    def feed(self, data: bytes) -> str:
        """The lines ``data`` completes (``""`` when none), scrubbed."""
        text = self._partial + self._decoder.decode(data)
        cut = text.rfind("\n") + 1
        if not cut and len(text) > MAX_LINE:
            cut = len(text)
        self._partial = text[cut:]
        return self._scrubbed(text[:cut])

    def end(self) -> str:
        """What is left without a newline, scrubbed."""
        text, self._partial = self._partial + self._decoder.decode(b"", final=True), ""
        return self._scrubbed(text)


async def find_container(
    engine: EngineSession, deployment: str, sidecar_id: str, external_ref: str | None
) -> Mapping[str, Any] | None:
    """The sidecar's container, inspected: by the id ``external_ref`` records, else by the
    sidecar's name; ``None`` when neither is this deployment's container for that sidecar."""
    for handle in filter(None, (recorded_id(external_ref), container_name(sidecar_id))):
        found = await engine.inspect(handle)
        labels = None if found is None else (found.get("Config") or {}).get("Labels")
        if found is not None and is_ours(labels, deployment, sidecar_id):
            return found
    return None


class _Frames:
    """The bytes of a multiplexed logs answer without their frame headers."""

    def __init__(self, stream: EngineStream, where: str) -> None:
        self._stream = stream
        self._where = where
        self._left = 0

    async def read(self) -> bytes:
        """The next bytes of the next frame's payload (at most _READ); ``b""`` at the end."""
        while not self._left:
            header = await self._stream.exactly(_HEADER)
            if header is None:
                return b""
            self._left = int.from_bytes(header[4:], "big")
        data = await self._stream.chunk(min(self._left, _READ))
        if not data:
            raise EngineUnavailable(f"container engine at {self._where} cut a logs frame short")
        self._left -= len(data)
        return data


async def container_output(
    engine: EngineSession,
    found: Mapping[str, Any],
    *,
    tail: int | None,
    follow: bool,
    read_timeout: float,
) -> AsyncGenerator[str, None]:
    """What the inspected container ``found`` wrote: its last ``tail`` lines (all when
    ``None``), then, with ``follow``, what it writes until it stops. Reads wait at most
    ``read_timeout`` each, except while following."""
    container_id = str(found["Id"])
    params = {
        "stdout": "1",
        "stderr": "1",
        "follow": "1" if follow else "0",
        "tail": "all" if tail is None else str(max(tail, 0)),
    }
    tty = bool((found.get("Config") or {}).get("Tty"))
    lines = Lines(token_of(found))
    async with engine.stream(
        "logs",
        f"containers/{container_id}/logs",
        params,
        read_timeout=None if follow else read_timeout,
    ) as stream:
        frames = _Frames(stream, engine.socket.display)
        while True:
            data = await (stream.chunk(_READ) if tty else frames.read())
            if not data:
                break
            text = lines.feed(data)
            if text:
                yield text
    rest = lines.end()
    if rest:
        yield rest
