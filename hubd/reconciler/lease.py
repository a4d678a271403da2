"""Keeping claims' leases alive, and noticing when one can no longer be trusted.

Each claim has a :class:`LeaseKeeper`: a local deadline on the monotonic clock, counted from the
*start* of the last successful renewal (the database granted the lease during that request, so
counting from the answer would stretch ownership by the answer's transit time). The keeper
reports the lease lost when that deadline passes, or when a renewal is refused or fails; it
never writes anything.

One :class:`LeaseRenewer` per reconciler renews every lease it holds in one statement every
``lease_duration / 3``, as River and Oban renew by node: the cost is one statement per interval
whatever the number of claims, and none when there are none. A claim admitted between two
rounds is renewed at the next one, well inside its first lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol, TypeVar

from hubd.errors import LeaseLost
from hubd.reconciler.clock import Clock, Timer, wait_settled

__all__ = ["LeaseKeeper", "LeaseRenewer"]

T = TypeVar("T")
RenewMany = Callable[[list[tuple[str, str]]], Coroutine[Any, Any, frozenset[str]]]


class Spawn(Protocol):
    """Starts a tracked task."""

    def __call__(self, coro: Coroutine[Any, Any, T], /, *, name: str) -> asyncio.Task[T]: ...


class LeaseKeeper:
    """One claim's lease as this process knows it."""

    def __init__(
        self,
        *,
        allocation_id: str,
        lease_id: str,
        clock: Clock,
        lease_duration: float,
        started: float,
        on_lost: Callable[[LeaseLost], None],
    ) -> None:
        self.allocation_id = allocation_id
        self.lease_id = lease_id
        self._clock = clock
        self._lease_duration = lease_duration
        self._on_lost = on_lost
        self.deadline = started + lease_duration
        self.lost: LeaseLost | None = None
        self.renewing = False
        """A renewal that includes this lease is in flight."""
        self._timer: Timer | None = None

    @property
    def expired(self) -> bool:
        return self._clock.monotonic() >= self.deadline

    def renewed(self, started: float) -> None:
        """The database extended the lease in a request that started at ``started``."""
        if self.lost is None and started + self._lease_duration > self.deadline:
            self.deadline = started + self._lease_duration

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = LeaseLost(reason)
            self._on_lost(self.lost)

    def watch(self) -> None:
        """Watch the local deadline from now on, until :meth:`stop` or the loss: a timer on the
        clock, not a task (a claim is short, and a task per claim cost more than the claim's
        own steps)."""
        if self.lost is None and self._timer is None:
            self._timer = self._clock.call_at(self.deadline, self._check)

    def stop(self) -> None:
        """Stop watching the deadline, and stop reporting a loss: the claim has ended. The
        callback goes too. It refers to the claim, which refers to this keeper: dropped here,
        that cycle no longer waits for the garbage collector, and a claim's objects are freed
        as it ends."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_lost = _ignore_loss

    def _check(self) -> None:
        self._timer = None
        if self.lost is not None:
            return
        if not self.expired:
            # Renewed since the timer was set: watch the new deadline.
            self.watch()
            return
        self.lose(
            "lease renewal did not answer before the local deadline"
            if self.renewing
            else "the local lease deadline passed"
        )


def _ignore_loss(_cause: LeaseLost) -> None:
    """The loss callback of a stopped keeper."""


class LeaseRenewer:
    """Renews the leases of every registered keeper, all in one statement per round."""

    def __init__(
        self,
        *,
        renew_many: RenewMany,
        clock: Clock,
        lease_duration: float,
        spawn: Spawn,
    ) -> None:
        self._renew_many = renew_many
        self._clock = clock
        self._interval = lease_duration / 3
        self._spawn = spawn
        self._keepers: dict[str, LeaseKeeper] = {}
        self._loop: asyncio.Task[None] | None = None

    def register(self, keeper: LeaseKeeper) -> None:
        """Renew ``keeper``'s lease from the next round on; the rounds run while any lease is
        registered, so an idle reconciler sends nothing."""
        self._keepers[keeper.allocation_id] = keeper
        if self._loop is None:
            self._loop = self._spawn(self._run(), name="lease renewals")

    def unregister(self, keeper: LeaseKeeper) -> None:
        if self._keepers.get(keeper.allocation_id) is keeper:
            del self._keepers[keeper.allocation_id]
        if not self._keepers and self._loop is not None:
            # Nothing left to renew: stop now rather than at the next round, so a drained
            # reconciler has no task left waiting on the clock.
            self._loop.cancel()
            self._loop = None

    async def _run(self) -> None:
        try:
            while self._keepers:
                await self._clock.sleep(self._interval)
                await self.renew_round()
        finally:
            # No await between the emptiness check and this: a keeper registered from now on
            # starts a new loop.
            self._loop = None

    async def renew_round(self) -> None:
        """Renew every live registered lease once; keepers whose lease the database no longer
        grants, or whose renewal fails, are told they lost it."""
        keepers = [k for k in self._keepers.values() if k.lost is None and not k.expired]
        if not keepers:
            return
        started = self._clock.monotonic()
        for keeper in keepers:
            keeper.renewing = True
        # The request runs as its own tracked task; it is given up once the last of its leases
        # is past its local deadline (each keeper loses at its own deadline meanwhile).
        leases = [(k.allocation_id, k.lease_id) for k in keepers]
        renewal = self._spawn(self._renew_many(leases), name="lease renewal")
        try:
            limit = max(k.deadline for k in keepers) - started
            settled = await wait_settled(self._clock, renewal, limit)
        except asyncio.CancelledError:
            renewal.cancel()
            raise
        finally:
            for keeper in keepers:
                keeper.renewing = False
        if not settled:
            renewal.cancel()
            _lose_all(keepers, "lease renewal did not answer before the local deadline")
            return
        error = renewal.exception()
        if error is not None:
            _lose_all(keepers, f"lease renewal failed: {error}")
            return
        granted = renewal.result()
        for keeper in keepers:
            if keeper.allocation_id in granted and not keeper.expired:
                keeper.renewed(started)
            else:
                keeper.lose("lease renewal was refused")


def _lose_all(keepers: Iterable[LeaseKeeper], reason: str) -> None:
    for keeper in keepers:
        keeper.lose(reason)
