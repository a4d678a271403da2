"""What the hub tells a sidecar about itself, parsed: its welcome (identity, heartbeat interval,
reconnect secret, and the context: what it serves) and a hand-over (architecture §4: a pool
member taken, so a tenant's session is new to it). Pure: no socket, no state."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from hubd.sidecar.settings import SidecarSettings
from hubd.tokens import reconnect_secret_is_well_formed

__all__ = ["Welcome", "handed_over", "parse_welcome"]


@attrs.frozen
class Welcome:
    interval: float
    secret: str = attrs.field(repr=False)
    context: dict[str, Any] = attrs.field(factory=dict, repr=False)
    """What the welcome says the sidecar serves (never the secret)."""


def parse_welcome(message: str | bytes, settings: SidecarSettings) -> Welcome | None:
    """The heartbeat interval, reconnect secret and context of the hub's welcome; ``None`` if
    it is not for the sidecar ``settings`` describe."""
    try:
        data: Any = json.loads(message)
    except ValueError:
        return None
    if not (
        isinstance(data, dict)
        and data.get("type") == "welcome"
        and data.get("allocation_id") == settings.allocation_id
        and data.get("sidecar_id") == settings.sidecar_id
        and data.get("generation") == settings.generation
    ):
        return None
    interval = data.get("heartbeat_interval_s")
    if not isinstance(interval, int | float) or isinstance(interval, bool) or interval <= 0:
        return None
    secret = data.get("reconnect_secret")
    if not isinstance(secret, str) or not reconnect_secret_is_well_formed(secret):
        return None
    spec = data.get("spec")
    context = {
        "allocation_id": settings.allocation_id,
        "sidecar_id": settings.sidecar_id,
        "generation": settings.generation,
        # A hub older than these fields sends none of them.
        "spec": spec if isinstance(spec, dict) else {},
        "tenant": _text_or_none(data.get("tenant")),
        "session": _text_or_none(data.get("session")),
        "ready_when": _text_or_none(data.get("ready_when")) or "connected",
    }
    return Welcome(max(float(interval), 1.0), secret, context)


def handed_over(
    data: Mapping[str, Any], settings: SidecarSettings, context: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The context as a ``session`` message changes it, or ``None`` when the message is not
    for this sidecar's allocation and generation."""
    if (
        data.get("allocation_id") != settings.allocation_id
        or data.get("generation") != settings.generation
    ):
        return None
    return {
        **context,
        "tenant": _text_or_none(data.get("tenant")),
        "session": _text_or_none(data.get("session")),
    }


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None
