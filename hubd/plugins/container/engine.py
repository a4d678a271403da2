"""The container engine's API (dockerd's, or Podman's Docker-compatible one) as the provisioner
uses it: a client per operation, every call bounded in time, every failure translated into one
of three errors whose messages name the socket and carry no secret. Long answers (the events
stream, a container's logs) are read through :class:`EngineStream`, in bounded pieces.

A client per operation, not one for the process: the factory runs before any event loop, a
provisioner has no close hook, and an engine restarted between two calls leaves a pooled
client holding dead connections. Opening a Unix socket costs well under a millisecond.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar

import aiodocker
import aiohttp
from aiohttp.http_exceptions import LineTooLong

from hubd.errors import PluginError
from hubd.plugins.container.options import EngineSocket
from hubd.plugins.protocol import Ownership
from hubd.redaction import REDACTED, scrub

__all__ = [
    "API_VERSION",
    "EngineFailed",
    "EngineSession",
    "EngineStream",
    "EngineTimeout",
    "EngineUnavailable",
    "clean",
    "open_session",
]

API_VERSION: Final = "v1.41"
"""Pinned, not negotiated (a round trip saved per operation): dockerd since 20.10 and Podman's
compatible API since 3.0 speak it."""
_MAX_MESSAGE: Final = 300
_LOG_TAIL_LINES: Final = 5
_LOG_TAIL_CHARS: Final = 600
_MIN_SECRET: Final = 8  # shorter "secrets" (test values) would shred every message
# aiodocker's "could not connect" nests the reason in brackets: "… [… [Connection refused]]".
_REASON: Final = re.compile(r"\[([^\[\]]+)\]+\s*$")
_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
# Podman answers a name conflict with 500 and this text where dockerd answers 409.
_IN_USE: Final = re.compile(r"already in use", re.IGNORECASE)
_NO_IMAGE: Final = re.compile(r"no such image|image not known|not found", re.IGNORECASE)
# Podman answers 500 and this text where dockerd answers 404 for a container removed while the
# call was looking at it (a destroy racing another replica's, or the orphan sweep).
_NO_CONTAINER: Final = re.compile(r"no such container", re.IGNORECASE)

# What makes a container impossible to start as configured, in the words of either engine
# (runc's, relayed by both; dockerd's and Podman's own): a command or entrypoint that is not
# there or not executable, a user or group the image does not know, a network the engine does
# not have, a working directory that is a file. Retrying meets the same answer for ever.
_MISCONFIGURED: Final = re.compile(
    r"executable file not found"
    r'|exec: "[^"]*": (?:stat [^:]*: )?(?:no such file or directory|permission denied)'
    r"|attempted to invoke a command that was not found"
    r"|unable to find (?:user|group) |no matching entries in (?:passwd|group) file"
    r"|network \S+ not found|unable to find network"
    r"|is not a directory",
    re.IGNORECASE,
)

T = TypeVar("T")


class EngineUnavailable(PluginError):
    """The engine's socket refused, is missing, or dropped the connection: retried later."""

    code = "engine_unavailable"


class EngineTimeout(PluginError):
    """The engine did not answer a call within its budget: retried later."""

    code = "engine_timeout"


class EngineFailed(PluginError):
    """The engine answered with an error status (``status`` 0: it answered with something
    that is not its API's, such as an event that is not JSON)."""

    code = "engine_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def conflict(self) -> bool:
        return self.status == 409 or (self.status == 500 and bool(_IN_USE.search(self.message)))

    @property
    def not_found(self) -> bool:
        return self.status == 404 or (
            self.status == 500 and bool(_NO_CONTAINER.search(self.message))
        )

    @property
    def image_missing(self) -> bool:
        return self.status == 404 and bool(_NO_IMAGE.search(self.message))

    @property
    def misconfigured(self) -> bool:
        """Whether the engine says the container cannot run as configured (the command, the
        user, the network, the working directory), whatever status it answered it with:
        dockerd says so with 400, 404 or 500, Podman with 500."""
        return bool(_MISCONFIGURED.search(self.message))


def clean(text: str, secret: str | None = None, *, limit: int = _MAX_MESSAGE) -> str:
    """``text`` as one bounded, printable line with ``secret`` and anything token-shaped
    replaced: engine messages and container logs end up in the ledger."""
    if secret and len(secret) >= _MIN_SECRET:
        text = text.replace(secret, REDACTED)
    text = _CONTROL.sub(" ", text).strip()
    if len(text) > limit:
        text = "…" + text[-(limit - 1) :]
    return scrub(text)


