"""Natural batching: requests that arrive while a statement runs go together in the next one.

A handshake storm makes the listener ask the database the same question for many keys at
once. Each statement costs a round trip whatever it carries, so one statement for every key
that arrived meanwhile costs little more than one for a single key. No timer decides when a
batch goes: the first request finds nothing running and goes at once (no added latency at low
load), and whatever arrives while its statement runs waits for the next one, which starts as
soon as the first is done. With ``concurrency`` above one, that many statements may run at
once (as many as the pool has connections): requests queue only while all of them run.

Each request keeps its own bounds: at most ``max_waiting`` wait at once (a request beyond that
raises :class:`~hubd.errors.BatchFull` at once, the listener answers 503), and a request that
times out or is cancelled leaves the batch without disturbing the others; its answer is
dropped. An error of a batch's statement reaches every request still waiting for it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Generic, TypeVar

from hubd.errors import BatchFull

__all__ = ["Batcher"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Batcher(Generic[K, V]):
    """Runs ``run`` over the keys requested while its previous call ran; ``None`` for a key
    that ``run`` left out of its answer."""

    def __init__(
        self,
        run: Callable[[list[K]], Awaitable[Mapping[K, V]]],
        *,
        name: str,
        timeout: float,
        max_batch: int = 64,
        max_waiting: int = 256,
        concurrency: int = 1,
    ) -> None:
        """``timeout`` bounds each request (its wait and its statement together), and each
        statement: past it, no request is left waiting for the answer."""
        self._run = run
        self._name = name
        self._timeout = timeout
        self._max_batch = max_batch
        self._max_waiting = max_waiting
        self._concurrency = concurrency
        # Waiting requests by key, in arrival order; a key asked twice is asked once.
        self._waiting: dict[K, list[asyncio.Future[V | None]]] = {}
        self._count = 0
        self._running = 0
        self._runners: set[asyncio.Task[None]] = set()
        # Every request has the same timeout, so deadlines come due in the order requests
        # arrived: one timer, set for the oldest request still waiting, fails each future in
        # turn. A storm's requests then cost no timer each, nor a timeout block's
        # cancel-and-uncancel of their tasks.
        self._deadlines: collections.deque[tuple[float, asyncio.Future[V | None]]] = (
            collections.deque()
        )
        self._expiry: asyncio.TimerHandle | None = None
        self.batches = 0
        """Statements run so far (each carries one or more keys)."""
        self.carried = 0
        """Requests those statements answered or failed (their mean size: carried / batches)."""

    @property
    def name(self) -> str:
        return self._name

    @property
    def waiting(self) -> int:
        """Requests waiting for the next statement."""
        return self._count

    @property
    def running(self) -> int:
        """Requests the running statements carry (left ones included)."""
        return self._running

    async def request(self, key: K) -> V | None:
        """``run``'s answer for ``key``, from the next statement to start.

        Raises what that statement raised, :class:`TimeoutError` past ``timeout`` and
        :class:`~hubd.errors.BatchFull` when too many requests wait already.
        """
        if self._count >= self._max_waiting:
            raise BatchFull()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[V | None] = loop.create_future()
        self._waiting.setdefault(key, []).append(future)
        self._count += 1
        if len(self._runners) < self._concurrency:
            # Owned here and awaited by close(); each ends on its own once nobody waits.
            self._runners.add(loop.create_task(self._drain(), name=self._name))
        deadlines = self._deadlines
        # Answered requests leave from the front (statements answer in arrival order), so the
        # queue holds about as many as wait, not every request of the last ``timeout``.
        while deadlines and deadlines[0][1].done():
            deadlines.popleft()
        deadlines.append((loop.time() + self._timeout, future))
        if self._expiry is None:
            self._expire_due()
        try:
            return await future
        finally:
            # Timed out or cancelled before its batch was taken: leave the queue, so the key
            # is not asked for nobody and the slot counts for someone else.
            self._forget(key, future)

    def _expire_due(self) -> None:
        """Fail the futures whose deadline has passed; set the timer for the next one."""
        self._expiry = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadlines = self._deadlines
        while deadlines:
            deadline, future = deadlines[0]
            if not future.done():
                if deadline > now:
                    self._expiry = loop.call_at(deadline, self._expire_due)
                    return
                future.set_exception(TimeoutError())
            deadlines.popleft()

    async def close(self) -> None:
        """Cancel the running statements, if any, and every waiting request."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        runners = list(self._runners)
        for runner in runners:
            runner.cancel()
        # A cancelled runner has nothing else to report; one cancelled before it started
        # never reached its own clean-up.
        await asyncio.gather(*runners, return_exceptions=True)
        self._runners.difference_update(runners)
        for futures in self._waiting.values():
            for future in futures:
                future.cancel()

    def _forget(self, key: K, future: asyncio.Future[V | None]) -> None:
        futures = self._waiting.get(key)
        if futures is None or future not in futures:
            return
        futures.remove(future)
        self._count -= 1
        if not futures:
            del self._waiting[key]

    def _take(self) -> dict[K, list[asyncio.Future[V | None]]]:
        batch: dict[K, list[asyncio.Future[V | None]]] = {}
        for key in list(self._waiting)[: self._max_batch]:
            batch[key] = futures = self._waiting.pop(key)
            self._count -= len(futures)
        return batch

    async def _drain(self) -> None:
        try:
            await self._run_batches()
        finally:
            # Here, not in a done callback: between the last look at the queue and this line
            # nothing else runs, so a request never finds a runner that will take nothing more.
            current = asyncio.current_task()
            if current is not None:
                self._runners.discard(current)

    async def _run_batches(self) -> None:
        while self._waiting:
            batch = self._take()
            self.batches += 1
            carried = sum(len(futures) for futures in batch.values())
            self.carried += carried
            self._running += carried
            try:
                async with asyncio.timeout(self._timeout):
                    answers = await self._run(list(batch))
            except Exception as exc:  # noqa: BLE001 -- handed to each waiter to raise
                for futures in batch.values():
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                continue
            except asyncio.CancelledError:
                for futures in batch.values():
                    for future in futures:
                        future.cancel()
                raise
            finally:
                self._running -= carried
            for key, futures in batch.items():
                for future in futures:
                    if not future.done():
                        future.set_result(answers.get(key))
