"""What the sidecar listener's sockets are set up with: TLS, the logger handed to websockets, the
counters they feed and the sampled lines logged about them."""

from __future__ import annotations

import collections
import ipaddress
import logging
import ssl
import time
from typing import Any

import attrs
import structlog
from websockets.asyncio.server import ServerConnection

from hubd.logs import Sampler

__all__ = ["ServerStats", "WireLogger", "is_loopback_host", "note", "remote_of", "tls_context"]

log = structlog.get_logger(__name__)


class WireLogger(logging.LoggerAdapter[logging.Logger]):
    """The logger handed to websockets: warnings and errors only.

    websockets logs every handshake header at DEBUG, ``Authorization`` included, and a line per
    connection at INFO; neither may reach hubd's logs whatever level an operator configures.
    """

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 -- overrides logging's name
        return level >= logging.WARNING and self.logger.isEnabledFor(level)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


@attrs.define
class ServerStats:
    """Counters a test or a metrics exporter reads."""

    accepted: int = 0
    handshakes_in_progress: int = 0
    rejected: collections.Counter[int] = attrs.field(factory=collections.Counter)
    refused_early: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """Sockets refused before websockets parsed anything, by reason."""
    aborted: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """Sockets aborted for a resource bound (write buffer, stall, eviction), by reason."""
    queued: int = 0
    """Sockets that waited for a handshake slot instead of taking one at once."""
    heartbeats: int = 0
    published: int = 0
    """Publishes stored."""
    declared_ready: int = 0
    """Declarations of readiness recorded."""
    declared_not_ready: int = 0
    """Declarations that a sidecar can no longer serve, answered."""
    activity: int = 0
    """Activity reports answered (each restarted an idle clock, or found none running)."""
    protocol_errors: int = 0
    """Sockets closed with 4003 for a message the hub refused."""
    ignored_messages: int = 0
    ignored_by_kind: collections.Counter[str] = attrs.field(factory=collections.Counter)


def remote_of(connection: ServerConnection) -> str | None:
    address = connection.remote_address
    if not address:
        return None
    return f"{address[0]}:{address[1]}"


def note(
    sampler: Sampler, event: str, key: str, connection: ServerConnection, **context: Any
) -> None:
    """Log ``event`` about ``connection`` at info, unless ``sampler`` holds back its ``key``
    now: a flood is one line per kind every few seconds, with the count of those left out."""
    suppressed = sampler.admit(key, time.monotonic())
    if suppressed is None:
        return
    if suppressed:
        context["suppressed"] = suppressed
    log.info(event, remote=remote_of(connection), **context)
