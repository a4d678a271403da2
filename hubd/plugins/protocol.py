"""The provisioner plugin contract (architecture §5) and the checks applied to what plugins return.

Plugins are code hubd does not control: a result of the wrong type is an error, never a success,
and every string a plugin hands back is bounded before it reaches the database or a log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

import attrs

from hubd.errors import PluginError
from hubd.published import check_endpoint, check_metadata

__all__ = [
    "Accepted",
    "ChecksOptions",
    "DestroyRejected",
    "DestroyRequest",
    "DestroyResult",
    "Destroyed",
    "EnsureRequest",
    "EnsureResult",
    "ListsSidecars",
    "Ownership",
    "Probes",
    "Provisioner",
    "Rejected",
    "RunningSidecar",
    "SidecarExit",
    "SidecarOutput",
    "WatchesSidecars",
    "check_destroy_result",
    "check_ensure_result",
    "check_sidecar_exit",
    "checks_options",
    "former_fingerprints",
]

MAX_EXTERNAL_REF = 500
MAX_EXIT_OUTPUT = 2000
"""Characters of a dead sidecar's output kept (its tail), in the ledger and on the row."""


@attrs.frozen(kw_only=True, eq=False)
class Ownership:
    """The claim a request was made under, as a plugin checks it at the point of effect.

    Leases are not mutual exclusion: a process paused past its lease resumes believing it still
    owns the allocation, and its plugin call may be the first thing to run on resume. So check
    :meth:`still_owned` right before every irreversible act (a fork, a create call, a delete),
    and where the external system allows, write the generation into it (labels, tags, a
    conditional create keyed by the sidecar id) so it can refuse a stale generation itself.
    A request made while not owned should answer with a retryable rejection and do nothing.
    """

    _still_owned: Callable[[], bool]
    _deadline: Callable[[], float]
    _deadline_utc: Callable[[], datetime]

    def still_owned(self) -> bool:
        """Whether the claim may still act: its local lease deadline has not passed and it
        was not lost. Cheap (no database round trip); always current, renewals included."""
        return self._still_owned()

    def deadline(self) -> float:
        """When the claim stops owning the allocation unless renewed, on the daemon's
        monotonic clock (:func:`time.monotonic`): for checks inside this process."""
        return self._deadline()

    def deadline_utc(self) -> datetime:
        """The same moment on the database's wall clock (UTC), estimated from the claim's last
        database answer: for handing to an external system that compares it with its own
        time (keep a margin for clock skew)."""
        return self._deadline_utc()

    @classmethod
    def unbounded(cls) -> Ownership:
        """For requests made outside any claim (tools, tests): always owned."""
        return cls(
            still_owned=lambda: True,
            deadline=lambda: float("inf"),
            deadline_utc=lambda: datetime.max.replace(tzinfo=UTC),
        )


@attrs.frozen(kw_only=True)
class EnsureRequest:
    allocation_id: str
    generation: int
    tenant_id: str | None
    session_id: str | None
    spec: Mapping[str, Any]
    sidecar_id: str
    token: str = attrs.field(repr=False)
    hub_ws_url: str
    ownership: Ownership = attrs.field(factory=Ownership.unbounded, repr=False)


@attrs.frozen
class Accepted:
    """The sidecar exists or is being created; ``external_ref`` names it for ``destroy``.

    ``endpoint`` (where the sidecar serves, e.g. a container's published address) and
    ``metadata`` (a JSON object) are what the provisioner knows of it for applications: stored
    for this generation with the acceptance, shown in ``hubd alloc show`` and the API's view.
    """

    external_ref: str | None = None
    endpoint: str | None = attrs.field(default=None, kw_only=True)
    metadata: Mapping[str, Any] | None = attrs.field(default=None, kw_only=True)


@attrs.frozen(kw_only=True)
class Rejected:
    """The provisioner refused; ``retryable`` says whether a new sidecar may succeed."""

    code: str
    message: str
    retryable: bool


EnsureResult = Accepted | Rejected


@attrs.frozen(kw_only=True)
class DestroyRequest:
    allocation_id: str
    generation: int
    sidecar_id: str
    external_ref: str | None
    ownership: Ownership = attrs.field(factory=Ownership.unbounded, repr=False)


@attrs.frozen
class Destroyed:
    """The sidecar is gone (or never existed).

    ``removed`` says whether this call removed something: ``False`` when nothing was left to
    remove (already gone, never existed), ``None`` when the provisioner does not say. The orphan
    sweep counts a destroy, and records it in the ledger, only when it is not ``False``: a
    sweep that met nothing did nothing."""

    removed: bool | None = attrs.field(default=None, kw_only=True)


@attrs.frozen(kw_only=True)
class DestroyRejected:
    code: str
    message: str
    retryable: bool


