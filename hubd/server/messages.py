"""What a connected sidecar may tell the hub beyond heartbeats, as pure decisions: a ``publish``
(its endpoint and metadata), a ``ready`` and a ``not_ready`` (architecture §4, *Publish and
ready*).

The listener hands over the parsed message and whether the welcome was acknowledged; these
functions answer with what to write, or with the :class:`ProtocolError` the socket is closed
with (4003). Nothing here touches a socket or the database.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from hubd.published import check_endpoint, check_metadata, encode_metadata

__all__ = ["MAX_REASON_BYTES", "ProtocolError", "Publish", "Ready", "parse_publish", "parse_ready"]

MAX_REASON_BYTES: Final = 123
"""What a close frame's reason may hold (RFC 6455: 125 bytes of payload, 2 for the code)."""


@attrs.frozen
class Publish:
    """What to store: the endpoint (``None``: unchanged) and the metadata to merge, as JSON
    text (``None``: unchanged)."""

    endpoint: str | None
    metadata: str | None


@attrs.frozen
class Ready:
    """The sidecar declares that it can serve (``ready``), or no longer can (``not_ready``)."""

    serving: bool = True


@attrs.frozen
class ProtocolError:
    """The message is refused: the socket is closed with 4003 and ``reason``, nothing
    written."""

    reason: str

    def __attrs_post_init__(self) -> None:
        encoded = self.reason.encode()
        if len(encoded) > MAX_REASON_BYTES:
            short = encoded[:MAX_REASON_BYTES].decode(errors="ignore")
            object.__setattr__(self, "reason", short)


def parse_publish(data: Mapping[str, Any], *, acknowledged: bool) -> Publish | ProtocolError:
    """A ``publish`` message: ``{"type": "publish", "endpoint"?: str, "metadata"?: {...}}``,
    at least one of the two (``null`` counts as absent), sent once the welcome was
    acknowledged (v2; a v1 sidecar, which sends no ack, once welcomed). Other fields are
    ignored, as unknown message types are."""
    if not acknowledged:
        return ProtocolError("publish before welcome_ack")
    endpoint, metadata = data.get("endpoint"), data.get("metadata")
    if endpoint is None and metadata is None:
        return ProtocolError("publish: neither endpoint nor metadata")
    try:
        checked_endpoint = None if endpoint is None else check_endpoint(endpoint)
        checked_metadata = None if metadata is None else check_metadata(metadata)
    except ValueError as exc:
        return ProtocolError(f"publish: {exc}")
    return Publish(endpoint=checked_endpoint, metadata=encode_metadata(checked_metadata))


def parse_ready(*, acknowledged: bool, serving: bool = True) -> Ready | ProtocolError:
    """A ``ready`` message (``{"type": "ready"}``), or with ``serving`` false a ``not_ready``
    (``{"type": "not_ready"}``), sent once the welcome was acknowledged (other fields are
    ignored)."""
    if not acknowledged:
        kind = "ready" if serving else "not_ready"
        return ProtocolError(f"{kind} before welcome_ack")
    return Ready(serving=serving)
