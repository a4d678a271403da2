"""The fenced transitions of a claim: each write that moves its allocation on (architecture §1
says which follows what). Part of :class:`~hubd.store.allocations.AllocationStore`.

Every transition takes a :class:`~hubd.store.models.Fence` and returns the updated row, or
``None`` when the fence matched nothing (the lease is gone, the generation moved on, or the
status is not the one expected). ``None`` means the claim is lost: the caller stops and writes
nothing more. Concurrent claims writing the same transition share a round trip and a commit
(:mod:`hubd.store.pipeline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from hubd.published import encode_metadata
from hubd.store.database import Database
from hubd.store.models import Allocation, EffectRow, Fence, Status, effects_json
from hubd.store.pipeline import Pipeline
from hubd.store.queries import Statement, load_queries
from hubd.store.values import (
    NO_REPLACEMENT_LIMIT,
    AttemptKind,
    Failure,
    ParkMode,
    ReplacementLimit,
)

# AttemptKind and ParkMode are the driver-free values' (hubd.store.values); named here too, as
# the arguments of these transitions.
__all__ = ["AttemptKind", "Effects", "ParkMode", "TransitionQueries"]

SQL = load_queries("allocations_transitions.sql")

# The fenced transitions whose statements are written in set form (each parameter an array, one
# element per row): a batch of them is one execution (hubd.store.pipeline).
_SET_FORM: Final = frozenset({SQL.park.name, SQL.mark_released.name})

Effects = Sequence[EffectRow]
"""The rows of the plugin call a transition brackets (``:effects``)."""


class TransitionQueries:
    """The fenced transitions of :class:`~hubd.store.allocations.AllocationStore`."""

    _db: Database
    instance_id: str
    # One per fenced transition, made on first use (see AllocationStore.pipelines).
    _pipelines: dict[str, Pipeline]

    async def bind_initial_sidecar(
        self,
        fence: Fence,
        *,
        sidecar_id: str,
        token_hash: bytes,
        connect_timeout: float,
        api_version: str,
        binding_fingerprint: str,
        ready_when: str = "connected",
        effects: Effects = (),
    ) -> Allocation | None:
        return await self._fenced(
            "bind sidecar",
            SQL.bind_initial_sidecar,
            fence,
            effects,
            sidecar_id=sidecar_id,
            token_hash=token_hash,
            connect_timeout=float(connect_timeout),
            api_version=api_version,
            binding_fingerprint=binding_fingerprint,
            ready_when=ready_when,
        )

    async def bind_replacement_sidecar(
        self,
        fence: Fence,
        *,
        sidecar_id: str,
        token_hash: bytes,
        connect_timeout: float,
        effects: Effects = (),
    ) -> Allocation | None:
        return await self._fenced(
            "bind replacement sidecar",
            SQL.bind_replacement_sidecar,
            fence,
            effects,
            sidecar_id=sidecar_id,
            token_hash=token_hash,
            connect_timeout=float(connect_timeout),
        )

    async def mark_allocated(
        self,
        fence: Fence,
        *,
        external_ref: str | None,
        endpoint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        effects: Effects = (),
    ) -> Allocation | None:
        """provisioning → allocated, recording what the provisioner said of the sidecar
        (``endpoint`` fills only what the sidecar has not published; ``metadata`` goes under
        the sidecar's keys, whichever was written first)."""
        return await self._fenced(
            "mark allocated",
            SQL.mark_allocated,
            fence,
            effects,
            external_ref=external_ref,
            endpoint=endpoint,
            metadata=encode_metadata(metadata),
        )

    async def begin_initialization(self, fence: Fence) -> Allocation | None:
        return await self._fenced("begin initialization", SQL.begin_initialization, fence)

    async def mark_connection_ready(
        self, fence: Fence, *, connection_seq: int
    ) -> Allocation | None:
        """Finish initialization: ready if no connection was recorded or cleared since the claim
        saw ``connection_seq``, else an immediate follow-up (the row's ``connection_ready`` says
        which)."""
        return await self._fenced(
            "mark ready", SQL.mark_connection_ready, fence, connection_seq=int(connection_seq)
        )

    async def schedule_retry(
        self,
        fence: Fence,
        *,
        expected_status: Status,
        delay: float,
        attempt: AttemptKind | None = None,
        failure: Failure | None = None,
        clear_initialization: bool = False,
        effects: Effects = (),
    ) -> Allocation | None:
        return await self._fenced(
            "schedule retry",
            SQL.schedule_retry,
            fence,
            effects,
            expected_status=str(expected_status),
            delay=float(delay),
            attempt=str(attempt) if attempt else None,
            failure_code=failure.code if failure else None,
            failure_message=failure.message if failure else None,
            clear_initialization=clear_initialization,
        )

    async def park(
        self,
        fence: Fence,
        *,
        mode: ParkMode,
        delay: float,
        failure: Failure | None = None,
        connection_seq: int | None = None,
        ready_within: float | None = None,
        accept: bool = False,
        external_ref: str | None = None,
        endpoint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        effects: Effects = (),
    ) -> Allocation | None:
        """Drop the lease until later. Awaiting a connection, the row is due at once instead if
        its connection number is no longer ``connection_seq``; with ``ready_within`` (an
        instance TTL), it becomes ready instead if its sidecar already holds a live record.
        With ``accept``, a provisioning row becomes allocated (``external_ref``, ``endpoint``,
        ``metadata``, as :meth:`mark_allocated` records them) first."""
        return await self._fenced(
            "park",
            SQL.park,
            fence,
            None,
            effects=effects_json(effects, accepted=accept),
            accept=accept,
            external_ref=external_ref,
            endpoint=endpoint,
            metadata=encode_metadata(metadata),
            mode=str(mode),
            delay=float(delay),
            failure_code=failure.code if failure else None,
            failure_message=failure.message if failure else None,
            connection_seq=connection_seq,
            ready_within=None if ready_within is None else float(ready_within),
        )

    async def begin_replacement(
        self,
        fence: Fence,
        *,
        expected_status: Status,
        delay: float,
        failure: Failure,
        only_if_initialization_incomplete: bool = False,
        expected_initialization_lease_id: str | None = None,
        expected_connection_seq: int | None = None,
        limit: ReplacementLimit = NO_REPLACEMENT_LIMIT,
        effects: Effects = (),
    ) -> Allocation | None:
        """Abandon the sidecar for a new one, unless ``limit`` says the allocation has failed
        too often: then it is released, to end ``failed`` (the row's ``give_up``)."""
        return await self._fenced(
            "begin replacement",
            SQL.begin_replacement,
            fence,
            effects,
            expected_status=str(expected_status),
            delay=float(delay),
            replacement_limit=int(limit.limit),
            replacement_window=float(limit.window),
            failure_code=failure.code,
            failure_message=failure.message,
            only_if_initialization_incomplete=only_if_initialization_incomplete,
            expected_initialization_lease_id=expected_initialization_lease_id,
            expected_connection_seq=expected_connection_seq,
        )

    async def begin_unrecoverable_release(
        self,
        fence: Fence,
        *,
        failure: Failure,
        only_if_initialization_incomplete: bool = False,
        expected_initialization_lease_id: str | None = None,
        expected_connection_seq: int | None = None,
    ) -> Allocation | None:
        return await self._fenced(
            "begin unrecoverable release",
            SQL.begin_unrecoverable_release,
            fence,
            failure_code=failure.code,
            failure_message=failure.message,
            only_if_initialization_incomplete=only_if_initialization_incomplete,
            expected_initialization_lease_id=expected_initialization_lease_id,
            expected_connection_seq=expected_connection_seq,
        )

    async def fail_without_infrastructure(
        self, fence: Fence, *, expected_status: Status, failure: Failure, effects: Effects = ()
    ) -> Allocation | None:
        return await self._fenced(
            "fail",
            SQL.fail_without_infrastructure,
            fence,
            effects,
            expected_status=str(expected_status),
            failure_code=failure.code,
            failure_message=failure.message,
        )

    async def mark_destroy_failed(
        self, fence: Fence, *, failure: Failure, effects: Effects = ()
    ) -> Allocation | None:
        return await self._fenced(
            "mark destroy failed",
            SQL.mark_destroy_failed,
            fence,
            effects,
            failure_code=failure.code,
            failure_message=failure.message,
        )

    async def mark_released(self, fence: Fence, *, effects: Effects = ()) -> Allocation | None:
        return await self._fenced("mark released", SQL.mark_released, fence, effects)

    async def _fenced(
        self,
        what: str,
        statement: Statement,
        fence: Fence,
        effects: Effects | None = None,
        /,
        **params: object,
    ) -> Allocation | None:
        if effects is not None:
            params["effects"] = effects_json(effects)
        pipeline = self._pipelines.get(statement.name)
        if pipeline is None:
            pipeline = self._pipelines[statement.name] = Pipeline(
                self._db, statement, set_form=statement.name in _SET_FORM
            )
        query = statement(**fence.parameters(self.instance_id), **params)
        row = await pipeline.fetchrow(what, fence.allocation_id, query)
        return Allocation.from_row(row) if row is not None else None
