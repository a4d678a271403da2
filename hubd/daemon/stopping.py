"""Being asked to stop: once (finish in order), or twice (stop waiting, stop now).

SIGTERM or SIGINT asks once: stop claiming, give claims in progress and the stop hook
``shutdown_grace``. Asked again (an operator pressing Ctrl-C twice), every wait still in progress
is cut short.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any

import structlog

from hubd.aio import run_unless
from hubd.plugins.protocol import ListsSidecars, Provisioner

__all__ = ["Stopping", "say_what_keeps_running"]

log = structlog.get_logger(__name__)


class Stopping:
    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self._hurry = asyncio.Event()
        """Set by a second stop signal: stop waiting for claims and stop hooks, stop now."""

    def stop(self) -> None:
        """Ask to shut down; asked again, stop without waiting."""
        if self.requested.is_set():
            if not self._hurry.is_set():
                log.warning("second_stop_signal_stopping_now")
            self._hurry.set()
        self.requested.set()

    @property
    def hurried(self) -> bool:
        """Whether a second stop signal cut the shutdown short."""
        return self._hurry.is_set()

    async def unless_hurried(self, work: Coroutine[Any, Any, Any], limit: float) -> bool:
        """Await ``work`` for at most ``limit`` seconds, or until a second stop signal; cancel
        it then. ``True`` when it finished in time (its exceptions propagate)."""
        return await run_unless(self._hurry, work, limit=limit)


async def say_what_keeps_running(provisioners: Mapping[str, Provisioner]) -> None:
    """Sidecars outlive the daemon on purpose (they reconnect to the next one); an operator
    who stopped hubd should hear that they are still there."""
    for provisioner_id, provisioner in sorted(provisioners.items()):
        if not isinstance(provisioner, ListsSidecars):
            continue
        try:
            async with asyncio.timeout(5):
                running = len(await provisioner.list_sidecars())
        except Exception as exc:  # noqa: BLE001 -- a plugin's failure must not spoil the stop
            log.debug("sidecars_not_listed_at_stop", provisioner=provisioner_id, error=str(exc))
            continue
        if running:
            log.info(
                "sidecars_keep_running",
                hint="they reconnect to the next hubd, and `hubd alloc release ID` stops one "
                "for good",
                provisioner=provisioner_id,
                sidecars=running,
            )
