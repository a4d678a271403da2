"""When ``hubd sidecar`` says it can serve: its readiness check, the rule that turns the check's
outcomes into ready and not ready, and the loop that runs it.

``--ready-check`` names what is checked:

* ``tcp:HOST:PORT``: a TCP connection to HOST:PORT opens (``unix:PATH``: a connection to that
  socket);
* ``http://…`` or ``https://…``: a GET of the URL answers 2xx (no proxy; a redirect is not
  followed and is a failure; https checks the certificate as usual);
* ``endpoint``: the endpoint published now (``--publish-endpoint`` or the command's own
  publish): an ``http(s)://`` URL is checked as above, ``unix:PATH`` or ``unix://PATH`` by
  connecting to that socket, anything else naming a host and a port (``tcp://h:p``,
  ``redis://h:p``, ``h:p``) by a TCP connection; with none published, or one that names no
  address, the check fails;
* ``command``: the command says so itself, with ``ready`` and ``not_ready`` lines on its publish
  descriptor (:mod:`hubd.sidecar.channel`); nothing is probed.

A check runs every ``--ready-interval`` seconds (1), each attempt given ``--ready-timeout``
seconds (1). The first success makes the sidecar ready; once ready, it is not ready again when
the check has failed, without a success in between, for ``--not-ready-after`` seconds (5; 0:
at the first failure), and ready again at the next success. Without ``--ready-check`` the
sidecar can serve as soon as its command has started (at once, with no command), as
Kubernetes treats a container without a readiness probe.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import urllib.parse
from collections.abc import Callable
from typing import Final

import attrs
import structlog

__all__ = [
    "COMMAND",
    "ENDPOINT",
    "Probe",
    "ReadyCheck",
    "ReadyGate",
    "add_arguments",
    "check_from",
    "probe",
    "probe_of",
    "watch",
]

log = structlog.get_logger(__name__)

COMMAND: Final = "command"
ENDPOINT: Final = "endpoint"
_READ_LIMIT: Final = 8 * 1024
"""How much of an HTTP answer is read: its status line is all that counts."""


@attrs.frozen
class Probe:
    """One address to check: ``tcp`` (``host``, ``port``), ``http`` (``url``) or ``unix``
    (``path``)."""

    kind: str
    host: str = ""
    port: int = 0
    url: str = ""
    path: str = ""


@attrs.frozen(kw_only=True)
class ReadyCheck:
    """What ``--ready-check`` and its options said."""

    target: Probe | str
    """A fixed :class:`Probe`, or :data:`ENDPOINT` or :data:`COMMAND`."""
    interval: float = 1.0
    timeout: float = 1.0
    not_ready_after: float = 5.0


@attrs.define
class ReadyGate:
    """The rule, over the outcomes of a check: ready at the first success, not ready once the
    check failed for ``not_ready_after`` seconds without a success, ready at the next one."""

    not_ready_after: float
    ready: bool = False
    failing_since: float | None = None

    def observe(self, ok: bool, now: float) -> bool | None:
        """One check's outcome at ``now`` (seconds, any monotonic clock); the readiness it
        changed to, or ``None`` when it did not change."""
        if ok:
            self.failing_since = None
            if self.ready:
                return None
            self.ready = True
            return True
        if not self.ready:
            return None
        if self.failing_since is None:
            self.failing_since = now
        if now - self.failing_since < self.not_ready_after:
            return None
        self.ready = False
        self.failing_since = None
        return False


def probe_of(address: str) -> Probe | None:
    """What checking ``address`` (a ``--ready-check`` target or a published endpoint) means;
    ``None`` when it names nothing that can be checked."""
    if address.startswith("tcp:") and not address.startswith("tcp://"):
        address = address[len("tcp:") :]
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        path = path[2:] if path.startswith("//") else path
        return Probe("unix", path=path) if path.startswith("/") else None
    if "://" not in address:
        address = "tcp://" + address
    try:
        parts = urllib.parse.urlsplit(address)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    if parts.scheme in ("http", "https"):
        return Probe("http", url=address)
    if port is None:
        return None
    return Probe("tcp", host=parts.hostname, port=port)


def check_from(args: argparse.Namespace) -> ReadyCheck | None:
    """The readiness check of a parsed command line (``None``: none asked for);
    :class:`ValueError` naming the bad option."""
    text: str | None = args.ready_check
    if text is None:
        return None
    target: Probe | str | None = text if text in (COMMAND, ENDPOINT) else probe_of(text)
    if target is None:
        raise ValueError(
            f"--ready-check {text!r:.80}: expected tcp:HOST:PORT, an http:// or https:// URL, "
            "unix:PATH, endpoint or command"
        )
    for name in ("ready_interval", "ready_timeout", "not_ready_after"):
        value = getattr(args, name)
        if not value >= 0 or (value == 0 and name != "not_ready_after"):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be a positive number of seconds")
    return ReadyCheck(
        target=target,
        interval=args.ready_interval,
        timeout=args.ready_timeout,
        not_ready_after=args.not_ready_after,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The readiness options of ``hubd sidecar``."""
    parser.add_argument(
        "--ready-check",
        metavar="CHECK",
        help="say ready only while this check passes: tcp:HOST:PORT, an http(s):// URL "
        "(GET answers 2xx), unix:PATH, endpoint (the published endpoint) or command (the "
        "command says so on HUBD_PUBLISH_FD). Default: ready once the command started",
    )
    parser.add_argument(
        "--ready-interval", metavar="SECONDS", type=float, default=1.0,
        help="seconds between checks (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--ready-timeout", metavar="SECONDS", type=float, default=1.0,
        help="seconds one check may take (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--not-ready-after", metavar="SECONDS", type=float, default=5.0,
        help="once ready, say not ready when the check failed this long without a success "
        "(default 5; 0: at the first failure)",
    )  # fmt: skip


