"""The ``[[provisioners]]`` entries: a plugin instance under an id that allocations name, and
what its allocations may ask for and how long each stage may take."""

from __future__ import annotations

import re
from typing import Any, Final

import attrs

from hubd.config.kinds import problem

__all__ = ["READY_WHEN", "READY_WHEN_CONNECTED", "ProvisionerConfig", "provisioner_problem"]

_PROVISIONER_ID = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")

READY_WHEN_CONNECTED: Final = "connected"
READY_WHEN: Final = (READY_WHEN_CONNECTED, "declared")
"""A provisioner's ``ready_when``: the values of the column's domain (``hubd_ready_when``)."""


@attrs.frozen(kw_only=True)
class ProvisionerConfig:
    """One ``[[provisioners]]`` entry: a plugin instance under an id that allocations name."""

    id: str
    plugin: str
    """A built-in name, an entry-point name (group ``hubd.provisioners``) or ``"module:attr"``."""
    ready_when: str = READY_WHEN_CONNECTED
    """How its allocations become ready unless requested otherwise: ``"connected"`` (once the
    sidecar connected) or ``"declared"`` (once the connected sidecar says so, architecture
    §4)."""
    # Handed to the plugin as is; a dict is not hashable, so it stays out of the hash.
    options: dict[str, Any] = attrs.field(factory=dict, hash=False)
    max_lifetime: float | None = None
    """The longest one of its allocations may live, from its request (seconds; ``None``: no
    limit)."""
    idle_timeout: float | None = None
    """The longest (and default) idle timeout of its allocations (seconds; ``None``: none)."""
    provisioning_timeout: float | None = None
    """From claim to ready at most (seconds; ``None``: ``[reconciler] provisioning_timeout``)."""

    def __attrs_post_init__(self) -> None:
        broken = provisioner_problem(self.id, self.plugin, self.ready_when)
        if broken is not None:
            name, text = broken
            raise problem(
                "provisioners.id" if name == "id" else f"provisioners[id={self.id}].{name}", text
            )


def provisioner_problem(
    provisioner_id: str, plugin: str, ready_when: object = READY_WHEN_CONNECTED
) -> tuple[str, str] | None:
    """The rules of one provisioner entry: ``(key, problem)`` for the first one broken."""
    if not _PROVISIONER_ID.fullmatch(provisioner_id):
        return "id", f"{provisioner_id!r} must match ^[a-z0-9][a-z0-9_.-]{{0,63}}$"
    if not plugin.strip():
        return "plugin", "must not be empty"
    if ready_when not in READY_WHEN:
        return "ready_when", f'must be "connected" or "declared", not {ready_when!r:.40}'
    return None
