"""The NOTIFY channels hubd's statements and triggers announce on, each named once, what the
payloads of the two the daemon parses say, and the key their allocation tags are made with.

The ``.sql`` files spell the channel in SQL; :mod:`tests.test_channels` holds every
``pg_notify('…')`` there to one of these names. The daemon's wake-up listener subscribes to them
by these names.

Any role of the server may LISTEN on any channel, so ``hubd_connected`` and ``hubd_sockets`` name
an allocation by its *tag*, never by its id: the first 32 hex digits of sha256(key || the id's
UTF-8), with a random key of the database's (``hubd_notice_key``) that only the daemon's role may
read. A daemon makes the same tags with :class:`NoticeKey`, only for the allocations it holds
sockets or waiters of, and turns a tag back into an id by looking it up among those
(:class:`hubd.routing.TagIndex`).

Any role may NOTIFY on any channel too, so each of those payloads ends with a *mac* under the
same key: ``<body>:<mac>``, the mac the first 32 hex digits of sha256(key || "hubd-notice:" ||
the body's UTF-8). ``hubd_notice`` in the database makes the whole payload, tag and mac, in the
statement or trigger that sends it; the parsers check the mac (:meth:`NoticeKey.open`) before
they read anything else, and a payload whose mac is not the key's for its body says nothing. The
prefix keeps a mac from ever being a tag (an id never starts with it), so a tag heard is no mac.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Final

import attrs

from hubd.errors import SchemaMissing
from hubd.store.database import Database
from hubd.store.queries import load_queries

__all__ = [
    "CHANNELS",
    "CONNECTED_CHANNEL",
    "EVENTS_CHANNEL",
    "HANDOVER_CHANNEL",
    "MAC_LENGTH",
    "SELFCHECK_CHANNEL",
    "SOCKETS_CHANNEL",
    "TAG_LENGTH",
    "WAKE_CHANNEL",
    "ConnectedNotice",
    "NoticeKey",
    "SocketControl",
    "parse_connected_payload",
    "parse_handover_payload",
    "parse_sockets_payload",
    "read_notice_key",
]

SQL = load_queries("notice_key.sql")

TAG_LENGTH: Final = 32
"""Hex digits of an allocation's tag: 128 bits, so two held allocations never share one."""

MAC_LENGTH: Final = 32
"""Hex digits of a notice's mac: 128 bits, never guessed."""

_MAC_DOMAIN: Final = b"hubd-notice:"

# Read only once the mac held. ASCII digits only, and few of them: ``str.isdigit`` takes digits
# ``int`` refuses ("²"), and ``int`` refuses more than 4,300 digits.
_CONNECTED: Final = re.compile(
    rf"([0-9a-f]{{{TAG_LENGTH}}}):([0-9]{{1,18}}):([0-9]{{1,18}}):([^:]+)"
)
_SOCKETS: Final = re.compile(rf"([0-9a-f]{{{TAG_LENGTH}}}):([0-9]{{1,18}}):(fence|retire)")
_HANDOVER: Final = re.compile(rf"([0-9a-f]{{{TAG_LENGTH}}}):([0-9]{{1,18}}):take")

WAKE_CHANNEL: Final = "hubd_wake"
"""Something became due (a request, a release, a sidecar connected); payload: the provisioner id
of the allocation, so that PostgreSQL delivers one notification for the many alike of one
transaction (a batch of requests, a batch of connection records)."""

CONNECTED_CHANNEL: Final = "hubd_connected"
"""The NOTIFY channel a connection record announces itself on; payload
``<tag>:<generation>:<seq>:<connection>:<mac>`` (the allocation's tag, the mac of the rest)."""

SOCKETS_CHANNEL: Final = "hubd_sockets"
"""The NOTIFY channel on which every move to a newer generation or to a terminal status is
announced (a trigger on ``hubd_allocations``); payload ``<tag>:<gen>:fence|retire:<mac>`` (the
allocation's tag, the mac of the rest)."""

SELFCHECK_CHANNEL: Final = "hubd_selfcheck"
"""A listener's own probe, sent through the ordinary pool; payload: a nonce."""

HANDOVER_CHANNEL: Final = "hubd_handover"
"""The NOTIFY channel on which a pool member's take is announced (``hubd_take_member``):
payload ``<tag>:<gen>:take:<mac>``; the replica holding its sidecar's socket hands the session
over (architecture §4, *Hand-over*)."""

