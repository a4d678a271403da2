"""``watch_sidecars`` for the ``container`` provisioner: the sidecars whose containers died or
were removed without hubd asking, from the engine's events stream.

The stream is opened first, then the deployment's containers are listed: a container that dies
between the two is seen by both (reported once), never by neither. The stream asks for events
since a moment before it was opened, because both engines send the answer's headers before
they subscribe it to their events; what that replays is reported once too.

What each engine sends, for a container labelled ``io.hubd.deployment=<deployment>`` (its
labels are the event's ``Actor.Attributes``, beside the engine's own ``name``, ``image``…):

- dockerd 20.10: ``die`` (``exitCode`` attribute), then ``destroy`` when it is removed; a
  ``kill`` (``signal``) before a killed container's ``die``, ``oom`` before an OOM kill's.
- Podman 4.3's compatible API: ``die`` (``exitCode`` and ``containerExitCode``; its own API
  says ``died``), then ``cleanup``, and ``remove`` when it is removed. Its ``event`` filter
  takes only its own words (``died``, not ``die``), so events are filtered here, by
  ``Action`` (``status`` on an engine without it), never by the engine.

On a death the container is inspected, for its exit code and whether the kernel's OOM killer
ended it (dockerd says so; Podman 4.3 under cgroup v1 reports ``OOMKilled: false`` and exit
code 137, which reads as ``killed``), and the tail of its logs is read, scrubbed of its token.
A container already gone by then, or removed with no death seen, is reported ``removed``.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, Final

import attrs

from hubd.plugins.container.engine import EngineFailed, EngineSession, EngineUnavailable
from hubd.plugins.container.spec import (
    LABEL_ALLOCATION,
    LABEL_DEPLOYMENT,
    LABEL_GENERATION,
    LABEL_SIDECAR,
    SIDECAR_ID,
    token_of,
)
from hubd.plugins.protocol import MAX_EXIT_OUTPUT, SidecarExit

__all__ = ["Recent", "Sidecar", "event_of", "exit_reason", "sidecar_of", "watch_exits"]

OUTPUT_LINES: Final = 20
"""Lines of a dead sidecar's output read for its report (at most MAX_EXIT_OUTPUT characters)."""
_DIED: Final = frozenset({"die", "died"})
_REMOVED: Final = frozenset({"destroy", "remove"})
_DEAD_STATES: Final = frozenset({"exited", "dead", "stopped"})  # "stopped": Podman's, briefly
_RUNNING: Final = frozenset({"running", "restarting", "paused"})
_KILLED: Final = frozenset({137, 143})  # 128 + SIGKILL, 128 + SIGTERM
_SINCE_MARGIN: Final = 1.0
"""Seconds of events replayed before the stream was opened (see the module's docstring)."""
_MAX_EVENT: Final = 256 * 1024
_REPORTED_LIMIT: Final = 4096


class Recent:
    """A bounded set that forgets its oldest members: ``limit`` is the most kept."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._members: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __contains__(self, member: object) -> bool:
        return member in self._members

    def add(self, member: str) -> None:
        self._members[member] = None
        self._members.move_to_end(member)
        while len(self._members) > self._limit:
            self._members.popitem(last=False)

    def discard(self, member: str) -> None:
        self._members.pop(member, None)


@attrs.frozen(kw_only=True)
class Sidecar:
    """Whose a container is, as its labels say."""

    sidecar_id: str
    allocation_id: str
    generation: int

    def exit(self, exit_code: int | None, output: str = "", reason: str = "exited") -> SidecarExit:
        return SidecarExit(
            sidecar_id=self.sidecar_id,
            allocation_id=self.allocation_id,
            generation=self.generation,
            exit_code=exit_code,
            output=output,
            reason=reason,
        )

    def removed(self) -> SidecarExit:
        return self.exit(None, reason="removed")


def sidecar_of(labels: Mapping[str, Any] | None, deployment: str) -> Sidecar | None:
    """The sidecar a container's labels (or an event's attributes) name, or ``None`` when they
    are not this deployment's or do not name a sidecar, an allocation and a generation."""
    labels = labels or {}
    sidecar_id = labels.get(LABEL_SIDECAR)
    allocation_id = labels.get(LABEL_ALLOCATION)
    generation = str(labels.get(LABEL_GENERATION) or "")
    if (
        labels.get(LABEL_DEPLOYMENT) != deployment
        or not isinstance(sidecar_id, str)
        or not SIDECAR_ID.fullmatch(sidecar_id)
        or not isinstance(allocation_id, str)
        or not allocation_id
        or not generation.isdigit()
        or int(generation) < 1
    ):
        return None
    return Sidecar(sidecar_id=sidecar_id, allocation_id=allocation_id, generation=int(generation))


