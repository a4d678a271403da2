"""The sidecar handshake as pure decisions: no sockets, no database, no clock.

The websocket shell hands over the request path and headers and, later, the identity it looked
up; these functions answer with a typed request or a :class:`Rejection`. The order of the
checks is the protocol's (docs/architecture.md §4): headers (400), then ``Origin`` (403), then
the allocation lookup (401 absent, 503 unknown), then generation and status (409), then sidecar
id, token and reconnect secret (401).

Protocol v2 binds a generation's identity to its latest connection: once a generation has a
reconnect secret (handed out in each v2 welcome), a handshake must present it, and the token
alone, which sits in the sidecar's environment, opens nothing. v1 is still spoken for sidecars
started before v2 existed; a v1 sidecar can neither be told a secret nor present one, so it is
accepted only while its generation has none (v1's token model), and never once a v2 sidecar of
that generation has connected.
"""

from __future__ import annotations

import enum
import hmac
import re
from collections.abc import Collection
from typing import Final, Protocol

import attrs

from hubd.store.connection_values import SidecarIdentity
from hubd.store.rows import Status
from hubd.store.secrets import SecretState
from hubd.tokens import (
    hash_token,
    reconnect_secret_is_well_formed,
    token_is_well_formed,
    verify_token,
)

__all__ = [
    "ACCEPTING_STATUSES",
    "CONNECT_PATH",
    "MAX_GENERATION",
    "SECRET_HEADER",
    "SUBPROTOCOL",
    "SUBPROTOCOLS",
    "SUBPROTOCOL_V1",
    "UNAUTHORIZED",
    "CloseCode",
    "HandshakeRequest",
    "HeaderSource",
    "Rejection",
    "authorize",
    "check_origin",
    "close_reason",
    "parse_request",
    "unavailable",
]

CONNECT_PATH: Final = "/v1/sidecars/connect"
SUBPROTOCOL: Final = "hubd.sidecar.v2"
SUBPROTOCOL_V1: Final = "hubd.sidecar.v1"
SUBPROTOCOLS: Final = (SUBPROTOCOL, SUBPROTOCOL_V1)
"""What the listener speaks, preferred first (websockets picks the first one a client offers)."""
SECRET_HEADER: Final = "Hubd-Reconnect-Secret"  # noqa: S105 -- a header name
MAX_GENERATION: Final = 2**31 - 1  # a PostgreSQL integer

ACCEPTING_STATUSES: Final = frozenset({Status.PROVISIONING, Status.ALLOCATED})
"""Statuses whose current sidecar may connect. ``pending`` has no identity bound yet."""

_ALLOCATION_ID: Final = re.compile(r"al_[0-9a-f]{32}")
# Sidecar ids are compared with the stored one, never parsed; this only keeps what reaches the
# logs and the database short and printable.
_SIDECAR_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_GENERATION: Final = re.compile(r"[1-9][0-9]{0,9}")
_BEARER: Final = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +(\S+)")


class CloseCode(enum.IntEnum):
    """What each close code the hub sends means to a sidecar."""

    NORMAL = 1000
    GOING_AWAY = 1001
    """The hub is shutting down: reconnect with backoff."""
    POLICY = 1008
    """The sidecar broke a rule (message rate)."""
    TOO_BIG = 1009
    """A message exceeded 64 KiB (sent by websockets itself)."""
    INTERNAL_ERROR = 1011
    """The hub could not record the connection: reconnect with backoff."""
    SUPERSEDED = 4000
    """A newer connection of the same allocation and generation took over: do not reconnect."""
    RETIRED = 4001
    """The allocation was released or failed: do not reconnect."""
    FENCED = 4002
    """A newer generation exists: this sidecar was replaced, do not reconnect."""
    PROTOCOL_ERROR = 4003
    """The sidecar sent a message the hub refuses (a malformed or oversized publish, a publish
    or ready before its welcome was acknowledged): nothing of it was written; do not reconnect,
    the same message would be refused again."""

    @property
    def reason(self) -> str:
        return self.name.lower().replace("_", " ")


class HeaderSource(Protocol):
    """The part of ``websockets.datastructures.Headers`` the parser reads."""

    def get_all(self, key: str) -> list[str]: ...


@attrs.frozen(kw_only=True)
class Rejection:
    """An HTTP refusal of the upgrade: status and a short reason that carries nothing secret."""

    status: int
    reason: str
    retry_after: int | None = None


@attrs.frozen(kw_only=True)
class HandshakeRequest:
    """A well-formed handshake. The token is kept out of ``repr`` and never logged."""

    allocation_id: str
    sidecar_id: str
    generation: int
    token: str = attrs.field(repr=False)
    origin: str | None
    version: int = 2
    secret: str | None = attrs.field(default=None, repr=False)
    """The reconnect secret presented (v2 only); ``None``: the token alone."""


def _single(headers: HeaderSource, name: str) -> str | Rejection | None:
    values = headers.get_all(name)
    if not values:
        return None
    if len(values) > 1:
        return Rejection(status=400, reason=f"{name} header given more than once")
    return values[0].strip()


