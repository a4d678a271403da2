"""Where the reference sidecar dials and as whom: its ``HUBD_*`` environment, checked.

The local provisioner gives its child ``HUBD_URL``, ``HUBD_TOKEN``, ``HUBD_ALLOCATION_ID``,
``HUBD_SIDECAR_ID`` and ``HUBD_GENERATION`` (architecture §4); nothing secret travels on a
command line. A missing or malformed variable is a :class:`SidecarConfigError` whose message
names the variable, never the token.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Final

import attrs

from hubd.tokens import token_is_well_formed

__all__ = [
    "CONNECT_PATH",
    "SidecarConfigError",
    "SidecarSettings",
    "connect_url",
    "connect_urls",
]

# The protocol's endpoint, repeated rather than imported: the sidecar is a client program and
# must not pull in the hub's server and store (the tests hold the two equal).
CONNECT_PATH: Final = "/v1/sidecars/connect"


class SidecarConfigError(ValueError):
    """The sidecar's environment is missing a variable or has a malformed one."""


def connect_urls(value: str) -> tuple[str, ...]:
    """Every URL of a comma-separated ``HUBD_URL`` (one per replica, or one load-balanced
    address), each with the connect endpoint appended when it names no path."""
    urls = tuple(connect_url(part.strip()) for part in value.split(",") if part.strip())
    if not urls:
        raise SidecarConfigError("HUBD_URL must name at least one ws:// or wss:// URL")
    return urls


def connect_url(base: str) -> str:
    """``base`` with the connect endpoint appended when it names no path."""
    parts = urllib.parse.urlsplit(base)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise SidecarConfigError("HUBD_URL must be a ws:// or wss:// URL with a host")
    if parts.path in ("", "/"):
        parts = parts._replace(path=CONNECT_PATH)
    return urllib.parse.urlunsplit(parts)


@attrs.frozen(kw_only=True)
class SidecarSettings:
    """One sidecar's identity, and the hub's addresses it dials."""

    urls: tuple[str, ...]
    """Where the hub listens; with several (every replica's), a connection that fails or ends
    moves on to the next, so losing one replica without a load balancer loses nothing."""
    token: str = attrs.field(repr=False)
    allocation_id: str
    sidecar_id: str
    generation: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SidecarSettings:
        """Read the ``HUBD_*`` variables; messages name the variable, never a token."""

        def need(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise SidecarConfigError(f"{name} is not set")
            return value

        urls = connect_urls(need("HUBD_URL"))
        token = need("HUBD_TOKEN")
        if not token_is_well_formed(token):
            raise SidecarConfigError("HUBD_TOKEN is malformed: expected hubd_sc_ and 64 hex digits")
        allocation_id = need("HUBD_ALLOCATION_ID")
        sidecar_id = need("HUBD_SIDECAR_ID")
        generation_text = need("HUBD_GENERATION")
        if not generation_text.isdigit() or int(generation_text) < 1:
            raise SidecarConfigError("HUBD_GENERATION must be a positive integer")
        return cls(
            urls=urls,
            token=token,
            allocation_id=allocation_id,
            sidecar_id=sidecar_id,
            generation=int(generation_text),
        )

    @property
    def url(self) -> str:
        """The first URL: where the sidecar dials first."""
        return self.urls[0]
