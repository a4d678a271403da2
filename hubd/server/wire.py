"""What the sidecar listener's sockets are set up with: TLS, the logger handed to websockets, and
the counters they feed."""

from __future__ import annotations

import collections
import ipaddress
import logging
import ssl

import attrs

__all__ = ["ServerStats", "WireLogger", "is_loopback_host", "tls_context"]


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
    protocol_errors: int = 0
    """Sockets closed with 4003 for a message the hub refused."""
    ignored_messages: int = 0
    ignored_by_kind: collections.Counter[str] = attrs.field(factory=collections.Counter)
