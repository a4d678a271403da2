"""Orphan collection: destroying what provisioners run that belongs to no current generation.

Fences keep hubd's own writes safe, but a provisioner's effect can still leak: a daemon paused
mid-``ensure`` that resumed after its lease, a plugin that ignored :meth:`Ownership.still_owned`,
a destroy that reported success while something lingered. Provisioners that can list what they
run (:class:`~hubd.plugins.protocol.ListsSidecars`) are swept: a sidecar that is not the current
sidecar of an active allocation, seen so sweep after sweep for the grace period, is destroyed
(or only reported, in dry-run mode). One replica sweeps a provisioner at a time (a row lock in
``hubd_sweep_locks``); a sidecar naming an allocation this database does not know is only
reported unless the operator says otherwise, since it may belong to another deployment sharing
the infrastructure.

:func:`judge` is the rule, a pure function; :class:`OrphanCollector` carries it out.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

import attrs
import structlog

from hubd.errors import StoreError
from hubd.plugins.protocol import (
    Destroyed,
    DestroyRequest,
    ListsSidecars,
    Ownership,
    Provisioner,
    RunningSidecar,
    check_destroy_result,
)
from hubd.reconciler.clock import Clock, SystemClock
from hubd.store.allocations import AllocationStore
from hubd.store.ledger import LedgerStore
from hubd.store.rows import Phase

__all__ = ["OrphanCollector", "SweepReport", "Verdict", "judge"]

log = structlog.get_logger(__name__)


class Verdict(enum.Enum):
    KEEP = "keep"
    """The current sidecar of an active allocation."""
    WAIT = "wait"
    """An orphan, but not yet for the whole grace period."""
    DESTROY = "destroy"
    REPORT = "report"
    """An orphan that is reported but not destroyed (dry-run, or an unknown allocation)."""


def judge(
    *,
    current: bool,
    known: bool,
    orphan_for: float,
    grace: float,
    dry_run: bool,
    destroy_unknown: bool,
) -> Verdict:
    """What to do with one listed sidecar, seen as an orphan for ``orphan_for`` seconds."""
    if current:
        return Verdict.KEEP
    if orphan_for < grace:
        return Verdict.WAIT
    if dry_run or (not known and not destroy_unknown):
        return Verdict.REPORT
    return Verdict.DESTROY


@attrs.define
class SweepReport:
    listed: int = 0
    orphans: int = 0
    destroyed: int = 0
    reported: int = 0
    failed: int = 0
    gone: int = 0
    """Destroyed, but the provisioner removed nothing: already gone (another replica's sweep,
    an operator). Neither counted destroyed nor recorded."""
    skipped: bool = False
    """Another replica held the provisioner's sweep lock."""