async def probe(target: Probe, within: float) -> bool:
    """Whether ``target`` answers within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            if target.kind == "http":
                return await _http_ok(target.url)
            if target.kind == "unix":
                _, writer = await asyncio.open_unix_connection(target.path)
            else:
                _, writer = await asyncio.open_connection(target.host, target.port)
            await _close(writer)
            return True
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
        return False


async def _http_ok(url: str) -> bool:
    """A GET of ``url`` over HTTP/1.1 answered 2xx. Written on the streams rather than a
    client library: one request, its status line, nothing else (no proxy, no redirect)."""
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    context = ssl.create_default_context() if secure else None
    reader, writer = await asyncio.open_connection(
        host, port, ssl=context, server_hostname=host if secure else None, limit=_READ_LIMIT
    )
    try:
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        netloc = parts.netloc.rpartition("@")[2]
        writer.write(
            f"GET {target} HTTP/1.1\r\nHost: {netloc}\r\nUser-Agent: hubd-sidecar\r\n"
            "Accept: */*\r\nConnection: close\r\n\r\n".encode("latin-1")
        )
        await writer.drain()
        status = (await reader.readline()).split()
    finally:
        await _close(writer)
    return len(status) >= 2 and status[0].startswith(b"HTTP/") and status[1][:1] == b"2"


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def watch(
    check: ReadyCheck,
    *,
    endpoint: Callable[[], str | None],
    set_ready: Callable[[bool], None],
) -> None:
    """Run ``check`` for good, every interval, telling ``set_ready`` each change of the
    rule's answer; ``endpoint`` gives the endpoint published now (for :data:`ENDPOINT`)."""
    loop = asyncio.get_running_loop()
    gate = ReadyGate(check.not_ready_after)
    while True:
        started = loop.time()
        target: Probe | None
        if isinstance(check.target, Probe):
            target = check.target
        else:
            published = endpoint()
            target = None if published is None else probe_of(published)
        ok = target is not None and await probe(target, check.timeout)
        changed = gate.observe(ok, loop.time())
        if changed is not None:
            log.info("sidecar_check_changed", ready=changed)
            set_ready(changed)
        await asyncio.sleep(max(0.0, started + check.interval - loop.time()))
