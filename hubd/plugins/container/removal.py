"""What ``destroy`` removes (and the orphan sweep, through it): the sidecar's containers found by
the id ``ensure`` recorded and by the sidecar's name, each only when its labels say it is this
deployment's container for that sidecar, and each removed by the full id inspected.

By the recorded id, because it holds whatever the container was made of: a changed ``image`` or
``command`` still destroys what the old configuration made, and a container the sweep listed is
the one removed even under another name. By the name as well, because an ``ensure`` that was
cut short records no id. By the full id inspected, because a name (or a 12-digit prefix) can
come to mean another container between the inspect and the removal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from hubd.plugins.container.engine import EngineSession
from hubd.plugins.container.spec import LABEL_ALLOCATION, container_name, is_ours
from hubd.plugins.protocol import DestroyRequest

__all__ = ["ClaimLost", "recorded_id", "remove_sidecar"]

_RUNNING: Final = frozenset({"running", "restarting"})
# What ``external_ref`` records (spec.external_ref): the id's first 12 digits, which both
# engines resolve to the one container whose id starts so.
_RECORDED: Final = re.compile(r"container:([0-9a-f]{12,64})")


class ClaimLost(Exception):
    """The request's claim was lost before a container was stopped: nothing more is done."""


def recorded_id(external_ref: str | None) -> str | None:
    """The container id an ``external_ref`` of this provisioner records, if it is one."""
    matched = _RECORDED.fullmatch(external_ref or "")
    return matched[1] if matched else None


def removable(found: Mapping[str, Any], deployment: str, request: DestroyRequest) -> bool:
    """Whether ``destroy`` may remove ``found``: this deployment's container for the request's
    sidecar id (which names one generation of one allocation: hubd mints a new id for each) and,
    when the request names one, for its allocation."""
    labels = (found.get("Config") or {}).get("Labels") or {}
    if not is_ours(labels, deployment, request.sidecar_id):
        return False
    return not request.allocation_id or labels.get(LABEL_ALLOCATION) == request.allocation_id


async def remove_sidecar(
    engine: EngineSession, request: DestroyRequest, *, deployment: str, stop_timeout: float
) -> tuple[list[str], list[str]]:
    """Stop and remove the sidecar's containers: the names of those this call removed, and of
    those left alone (found by the id or the name, but not this sidecar's). A container the
    engine no longer has when it is removed (another replica's destroy, an operator's ``rm``)
    is not counted as removed. :class:`ClaimLost` when the claim ends before a stop."""
    found_ids: set[str] = set()
    removed: list[str] = []
    foreign: list[str] = []
    handles = [recorded_id(request.external_ref), container_name(request.sidecar_id)]
    for handle in filter(None, handles):
        found = await engine.inspect(handle)
        if found is None or str(found["Id"]) in found_ids:
            continue
        found_ids.add(str(found["Id"]))
        name = str(found.get("Name", "")).lstrip("/")
        if not removable(found, deployment, request):
            foreign.append(name)
            continue
        if not request.ownership.still_owned():
            raise ClaimLost
        if str((found.get("State") or {}).get("Status", "")) in _RUNNING:
            await engine.stop(str(found["Id"]), stop_timeout)
        if await engine.remove(str(found["Id"])):
            removed.append(name)
    return removed, foreign
