"""Keeping a claim's lease alive, and noticing when it can no longer be trusted.

One keeper per claim renews every ``lease_duration / 3``. It also keeps a local deadline on the
monotonic clock, counted from the *start* of the last successful renewal: the database granted
the lease during that request, so counting from the answer would stretch ownership by the
answer's transit time. When the deadline passes, or a renewal is refused or fails, the keeper
reports the lease lost; it never writes anything else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from hubd.errors import LeaseLost
from hubd.reconciler.clock import Clock, wait_settled

__all__ = ["LeaseKeeper"]

Spawn = Callable[[Coroutine[Any, Any, bool]], "asyncio.Task[bool]"]


class LeaseKeeper:
    def __init__(
        self,
        *,
        renew: Callable[[], Coroutine[Any, Any, bool]],
        clock: Clock,
        lease_duration: float,
        started: float,
        spawn: Spawn,
        on_lost: Callable[[LeaseLost], None],
    ) -> None:
        self._renew = renew
        self._clock = clock
        self._lease_duration = lease_duration
        self._spawn = spawn
        self._on_lost = on_lost
        self.deadline = started + lease_duration
        self.lost: LeaseLost | None = None

    @property
    def expired(self) -> bool:
        return self._clock.monotonic() >= self.deadline

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = LeaseLost(reason)
            self._on_lost(self.lost)

    async def run(self) -> None:
        """Renew until cancelled or until the lease is lost."""
        interval = self._lease_duration / 3
        next_renewal = self._clock.monotonic() + interval
        while self.lost is None:
            await self._clock.sleep(min(next_renewal, self.deadline) - self._clock.monotonic())
            if self.expired:
                self._lose("the local lease deadline passed")
                return
            if self._clock.monotonic() < next_renewal:
                continue
            started = self._clock.monotonic()
            # The renewal runs as its own tracked task: a request that hangs past the deadline
            # is abandoned here but still accounted for until it settles.
            renewal = self._spawn(self._renew())
            try:
                settled = await wait_settled(self._clock, renewal, self.deadline - started)
            except asyncio.CancelledError:
                renewal.cancel()
                raise
            if not settled:
                renewal.cancel()
                self._lose("lease renewal did not answer before the local deadline")
                return
            error = renewal.exception()
            if error is not None:
                self._lose(f"lease renewal failed: {error}")
                return
            if not renewal.result() or self.expired:
                self._lose("lease renewal was refused")
                return
            self.deadline = started + self._lease_duration
            next_renewal = started + interval