CHANNELS: Final = (
    WAKE_CHANNEL,
    CONNECTED_CHANNEL,
    SOCKETS_CHANNEL,
    HANDOVER_CHANNEL,
    SELFCHECK_CHANNEL,
)
"""Every channel a daemon listens on."""

EVENTS_CHANNEL: Final = "hubd_events"
"""The application's channel (docs/api.md): an event entered the feed; payload: its position
and what it says. Sent by the feed's trigger, heard by applications (``hubd.client``), never by
a daemon."""


@attrs.frozen
class NoticeKey:
    """The database's key for allocation tags and notice macs (``hubd_notice_key``), read once
    at start."""

    secret: bytes = attrs.field(repr=False)

    def tag(self, allocation_id: str) -> str:
        """The allocation's tag, as ``hubd_notice`` (and ``hubd_notice_tag``) make it in the
        database."""
        digest = hashlib.sha256(self.secret + allocation_id.encode("utf-8")).hexdigest()
        return digest[:TAG_LENGTH]

    def mac(self, body: str) -> str:
        """The mac ``hubd_notice`` gives a notice's body."""
        # "surrogatepass": a str from anywhere is hashed, never raises (no mac matches it).
        data = _MAC_DOMAIN + body.encode("utf-8", "surrogatepass")
        return hashlib.sha256(self.secret + data).hexdigest()[:MAC_LENGTH]

    def notice(self, body: str) -> str:
        """``body`` with its mac: the payload ``hubd_notice`` sends."""
        return f"{body}:{self.mac(body)}"

    def open(self, payload: str) -> str | None:
        """The body of ``payload`` if it ends with the body's mac under this key, else
        ``None``: any role may NOTIFY, and only the database's statements know the key."""
        body, colon, mac = payload.rpartition(":")
        # The length and the alphabet are no secret; compare_digest takes ASCII str only.
        if not colon or len(mac) != MAC_LENGTH or not mac.isascii():
            return None
        return body if hmac.compare_digest(self.mac(body), mac) else None


async def read_notice_key(db: Database) -> NoticeKey:
    """The database's key; :class:`~hubd.errors.SchemaMissing` if it has none."""
    secret = await db.fetchval("read the notice key", SQL.notice_key())
    if secret is None:
        raise SchemaMissing("the database has no notice key (hubd_notice_key): migrate it")
    return NoticeKey(bytes(secret))


@attrs.frozen
class ConnectedNotice:
    """A ``hubd_connected`` notification: connection ``connection_id``'s record of generation
    ``generation`` of the allocation tagged ``tag`` was written with number ``seq``."""

    tag: str
    generation: int
    seq: int
    connection_id: str


@attrs.frozen
class SocketControl:
    """A ``hubd_sockets`` notification: sockets of the allocation tagged ``tag`` older than
    ``generation`` must go (``fence``), or every socket of it (``retire``)."""

    tag: str
    generation: int
    retire: bool


def parse_connected_payload(payload: str, key: NoticeKey) -> ConnectedNotice | None:
    """What a ``hubd_connected`` notification says, or ``None`` if ``key`` does not
    authenticate it or it is malformed."""
    body = key.open(payload)
    match = _CONNECTED.fullmatch(body) if body is not None else None
    if match is None or int(match[2]) < 1:
        return None
    return ConnectedNotice(match[1], int(match[2]), int(match[3]), match[4])


def parse_sockets_payload(payload: str, key: NoticeKey) -> SocketControl | None:
    """What a ``hubd_sockets`` notification says, or ``None`` if ``key`` does not authenticate
    it or it is malformed."""
    body = key.open(payload)
    match = _SOCKETS.fullmatch(body) if body is not None else None
    if match is None or int(match[2]) < 1:
        return None
    return SocketControl(match[1], int(match[2]), retire=match[3] == "retire")


def parse_handover_payload(payload: str, key: NoticeKey) -> tuple[str, int] | None:
    """What a ``hubd_handover`` notification says (the taken allocation's tag and generation),
    or ``None`` if ``key`` does not authenticate it or it is malformed."""
    body = key.open(payload)
    match = _HANDOVER.fullmatch(body) if body is not None else None
    if match is None or int(match[2]) < 1:
        return None
    return match[1], int(match[2])