class EngineSession:
    """One operation's client. Every call runs under ``api_timeout`` (plus what the call
    itself waits, such as a stop's grace), capped by the claim's deadline."""

    def __init__(
        self,
        docker: aiodocker.Docker,
        socket: EngineSocket,
        *,
        api_timeout: float,
        ownership: Ownership,
        secret: str | None,
    ) -> None:
        self._docker = docker
        self.socket = socket
        self._api_timeout = api_timeout
        self._ownership = ownership
        self._secret = secret

    async def _call(self, what: str, call: Callable[[], Awaitable[T]], *, waits: float = 0) -> T:
        remaining = self._ownership.deadline() - time.monotonic()
        budget = max(min(self._api_timeout + waits, remaining), 0.0)
        with self._translated(what, f"within {budget:.3g}s"):
            async with asyncio.timeout(budget):
                return await call()

    @contextlib.contextmanager
    def _translated(self, what: str, within: str) -> Iterator[None]:
        """The client's failures as the provisioner's three errors (``within`` says, for a
        timeout, what the budget was)."""
        try:
            yield
        except TimeoutError:
            raise EngineTimeout(
                f"container engine at {self.socket.display} did not answer {what} {within}"
            ) from None
        except aiodocker.DockerError as exc:
            if exc.status == 900:  # aiodocker's code for "could not connect"
                reason = _REASON.search(str(exc.message))
                raise EngineUnavailable(
                    f"container engine at {self.socket.display} ({self.socket.found_by}) is "
                    f"unreachable: "
                    + clean(reason[1] if reason else str(exc.message), self._secret)
                ) from None
            raise EngineFailed(exc.status, clean(str(exc.message), self._secret)) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(
                f"container engine at {self.socket.display} failed during {what}: "
                f"{type(exc).__name__}: {clean(str(exc), self._secret)}"
            ) from None

    async def inspect(self, name: str) -> dict[str, Any] | None:
        """The container's inspect document, or ``None`` if there is no such container.
        ``name`` may be an id or an id's unique prefix, as for every call here that takes one."""
        container = self._docker.containers.container(name)
        try:
            return await self._call("inspect", container.show)
        except EngineFailed as exc:
            if exc.not_found:
                return None
            raise

    async def create(self, body: Mapping[str, Any], name: str) -> str:
        """The new container's id. The body holds the token: it never reaches a message."""
        created = await self._call(
            "create", lambda: self._docker.containers.create(dict(body), name=name)
        )
        return str(created.id)

    async def start(self, name: str) -> None:
        await self._call("start", self._docker.containers.container(name).start)

    async def stop(self, name: str, grace: float) -> None:
        """SIGTERM (the image's stop signal), SIGKILL after ``grace``: the engine does both."""
        seconds = max(round(grace), 0)
        container = self._docker.containers.container(name)
        try:
            await self._call("stop", lambda: container.stop(t=seconds), waits=seconds)
        except EngineFailed as exc:
            # 304 (already stopped) is not an error to aiodocker; 404 is "already gone".
            if not exc.not_found:
                raise

    async def remove(self, name: str) -> bool:
        """Remove the container, killing it first if it still runs; ``False`` if it was
        already gone."""
        container = self._docker.containers.container(name)
        try:
            await self._call("remove", lambda: container.delete(force=True, v=True))
        except EngineFailed as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def logs_tail(
        self,
        name: str,
        *,
        lines: int = _LOG_TAIL_LINES,
        limit: int = _LOG_TAIL_CHARS,
        secret: str | None = None,
    ) -> str:
        """The last ``lines`` lines the container wrote, joined and cleaned for a message (at
        most ``limit`` characters, their end; ``secret`` hidden, besides the session's own);
        empty if unreadable."""
        container = self._docker.containers.container(name)
        try:
            written: Sequence[str] = await self._call(
                "logs",
                lambda: container.log(stdout=True, stderr=True, tail=lines),
            )
        except PluginError:
            return ""
        text = " | ".join(line.strip() for line in written if line.strip())
        if secret and len(secret) >= _MIN_SECRET:
            text = text.replace(secret, REDACTED)
        return clean(text, self._secret, limit=limit)

    async def pull(self, image: str) -> None:
        await self._call("pull", lambda: self._docker.images.pull(image))

    async def list_labelled(self, label: str, value: str) -> list[dict[str, Any]]:
        """Every container (running or not) labelled ``label=value``."""
        listed = await self._call(
            "list",
            lambda: self._docker.containers.list(all=True, filters={"label": [f"{label}={value}"]}),
        )
        return [
            {"Id": container.id, "Labels": container["Labels"] or {}, "State": container["State"]}
            for container in listed
        ]

    async def version(self) -> dict[str, Any]:
        """``GET /version``: what the engine is (its ``Components`` name Podman or Docker)."""
        answer: dict[str, Any] = await self._call("version", self._docker.version)
        return answer

    async def info(self) -> dict[str, Any]:
        """``GET /info``: the engine's host (``NCPU``), runtimes and default log driver."""
        answer = await self._call("info", self._docker.system.info)
        return dict(answer)

    async def image_present(self, image: str) -> bool:
        """Whether the engine has ``image`` (``GET /images/{name}/json``)."""
        try:
            await self._call("image inspect", lambda: self._docker.images.inspect(image))
        except EngineFailed as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def network_present(self, name: str) -> bool:
        """Whether the engine has a network of that name or id."""
        try:
            await self._call("network inspect", lambda: self._docker.networks.get(name))
        except EngineFailed as exc:
            if exc.status == 404 or (exc.status == 500 and "not found" in exc.message):
                return False
            raise
        return True

    @contextlib.asynccontextmanager
    async def stream(
        self, what: str, path: str, params: Mapping[str, str], *, read_timeout: float | None
    ) -> AsyncIterator[EngineStream]:
        """``GET path`` whose answer is read as it comes: the answer's start is awaited within
        ``api_timeout``, each later read within ``read_timeout`` (``None``: as long as it
        takes, for a stream that waits on events). The response is closed on exit, however
        the reader stops.

        aiodocker's request call, not its helpers: its events helper pumps into an unbounded
        queue from a task of its own and takes a dropped connection for a clean end, and its
        logs helper reads everything into one list."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._api_timeout, sock_read=read_timeout
        )
        response = await self._call(
            what,
            lambda: self._docker._do_query(path, "GET", params=dict(params), timeout=timeout),
        )
        try:
            yield EngineStream(self, what, response.content)
        finally:
            # close(), not release(): the rest of an endless answer is never read.
            response.close()


class EngineStream:
    """A long answer of the engine, read in bounded pieces; every failure is one of the
    provisioner's three errors."""

    def __init__(self, session: EngineSession, what: str, content: aiohttp.StreamReader) -> None:
        self._session = session
        self._what = what
        self._content = content

    def _translated(self) -> contextlib.AbstractContextManager[None]:
        # The session's translation: one place says what each client failure means.
        return self._session._translated(self._what, "in time")

    async def line(self, limit: int) -> bytes:
        """The next line, its newline included; what is left without one at the end; ``b""``
        at the end. :class:`EngineFailed` for a line longer than ``limit`` bytes."""
        with self._translated():
            try:
                return await self._content.readuntil(b"\n", max_size=limit)
            except LineTooLong:
                raise EngineFailed(
                    0,
                    f"container engine at {self._session.socket.display} sent a line of more "
                    f"than {limit} bytes in {self._what}",
                ) from None

    async def chunk(self, size: int) -> bytes:
        """Up to ``size`` bytes, as soon as there are any; ``b""`` at the end."""
        with self._translated():
            return await self._content.read(size)

    async def exactly(self, size: int) -> bytes | None:
        """Exactly ``size`` bytes; ``None`` at the end; :class:`EngineUnavailable` when the
        answer ends within them."""
        with self._translated():
            try:
                return await self._content.readexactly(size)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    return None
                raise EngineUnavailable(
                    f"container engine at {self._session.socket.display} cut {self._what} short"
                ) from None


@contextlib.asynccontextmanager
async def open_session(
    socket: EngineSocket,
    *,
    api_timeout: float,
    ownership: Ownership | None = None,
    secret: str | None = None,
) -> AsyncIterator[EngineSession]:
    docker = aiodocker.Docker(url=socket.url, api_version=API_VERSION)
    try:
        yield EngineSession(
            docker,
            socket,
            api_timeout=api_timeout,
            ownership=ownership or Ownership.unbounded(),
            secret=secret,
        )
    finally:
        # Shielded: a cancelled operation must still close its connections, or aiohttp
        # warns about an unclosed session when the object is collected.
        await asyncio.shield(docker.close())