def exit_reason(state: Mapping[str, Any]) -> str:
    """``oom_killed``, ``killed`` (exit code 137 or 143, no OOM kill reported) or ``exited``,
    from an inspected container's ``State``."""
    if state.get("OOMKilled") is True:
        return "oom_killed"
    return "killed" if state.get("ExitCode") in _KILLED else "exited"


@attrs.frozen(kw_only=True)
class Event:
    """A container event that matters here: ``died`` or ``removed``."""

    kind: str
    container_id: str
    sidecar: Sidecar


def event_of(event: Mapping[str, Any], deployment: str) -> Event | None:
    """The event as :class:`Event`, or ``None`` for one that does not matter here: another
    action, another type, or a container that is not one of this deployment's sidecars."""
    if event.get("Type", "container") != "container":
        return None
    action = str(event.get("Action") or event.get("status") or "")
    # dockerd's actions can carry a detail after a colon ("exec_start: sh"); these do not.
    kind = "died" if action in _DIED else "removed" if action in _REMOVED else None
    actor = event.get("Actor") or {}
    container_id = actor.get("ID") or event.get("id")
    if kind is None or not isinstance(container_id, str) or not container_id:
        return None
    sidecar = sidecar_of(actor.get("Attributes"), deployment)
    if sidecar is None:
        return None
    return Event(kind=kind, container_id=container_id, sidecar=sidecar)


async def _death(
    engine: EngineSession, container_id: str, sidecar: Sidecar, deployment: str
) -> SidecarExit | None:
    """The report of a container that died, from its inspection and its logs; ``removed`` when
    it is gone already; ``None`` when it runs (again)."""
    found = await engine.inspect(container_id)
    if found is None:
        return sidecar.removed()
    state = found.get("State") or {}
    if state.get("Running") is True or state.get("Status") in _RUNNING:
        return None
    # By its own labels when it has them: the event's are a copy of them.
    sidecar = sidecar_of((found.get("Config") or {}).get("Labels"), deployment) or sidecar
    exit_code = state.get("ExitCode")
    output = await engine.logs_tail(
        container_id, lines=OUTPUT_LINES, limit=MAX_EXIT_OUTPUT, secret=token_of(found)
    )
    return sidecar.exit(
        exit_code if isinstance(exit_code, int) else None, output, reason=exit_reason(state)
    )


async def watch_exits(
    engine: EngineSession, deployment: str, *, skip: Callable[[str], bool]
) -> AsyncGenerator[SidecarExit | None, None]:
    """``None`` once the events stream is open (hubd counts the engine reachable from then),
    then every sidecar of ``deployment`` whose container is dead now, then each one whose
    container dies or is removed from now on, once per container; sidecars ``skip`` says
    (those hubd is destroying) are left out. Ends only by raising: :class:`EngineUnavailable`
    when the engine ends the stream."""
    filters = {"type": ["container"], "label": [f"{LABEL_DEPLOYMENT}={deployment}"]}
    params = {"filters": json.dumps(filters), "since": f"{time.time() - _SINCE_MARGIN:.3f}"}
    reported = Recent(_REPORTED_LIMIT)
    async with engine.stream("events", "events", params, read_timeout=None) as stream:
        # The stream is open: what dies from here on is in it.
        yield None
        for listed in await engine.list_labelled(LABEL_DEPLOYMENT, deployment):
            sidecar = sidecar_of(listed["Labels"], deployment)
            container_id = str(listed["Id"])
            if sidecar is None or listed["State"] not in _DEAD_STATES or skip(sidecar.sidecar_id):
                continue
            report = await _death(engine, container_id, sidecar, deployment)
            if report is not None:
                reported.add(container_id)
                yield report
        while True:
            line = await stream.line(_MAX_EVENT)
            if not line:
                raise EngineUnavailable(
                    f"container engine at {engine.socket.display} ended its events stream"
                )
            if not line.strip():
                continue
            try:
                decoded = json.loads(line)
            except ValueError:
                raise EngineFailed(
                    0, f"container engine at {engine.socket.display} sent an event that is "
                    "not JSON",
                ) from None  # fmt: skip
            event = event_of(decoded, deployment) if isinstance(decoded, dict) else None
            if event is None or event.container_id in reported or skip(event.sidecar.sidecar_id):
                continue
            if event.kind == "died":
                died = await _death(engine, event.container_id, event.sidecar, deployment)
                if died is None:
                    continue
                report = died
            else:
                report = event.sidecar.removed()
            reported.add(event.container_id)
            yield report