DestroyResult = Destroyed | DestroyRejected


@runtime_checkable
class Provisioner(Protocol):
    """What a provisioner plugin provides. Both calls must be idempotent per ``sidecar_id``;
    cancelling the call's task is how hubd aborts it.

    Optionally also ``former_binding_fingerprints``, a collection of strings: what earlier
    releases of the plugin computed as ``binding_fingerprint`` for the same place, so that a
    plugin that narrows its fingerprint does not strand the allocations bound under the old
    one (:func:`former_fingerprints` reads it)."""

    id: str
    api_version: str
    binding_fingerprint: str

    async def ensure(self, request: EnsureRequest) -> EnsureResult: ...

    async def destroy(self, request: DestroyRequest) -> DestroyResult: ...


@attrs.frozen(kw_only=True)
class RunningSidecar:
    """One sidecar a provisioner runs, as its :meth:`ListsSidecars.list_sidecars` reports it.
    ``allocation_id`` and ``generation`` are what the provisioner recorded, when it did."""

    sidecar_id: str
    allocation_id: str | None = None
    generation: int | None = None
    external_ref: str | None = None


@runtime_checkable
class ListsSidecars(Protocol):
    """Optional capability: list every sidecar this provisioner runs (or has state for), so
    hubd can destroy the ones that belong to no current generation (orphan collection)."""

    async def list_sidecars(self) -> Sequence[RunningSidecar]: ...


_HOW_IT_DIED: Final = {
    "exited": "exited",
    "killed": "was killed",
    "oom_killed": "was killed for want of memory",
    "removed": "was removed",
}


@attrs.frozen(kw_only=True)
class SidecarExit:
    """A sidecar stopped running without hubd asking: its process exited or was killed, or
    whatever held it was removed. ``allocation_id`` and ``generation`` are what the provisioner
    recorded for it (a sidecar it cannot place is not reported). ``exit_code`` is ``None`` when
    unknown (removed before anyone saw it exit); ``output`` is the tail of what it wrote, ``""``
    when none is known; ``reason`` a short word (``exited``, ``killed``, ``oom_killed``,
    ``removed``)."""

    sidecar_id: str
    allocation_id: str
    generation: int
    exit_code: int | None
    output: str = ""
    reason: str = "exited"

    def describe(self) -> str:
        """One line for the ledger and ``alloc show``: what happened, then the output's tail."""
        what = _HOW_IT_DIED.get(self.reason, f"stopped ({self.reason})")
        code = "" if self.exit_code is None else f" with exit code {self.exit_code}"
        head = f"the sidecar {what}{code}"
        return f"{head}: {self.output}" if self.output else f"{head} (no output)"


@runtime_checkable
class WatchesSidecars(Protocol):
    """Optional capability: tell hubd at once when a sidecar dies, rather than leave it to the
    sidecar's missing connection (``connect_timeout``). ``watch_sidecars`` yields a
    :class:`SidecarExit` for each sidecar that stops running without a ``destroy`` of hubd's
    (reporting one hubd destroyed, or one twice, is harmless: the report is fenced on the
    generation), and ``None`` once it follows the system it watches (and whenever else it
    likes, as a sign of life): until the first ``None`` or exit, hubd does not count the
    system as reachable. It runs for the daemon's lifetime; when the system cannot be reached
    it raises :class:`~hubd.errors.PluginError` (with a ``code`` attribute naming the failure,
    when it can), and hubd calls it again after a backoff. On each call it starts following,
    then reports the sidecars that died while nobody watched (it may report again what an
    earlier call reported)."""

    def watch_sidecars(self) -> AsyncIterator[SidecarExit | None]: ...


@runtime_checkable
class SidecarOutput(Protocol):
    """Optional capability: what a sidecar wrote (stdout and stderr, in order), for ``hubd
    alloc logs``. ``sidecar_output`` yields chunks of text: the last ``tail`` lines (all when
    ``None``), then, with ``follow``, what it writes until it stops or the caller stops reading.
    A sidecar with nothing kept (gone) raises :class:`LookupError`; a system that cannot be
    reached raises :class:`~hubd.errors.PluginError`."""

    def sidecar_output(
        self, sidecar_id: str, external_ref: str | None, *, tail: int | None, follow: bool
    ) -> AsyncIterator[str]: ...


@runtime_checkable
class Probes(Protocol):
    """Optional capability: check that this provisioner can make sidecars here and now (its
    engine answers, its image or command is there), creating nothing. ``hubd check-config
    --probe`` calls it, bounded in time, and shows what it returns: one line saying what was
    found. A problem is raised as :class:`~hubd.errors.PluginError` whose message names it
    (and the option to fix), never a secret."""

    async def probe(self) -> str: ...


