"""Each provisioner's word on dead sidecars, written as it comes (architecture §5, "Sidecar
exits").

One loop per provisioner that can watch its sidecars (:class:`~hubd.plugins.protocol.
WatchesSidecars`): each death it reports is written at once
(:meth:`~hubd.store.allocations.AllocationStore.report_exits`), so the allocation's claim
replaces the sidecar now, with its exit code and output in the ledger, instead of waiting out
``connect_timeout`` for a connection that cannot come. The write is fenced on the generation
and the sidecar: a report of a sidecar hubd destroyed itself matches nothing. While the
provisioner cannot reach what it watches, the loop says so (metrics and ``/readyz``) and calls
it again after a backoff; the connect deadline stays the fallback for whatever dies meanwhile.
No loop writes for another replica's sidecars only: every replica serving a provisioner watches
it, and the second report of one death matches nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Final

import attrs
import structlog

from hubd.aio import raise_if_cancelled
from hubd.backoff import Retries
from hubd.daemon.metrics import Metrics
from hubd.errors import PluginError, StoreError
from hubd.plugins.protocol import SidecarExit, WatchesSidecars, check_sidecar_exit
from hubd.redaction import describe_error
from hubd.store.allocations import AllocationStore
from hubd.store.rows import SidecarDeath

__all__ = ["ExitWatch", "WatchState"]

log = structlog.get_logger(__name__)

REPORT_ATTEMPTS: Final = 3
"""Tries to write one death while the database is away; after them the death is left to the
connect deadline (and to the next call's look at what died while nobody watched)."""
_MAX_CODE: Final = 40


@attrs.frozen
class WatchState:
    """Whether the loop follows its provisioner now, replaced whole (``/readyz`` reads it from
    another thread). ``failure`` is the code of the last failure while not following; ``since``
    the monotonic time the state began."""

    following: bool = False
    failure: str | None = None
    since: float = attrs.field(factory=time.monotonic)

    def describe(self, provisioner_id: str) -> str | None:
        """A line for ``/readyz`` while not following; ``None`` while following."""
        if self.following:
            return None
        what = "not followed yet" if self.failure is None else f"unreachable ({self.failure})"
        return (
            f"provisioner {provisioner_id}: sidecar deaths {what} for "
            f"{time.monotonic() - self.since:.0f}s; they are noticed at connect_timeout"
        )


class ExitWatch:
    """The loop over one provisioner's :meth:`~hubd.plugins.protocol.WatchesSidecars.
    watch_sidecars`."""

    def __init__(
        self,
        provisioner_id: str,
        provisioner: WatchesSidecars,
        store: AllocationStore,
        metrics: Metrics,
        *,
        timeout: float,
        retries: Retries | None = None,
    ) -> None:
        self.provisioner_id = provisioner_id
        self._provisioner = provisioner
        self._store = store
        self._metrics = metrics
        self._timeout = timeout
        self._retries = retries or Retries.doubling(1.0, 30.0)
        self.state = WatchState()
        self._log = log.bind(provisioner=provisioner_id)
        metrics.watch_up.labels(provisioner=provisioner_id).set(0)

    async def run(self) -> None:
        """Follow forever; after each failure, call the provisioner again after a backoff.
        Never raises but for cancellation: a plugin's failure is an outcome, not a crash."""
        while True:
            raise_if_cancelled()
            code = await self._follow()
            self._set(WatchState(following=False, failure=code))
            self._metrics.watch_failures.labels(provisioner=self.provisioner_id, code=code).inc()
            await asyncio.sleep(self._retries.next_delay())

    async def _follow(self) -> str:
        """One call of the provisioner's watch, to its end; the code of how it ended."""
        try:
            async with _closing(self._provisioner.watch_sidecars()) as stream:
                async for item in stream:
                    if not self.state.following:
                        self._set(WatchState(following=True))
                        self._retries.reset()
                        self._log.info("sidecar_watch_following")
                    if item is not None:
                        await self._reported(item)
        except PluginError as exc:
            code = getattr(exc, "code", None)
            code = code[:_MAX_CODE] if isinstance(code, str) and code else "plugin_error"
            self._log.warning("sidecar_watch_failed", code=code, error=describe_error(exc))
            return code
        except Exception as exc:  # noqa: BLE001 -- a plugin's bug must not end the daemon
            self._log.error(
                "sidecar_watch_crashed", error_type=type(exc).__name__, error=describe_error(exc)
            )
            return "watch_crashed"
        self._log.warning("sidecar_watch_ended")
        return "watch_ended"

    async def _reported(self, item: SidecarExit) -> None:
        try:
            exit_ = check_sidecar_exit(item)
        except PluginError as exc:
            self._log.warning("sidecar_exit_malformed", error=str(exc))
            return
        death = SidecarDeath(
            exit_.allocation_id, exit_.generation, exit_.sidecar_id, exit_.describe()
        )
        for attempt in range(REPORT_ATTEMPTS):
            try:
                async with asyncio.timeout(self._timeout):
                    written = await self._store.report_exits([death])
            except (StoreError, TimeoutError) as exc:
                self._log.warning(
                    "sidecar_exit_not_written",
                    allocation_id=death.allocation_id,
                    generation=death.generation,
                    attempt=attempt + 1,
                    error=describe_error(exc),
                )
                await asyncio.sleep(float(2**attempt))
                continue
            if written:
                self._metrics.sidecar_exits.labels(
                    provisioner=self.provisioner_id, reason=exit_.reason
                ).inc()
                self._log.warning(
                    "sidecar_died",
                    allocation_id=death.allocation_id,
                    generation=death.generation,
                    reason=exit_.reason,
                    exit_code=exit_.exit_code,
                )
            return

    def _set(self, state: WatchState) -> None:
        self.state = state
        self._metrics.watch_up.labels(provisioner=self.provisioner_id).set(
            1 if state.following else 0
        )


@contextlib.asynccontextmanager
async def _closing(
    stream: AsyncIterator[SidecarExit | None],
) -> AsyncIterator[AsyncIterator[SidecarExit | None]]:
    """The stream, closed on the way out (an async generator's ``aclose``), so a plugin's
    connection to what it watches ends with the loop."""
    try:
        yield stream
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()