def parse_request(path: str, headers: HeaderSource) -> HandshakeRequest | Rejection:
    """Check the path and the four handshake headers; 404 or 400 with what is wrong.

    A rejection names the header at fault but never repeats its value: the value of
    ``Authorization`` is a credential, and the others are echoed nowhere either.
    """
    if path.partition("?")[0] != CONNECT_PATH:
        return Rejection(status=404, reason="not found")

    values: dict[str, str] = {}
    for name in ("Authorization", "Hubd-Allocation-Id", "Hubd-Sidecar-Id", "Hubd-Generation"):
        value = _single(headers, name)
        if isinstance(value, Rejection):
            return value
        if not value:
            return Rejection(status=400, reason=f"missing {name} header")
        values[name] = value

    bearer = _BEARER.fullmatch(values["Authorization"])
    if bearer is None or not token_is_well_formed(bearer.group(1)):
        return Rejection(
            status=400, reason="malformed Authorization header: expected a bearer token"
        )
    if not _ALLOCATION_ID.fullmatch(values["Hubd-Allocation-Id"]):
        return Rejection(status=400, reason="malformed Hubd-Allocation-Id header")
    if not _SIDECAR_ID.fullmatch(values["Hubd-Sidecar-Id"]):
        return Rejection(status=400, reason="malformed Hubd-Sidecar-Id header")
    generation_text = values["Hubd-Generation"]
    if not _GENERATION.fullmatch(generation_text) or int(generation_text) > MAX_GENERATION:
        return Rejection(status=400, reason="malformed Hubd-Generation header: expected an integer")

    offered = {
        protocol.strip()
        for header in headers.get_all("Sec-WebSocket-Protocol")
        for protocol in header.split(",")
    }
    if SUBPROTOCOL in offered:
        version = 2
    elif SUBPROTOCOL_V1 in offered:
        version = 1
    else:
        return Rejection(status=400, reason=f"missing subprotocol {SUBPROTOCOL}")

    secret = _single(headers, SECRET_HEADER)
    if isinstance(secret, Rejection):
        return secret
    if secret is not None:
        if version == 1:
            return Rejection(status=400, reason=f"{SECRET_HEADER} needs {SUBPROTOCOL}")
        if not reconnect_secret_is_well_formed(secret):
            return Rejection(status=400, reason=f"malformed {SECRET_HEADER} header")

    origin = _single(headers, "Origin")
    if isinstance(origin, Rejection):
        return origin
    return HandshakeRequest(
        allocation_id=values["Hubd-Allocation-Id"],
        sidecar_id=values["Hubd-Sidecar-Id"],
        generation=int(generation_text),
        token=bearer.group(1),
        origin=origin,
        version=version,
        secret=secret or None,
    )


def check_origin(origin: str | None, allowed: Collection[str]) -> Rejection | None:
    """Sidecars are not browsers: a handshake with an ``Origin`` must name an allowed one."""
    if origin is None or origin in allowed:
        return None
    return Rejection(status=403, reason="origin not allowed")


def unavailable(retry_after: int) -> Rejection:
    """The identity cannot be checked right now; "unknown" is never "absent"."""
    return Rejection(
        status=503, reason="sidecar identity cannot be checked now", retry_after=retry_after
    )


UNAUTHORIZED: Final = Rejection(status=401, reason="unauthorized")
"""Every authentication failure looks the same: an unknown allocation, an unknown sidecar and a
wrong token share one body, so a refusal never says which allocation ids exist."""

# Hashed against when there is no identity, so an unknown allocation costs the same hash and
# comparison as a known one.
_NO_HASH: Final = bytes(32)


def authorize(request: HandshakeRequest, identity: SidecarIdentity | None) -> Rejection | None:
    """Decide 401 / 409 from the looked-up identity; ``None`` accepts the sidecar.

    Generation and status are checked before the token: a replaced sidecar must learn to stop
    (409), and its token can no longer be verified because only the current hash is kept.
    """
    if identity is None:
        verify_token(request.token, _NO_HASH)
        secret_accepted(request.secret, SecretState())
        return UNAUTHORIZED
    if request.generation < identity.generation:
        return Rejection(status=409, reason="stale generation: this sidecar was replaced")
    if identity.status.terminal or identity.status in (Status.REPLACING, Status.RELEASING):
        return Rejection(status=409, reason="allocation no longer accepts sidecars")
    # Every comparison always runs, so the response time does not say which of them failed.
    token_ok = verify_token(request.token, identity.token_hash)
    # v1 cannot present a secret: once its generation has one, v1 opens nothing.
    secret_ok = secret_accepted(request.secret, identity.secret) and not (
        request.version == 1 and identity.secret.is_set
    )
    sidecar_ok = (
        identity.sidecar_id is not None
        and request.generation == identity.generation
        and identity.status in ACCEPTING_STATUSES
        and _equal(request.sidecar_id, identity.sidecar_id)
    )
    if not (token_ok and sidecar_ok and secret_ok):
        return UNAUTHORIZED
    return None


def secret_accepted(presented: str | None, state: SecretState) -> bool:
    """Whether a handshake that presented ``presented`` (``None``: the token alone) may take
    over its generation, given the generation's secret ``state``.

    No secret yet: only the token alone (a first connection; a secret nobody was given is
    refused). Otherwise the current secret, or, until the latest welcome is acknowledged, the
    credential that opened the latest connection (its sidecar may never have got the welcome).
    Both digests are compared in constant time whatever the outcome.
    """
    digest = hash_token(presented) if presented is not None else _NO_HASH
    current = hmac.compare_digest(digest, state.secret_hash or _NO_HASH)
    previous = hmac.compare_digest(digest, state.previous_hash or _NO_HASH)
    if not state.is_set:
        return presented is None
    if current and presented is not None:
        return True
    if state.acknowledged:
        return False
    if state.previous_hash is None:
        return presented is None
    return previous and presented is not None


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def close_reason(code: int) -> str:
    """The reason text sent with a close code the hub uses."""
    try:
        return CloseCode(code).reason
    except ValueError:
        return ""
