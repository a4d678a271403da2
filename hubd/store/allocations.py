"""AllocationStore: requests, claims, leases and every transition of an allocation.

Every claim-owned write takes a :class:`Fence` and returns the updated row, or ``None`` when the
fence matched nothing (the lease is gone, the generation moved on, or the status is not the one
expected). ``None`` means the claim is lost: the caller stops and writes nothing more.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import asyncpg

from hubd.errors import AllocationNotFound
from hubd.published import encode_metadata
from hubd.store.database import Database, Pool
from hubd.store.models import (
    Allocation,
    Claimed,
    EffectRow,
    Fence,
    InitialBinds,
    Status,
    effects_json,
)
from hubd.store.pipeline import Pipeline
from hubd.store.queries import Bound, Statement, load_queries
from hubd.store.sweeps import SweepQueries
from hubd.store.values import (
    Failure,
    bounded_message,
    new_effect_id,
    validate_allocation_id,
    validate_label,
    validate_provisioner_id,
    validate_spec,
)

__all__ = ["AllocationStore", "AttemptKind", "Claimed", "ParkMode"]

SQL = load_queries("allocations.sql")

# The fenced transitions whose statements are written in set form (each parameter an array, one
# element per row): a batch of them is one execution (hubd.store.pipeline).
_SET_FORM: Final = frozenset({SQL.park.name, SQL.mark_released.name})

Effects = Sequence[EffectRow]
"""The rows of the plugin call a transition brackets (``:effects``)."""


class AttemptKind(enum.StrEnum):
    """Which durable attempt counter a retry bumps."""

    ENSURE = "ensure"
    DESTROY = "destroy"


class ParkMode(enum.StrEnum):
    AWAIT_CONNECTION = "await_connection"
    RETRY_AFTER_ERROR = "retry_after_error"


class AllocationStore(SweepQueries):
    """The statements on ``hubd_allocations``, for one hub instance."""

    def __init__(self, db: Database, *, instance_id: str) -> None:
        self._db = db
        self.instance_id = instance_id
        # One per fenced transition, made on first use: concurrent claims writing the same
        # transition share a round trip and a commit (hubd.store.pipeline).
        self._pipelines: dict[str, Pipeline] = {}

    @property
    def pipelines(self) -> Mapping[str, Pipeline]:
        """The fenced transitions' pipelines made so far, by statement name."""
        return self._pipelines

    # -- requests from applications -------------------------------------------------------

    async def request(
        self,
        *,
        provisioner_id: str,
        tenant_id: str | None = None,
        session_id: str | None = None,
        spec: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        ready_when: str | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Allocation:
        """Create a pending allocation, through the function applications call
        (``hubd_v1.request``, docs/api.md).

        With ``conn``, the row is written on the caller's connection: inside the caller's
        transaction it is invisible, and no daemon is woken, until that transaction commits.
        A key already used returns its allocation; one used for another request raises
        :class:`~hubd.errors.IdempotencyConflict`.
        """
        row = await self._db.fetchrow(
            "request allocation",
            SQL.insert_allocation(
                provisioner_id=validate_provisioner_id(provisioner_id),
                tenant_id=validate_label("tenant_id", tenant_id),
                session_id=validate_label("session_id", session_id),
                spec=json.dumps(validate_spec(spec)),
                idempotency_key=validate_label("idempotency_key", idempotency_key),
                ready_when=ready_when,
                instance_id=self.instance_id,
            ),
            conn=conn,
        )
        assert row is not None
        return Allocation.from_row(row)

    async def release(
        self,
        allocation_id: str,
        *,
        reason: str = "release requested",
        conn: asyncpg.Connection | None = None,
    ) -> Allocation:
        """Give an allocation up; idempotent. Returns the row as it now stands."""
        validate_allocation_id(allocation_id)
        row = await self._db.fetchrow(
            "release allocation",
            SQL.release_allocation(
                allocation_id=allocation_id,
                instance_id=self.instance_id,
                reason=bounded_message(reason),
            ),
            conn=conn,
        )
        assert row is not None
        return Allocation.from_row(row)

    # -- reads -------------------------------------------------------------------------------

    async def get(
        self, allocation_id: str, *, conn: asyncpg.Connection | None = None
    ) -> Allocation:
        validate_allocation_id(allocation_id)
        row = await self._db.fetchrow(
            "get allocation", SQL.get_allocation(allocation_id=allocation_id), conn=conn
        )
        if row is None:
            raise AllocationNotFound(f"no allocation {allocation_id}")
        return Allocation.from_row(row)

    async def list_active(self) -> list[Allocation]:
        return await self._fetch_all("list active allocations", SQL.list_active())

    async def list_allocations(
        self, *, status: Status | None = None, limit: int = 1000
    ) -> list[Allocation]:
        return await self._fetch_all(
            "list allocations",
            SQL.list_allocations(status=str(status) if status else None, limit=limit),
        )

    # -- claims and leases -------------------------------------------------------------------

    async def claim_due(
        self,
        *,
        lease_ids: Sequence[str],
        lease_duration: float,
        exclude: Iterable[str] = (),
        binds: InitialBinds | None = None,
    ) -> list[Claimed]:
        """Lease up to ``len(lease_ids)`` due active allocations whose ids are not in
        ``exclude``, oldest first, in one statement; each with the lease id it was given. With
        ``binds``, the pending rows among them whose provisioner it names are bound in the same
        statement (``Claimed.ensure_intent`` says which)."""
        if not lease_ids:
            return []
        if binds is not None and not (
            len(binds.sidecar_ids) == len(binds.token_hashes) == len(lease_ids)
        ):
            raise ValueError("claim: one identity and token hash per lease id")
        rows = await self._db.fetch(
            "claim",
            SQL.claim_due(
                lease_ids=list(lease_ids),
                effect_ids=[new_effect_id() for _ in lease_ids],
                sidecar_ids=[] if binds is None else list(binds.sidecar_ids),
                token_hashes=[] if binds is None else list(binds.token_hashes),
                bindings=json.dumps(
                    {}
                    if binds is None
                    else {
                        k: [*v, binds.ready_when.get(k, "connected")]
                        for k, v in binds.provisioners.items()
                    }
                ),
                connect_timeout=0.0 if binds is None else float(binds.connect_timeout),
                instance_id=self.instance_id,
                lease_duration=float(lease_duration),
                exclude=sorted(set(exclude)),
            ),
        )
        return [
            Claimed(
                allocation=Allocation.from_row(row),
                lease_id=row["lease_id"],
                open_effects=row["open_effects"],
                destroy_intent=row["destroy_effect_id"],
                ensure_intent=row["ensure_effect_id"],
            )
            for row in rows
        ]

    async def renew_leases(
        self, leases: Iterable[tuple[str, str]], lease_duration: float
    ) -> frozenset[str]:
        """Extend every (allocation, lease) pair still held and live, in one statement; the
        allocations renewed. Runs on the lease pool, so renewals never queue behind slow work.
        """
        pairs = sorted(set(leases))
        if not pairs:
            return frozenset()
        rows = await self._db.fetch(
            "renew leases",
            SQL.renew_leases(
                allocation_ids=[aid for aid, _ in pairs],
                lease_ids=[lease for _, lease in pairs],
                lease_duration=float(lease_duration),
            ),
            pool=Pool.LEASE,
        )
        return frozenset(row["id"] for row in rows)

    async def renew_lease(self, allocation_id: str, lease_id: str, lease_duration: float) -> bool:
        """Extend one live lease; ``False`` when it is no longer ours or already expired."""
        renewed = await self.renew_leases([(allocation_id, lease_id)], lease_duration)
        return allocation_id in renewed

    async def drop_lease(self, allocation_id: str, lease_id: str) -> bool:
        """Give a lease back unchanged otherwise; ``False`` when it was no longer ours."""
        row = await self._db.fetchrow(
            "drop lease",
            SQL.drop_lease(
                allocation_id=allocation_id, lease_id=lease_id, instance_id=self.instance_id
            ),
        )
        return row is not None

    async def give_back_lease(self, allocation_id: str, lease_id: str) -> bool:
        """End ``lease_id`` early, leaving the row (its open intents too) as an expired lease
        would; ``False`` when it was no longer ours."""
        row = await self._db.fetchrow(
            "give back lease",
            SQL.give_back_lease(allocation_id=allocation_id, lease_id=lease_id),
        )
        return row is not None

    # -- fenced transitions --------------------------------------------------------------------

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
        (``endpoint`` and ``metadata`` fill only what the sidecar has not published)."""
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
        effects: Effects = (),
    ) -> Allocation | None:
        return await self._fenced(
            "begin replacement",
            SQL.begin_replacement,
            fence,
            effects,
            expected_status=str(expected_status),
            delay=float(delay),
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

    # -- connection events and repair (not claim-owned) ------------------------------------------

    async def wake(self, allocation_id: str, generation: int) -> bool:
        """Make the allocation due now and notify the daemons; ``False`` if nothing changed."""
        woken: bool = await self._db.fetchval(
            "wake", SQL.wake(allocation_id=allocation_id, generation=generation)
        )
        return woken

    async def mark_unconnected(self, *, instance_ttl: float, connect_timeout: float) -> int:
        """Repair allocated rows that read ready, or are scheduled for nothing, although no
        live connection record exists; returns how many were repaired."""
        return len(
            await self._fetch_all(
                "mark unconnected",
                SQL.mark_unconnected(
                    instance_ttl=float(instance_ttl),
                    connect_timeout=float(connect_timeout),
                    instance_id=self.instance_id,
                ),
            )
        )

    # -- plumbing ---------------------------------------------------------------------------------

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

    async def _fetch_all(self, what: str, query: Bound) -> list[Allocation]:
        return [Allocation.from_row(row) for row in await self._db.fetch(what, query)]