@runtime_checkable
class ChecksOptions(Protocol):
    """Optional capability of a plugin's *factory*: ``check_options`` validates a
    ``[provisioners.options]`` table as the factory would, building nothing and starting
    nothing, and raises :class:`~hubd.errors.PluginLoadError` (or ``ValueError`` /
    ``TypeError``) naming the option. ``hubd check-config`` calls it for every provisioner;
    attach it with :func:`checks_options`, or give a class used as a factory a static or class
    method of that name."""

    def check_options(self, *, id: str, options: Mapping[str, Any]) -> object: ...


_Factory = TypeVar("_Factory", bound=Callable[..., object])


def checks_options(check: Callable[..., object]) -> Callable[[_Factory], _Factory]:
    """Decorate a factory with its options check (:class:`ChecksOptions`)::

    @checks_options(lambda *, id, options: parse_options(options))
    def create(*, id, options, state_dir): ...
    """

    def attach(factory: _Factory) -> _Factory:
        factory.check_options = check  # type: ignore[attr-defined]
        return factory

    return attach


def former_fingerprints(provisioner: object) -> frozenset[str]:
    """The provisioner's ``former_binding_fingerprints`` (empty when it declares none, or
    declares something other than strings)."""
    former = getattr(provisioner, "former_binding_fingerprints", ())
    if isinstance(former, str) or not isinstance(former, Sequence | frozenset | set):
        return frozenset()
    return frozenset(value for value in former if isinstance(value, str) and value)


def _check_rejection(value: Rejected | DestroyRejected, what: str) -> None:
    if not isinstance(value.code, str) or not value.code:
        raise PluginError(f"{what} rejection has no code")
    if not isinstance(value.message, str):
        raise PluginError(f"{what} rejection message is not a string")
    if not isinstance(value.retryable, bool):
        raise PluginError(f"{what} rejection 'retryable' is not a bool")


def check_ensure_result(value: object) -> EnsureResult:
    """``value`` if it is a well-formed ensure result; :class:`PluginError` otherwise."""
    if isinstance(value, Accepted):
        ref = value.external_ref
        if ref is not None and (not isinstance(ref, str) or len(ref) > MAX_EXTERNAL_REF):
            raise PluginError(
                f"ensure returned an external_ref that is not a string of at most "
                f"{MAX_EXTERNAL_REF} characters"
            )
        try:
            endpoint = None if value.endpoint is None else check_endpoint(value.endpoint)
            metadata = None if value.metadata is None else check_metadata(value.metadata)
        except ValueError as exc:
            raise PluginError(f"ensure returned an Accepted whose {exc}") from None
        # A plain copy: the plugin keeps no handle on what the claim writes.
        return Accepted(ref, endpoint=endpoint, metadata=metadata)
    if isinstance(value, Rejected):
        _check_rejection(value, "ensure")
        return value
    raise PluginError(f"ensure returned {type(value).__name__}, not Accepted or Rejected")


def check_destroy_result(value: object) -> DestroyResult:
    """``value`` if it is a well-formed destroy result; :class:`PluginError` otherwise."""
    if isinstance(value, Destroyed):
        if value.removed is not None and not isinstance(value.removed, bool):
            raise PluginError("destroy result 'removed' is not a bool or None")
        return value
    if isinstance(value, DestroyRejected):
        _check_rejection(value, "destroy")
        return value
    raise PluginError(f"destroy returned {type(value).__name__}, not Destroyed or DestroyRejected")


def check_sidecar_exit(value: object) -> SidecarExit:
    """``value`` if it is a well-formed exit report, its output's tail cut to
    :data:`MAX_EXIT_OUTPUT` characters; :class:`PluginError` otherwise."""
    if not isinstance(value, SidecarExit):
        raise PluginError(f"watch_sidecars yielded {type(value).__name__}, not SidecarExit")
    if not (
        isinstance(value.sidecar_id, str)
        and value.sidecar_id
        and isinstance(value.allocation_id, str)
        and value.allocation_id
    ):
        raise PluginError("watch_sidecars yielded an exit with no sidecar or allocation id")
    if (
        not isinstance(value.generation, int)
        or isinstance(value.generation, bool)
        or (value.generation < 1)
    ):
        raise PluginError("watch_sidecars yielded an exit whose generation is not a positive int")
    if value.exit_code is not None and (
        not isinstance(value.exit_code, int) or isinstance(value.exit_code, bool)
    ):
        raise PluginError("watch_sidecars yielded an exit whose exit_code is not an int")
    if not isinstance(value.output, str) or not isinstance(value.reason, str):
        raise PluginError("watch_sidecars yielded an exit whose output or reason is not a string")
    output = value.output[-MAX_EXIT_OUTPUT:]
    reason = value.reason[:40] or "exited"
    if output == value.output and reason == value.reason:
        return value
    return attrs.evolve(value, output=output, reason=reason)