class OrphanCollector:
    """Sweeps provisioners that can list their sidecars; keeps, per sidecar, since when it has
    been seen as an orphan (forgotten as soon as it is not)."""

    def __init__(
        self,
        *,
        store: AllocationStore,
        ledger: LedgerStore,
        grace: float,
        dry_run: bool = False,
        destroy_unknown: bool = False,
        operation_timeout: float = 30.0,
        clock: Clock | None = None,
        on_orphan: Callable[[str, str], None] = lambda _provisioner, _verdict: None,
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._grace = grace
        self._dry_run = dry_run
        self._destroy_unknown = destroy_unknown
        self._operation_timeout = operation_timeout
        self._clock = clock or SystemClock()
        self._on_orphan = on_orphan
        self._first_seen: dict[tuple[str, str], float] = {}
        self._reported: set[tuple[str, str]] = set()

    async def sweep_all(self, provisioners: Mapping[str, Provisioner]) -> dict[str, SweepReport]:
        reports = {}
        for provisioner_id, provisioner in sorted(provisioners.items()):
            if isinstance(provisioner, ListsSidecars):
                reports[provisioner_id] = await self.sweep(provisioner)
        return reports

    async def sweep(self, provisioner: Provisioner) -> SweepReport:
        report = SweepReport()
        assert isinstance(provisioner, ListsSidecars)
        async with self._store.sweep_lock(provisioner.id) as lock:
            if lock is None:
                report.skipped = True
                return report
            try:
                async with asyncio.timeout(self._operation_timeout):
                    listed = list(await provisioner.list_sidecars())
                _check_listing(listed)
            except Exception as exc:  # noqa: BLE001 -- a plugin's failure skips one sweep
                log.warning(
                    "orphan_sweep_listing_failed",
                    provisioner=provisioner.id,
                    error=f"{type(exc).__name__}: {exc}",
                )
                report.failed += 1
                return report
            report.listed = len(listed)
            owners = await self._store.sidecar_owners(
                [(s.sidecar_id, s.allocation_id) for s in listed]
            )
            now = self._clock.monotonic()
            seen_now: set[tuple[str, str]] = set()
            for sidecar in listed:
                key = (provisioner.id, sidecar.sidecar_id)
                current, known = owners.get(sidecar.sidecar_id, (False, False))
                if current:
                    continue
                seen_now.add(key)
                report.orphans += 1
                first = self._first_seen.setdefault(key, now)
                verdict = judge(
                    current=current,
                    known=known,
                    orphan_for=now - first,
                    grace=self._grace,
                    dry_run=self._dry_run,
                    destroy_unknown=self._destroy_unknown,
                )
                if verdict is Verdict.REPORT:
                    report.reported += 1
                    if key not in self._reported:
                        self._reported.add(key)
                        await self._report(provisioner, sidecar, known=known)
                elif verdict is Verdict.DESTROY:
                    # Ownership of this destroy is the sweep lock: lost with its connection.
                    ownership = Ownership(
                        still_owned=lambda: not lock.is_closed(),
                        deadline=lambda: float("inf"),
                        deadline_utc=lambda: _FAR_FUTURE,
                    )
                    outcome = await self._destroy(provisioner, sidecar, ownership)
                    if outcome is _Outcome.REMOVED:
                        report.destroyed += 1
                    elif outcome is _Outcome.GONE:
                        report.gone += 1
                    else:
                        report.failed += 1
            for key in [k for k in self._first_seen if k[0] == provisioner.id]:
                if key not in seen_now:
                    del self._first_seen[key]
                    self._reported.discard(key)
        return report

    async def _report(
        self, provisioner: Provisioner, sidecar: RunningSidecar, *, known: bool
    ) -> None:
        why = "dry-run" if self._dry_run else "its allocation is unknown to this database"
        log.warning(
            "orphan_sidecar_found",
            provisioner=provisioner.id,
            sidecar_id=sidecar.sidecar_id,
            allocation_id=sidecar.allocation_id,
            generation=sidecar.generation,
            not_destroyed_because=why,
        )
        self._on_orphan(provisioner.id, "reported")
        if known and sidecar.allocation_id is not None:
            await self._evidence(
                sidecar, "orphan_found", Phase.COMMITTED, None, f"not destroyed: {why}"
            )

    async def _destroy(
        self, provisioner: Provisioner, sidecar: RunningSidecar, ownership: Ownership
    ) -> _Outcome:
        request = DestroyRequest(
            allocation_id=sidecar.allocation_id or "",
            generation=sidecar.generation or 0,
            sidecar_id=sidecar.sidecar_id,
            external_ref=sidecar.external_ref,
            ownership=ownership,
        )
        code: str | None = None
        message = "belongs to no current generation"
        try:
            async with asyncio.timeout(self._operation_timeout):
                result = check_destroy_result(await provisioner.destroy(request))
        except TimeoutError:
            result, code, message = None, "destroy_timeout", "destroy did not finish in time"
        except Exception as exc:  # noqa: BLE001 -- a plugin's failure is an outcome
            result, code, message = None, "destroy_failed", f"{type(exc).__name__}: {exc}"
        if result is not None and not isinstance(result, Destroyed):
            code, message = result.code, result.message
        ok = isinstance(result, Destroyed)
        if isinstance(result, Destroyed) and result.removed is False:
            # Nothing was removed. Were it counted, metered and recorded as destroyed, a
            # sidecar the destroy cannot reach (listed by one handle, sought by another) would
            # be "destroyed" again after every grace period while it kept running.
            log.info(
                "orphan_sidecar_already_gone",
                provisioner=provisioner.id,
                sidecar_id=sidecar.sidecar_id,
                allocation_id=sidecar.allocation_id,
                generation=sidecar.generation,
            )
            self._first_seen.pop((provisioner.id, sidecar.sidecar_id), None)
            return _Outcome.GONE
        log.warning(
            "orphan_sidecar_destroyed" if ok else "orphan_sidecar_not_destroyed",
            provisioner=provisioner.id,
            sidecar_id=sidecar.sidecar_id,
            allocation_id=sidecar.allocation_id,
            generation=sidecar.generation,
            code=code,
        )
        self._on_orphan(provisioner.id, "destroyed" if ok else "failed")
        if sidecar.allocation_id is not None:
            phase = Phase.COMMITTED if ok else Phase.FAILED
            await self._evidence(sidecar, "orphan_destroyed", phase, code, message)
        if ok:
            self._first_seen.pop((provisioner.id, sidecar.sidecar_id), None)
        return _Outcome.REMOVED if ok else _Outcome.FAILED

    async def _evidence(
        self,
        sidecar: RunningSidecar,
        kind: str,
        phase: Phase,
        code: str | None,
        message: str,
    ) -> None:
        assert sidecar.allocation_id is not None
        try:
            await self._ledger.record_orphan(
                sidecar.allocation_id,
                sidecar_id=sidecar.sidecar_id,
                generation=sidecar.generation,
                kind=kind,
                phase=phase,
                error_code=code,
                message=message,
            )
        except StoreError as exc:
            log.warning("orphan_evidence_not_written", error=str(exc))


_FAR_FUTURE = datetime.max.replace(tzinfo=UTC)


class _Outcome(enum.Enum):
    REMOVED = "removed"
    """Destroyed, the provisioner removing something or not saying."""
    GONE = "gone"
    FAILED = "failed"


def _check_listing(listed: list[RunningSidecar]) -> None:
    # Plugins are code hubd does not control: a listing of the wrong type is an error.
    for item in listed:
        if not isinstance(item, RunningSidecar):
            raise TypeError(f"list_sidecars returned {type(item).__name__}, not RunningSidecar")
