"""The asyncio primitives every layer uses, written once: a per-key FIFO lock, a set of
tracked tasks, running a piece of work unless an event comes first, and ending a loop whose
task was asked to stop.

Nothing here knows hubd: each primitive is a shape of waiting, and what it is used for (a
sidecar's turn, a socket's close, a recycled connection) belongs to its caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["KeyedFifo", "TrackedTasks", "raise_if_cancelled", "run_unless"]

T = TypeVar("T")


class _Slot:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class KeyedFifo:
    """One FIFO lock per key, forgotten as soon as nobody holds or waits for it, so that idle
    keys cost no memory.

    ``asyncio.Lock`` hands itself to waiters in the order they called ``acquire``; callers
    that reach ``acquire`` without yielding after the event they serialize run in the order of
    those events.
    """

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}

    def hold(self, key: str) -> _Held:
        """``async with fifo.hold(key):`` runs the block once every earlier holder of ``key``
        is done."""
        return _Held(self._slots, key)

    def __len__(self) -> int:
        """Keys held or waited for."""
        return len(self._slots)

    def users(self, key: str) -> int:
        """How many hold ``key`` or wait for it."""
        slot = self._slots.get(key)
        return 0 if slot is None else slot.users


class _Held:
    """One turn of :class:`KeyedFifo`. A class rather than a generator-based context manager:
    the router takes a turn on every connect and every disconnect, and this costs less than
    half as much (0.9 against 2.1 us a turn)."""

    __slots__ = ("_key", "_slot", "_slots")

    def __init__(self, slots: dict[str, _Slot], key: str) -> None:
        self._slots = slots
        self._key = key

    async def __aenter__(self) -> None:
        slot = self._slots.get(self._key)
        if slot is None:
            slot = self._slots[self._key] = _Slot()
        # Counted before the wait, so a key with waiters is never forgotten under them.
        slot.users += 1
        self._slot = slot
        try:
            await slot.lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *_exc: object) -> None:
        self._slot.lock.release()
        self._leave()

    def _leave(self) -> None:
        slot = self._slot
        slot.users -= 1
        if slot.users == 0:
            del self._slots[self._key]


class TrackedTasks:
    """Fire-and-forget tasks, kept referenced until done (the event loop holds only a weak
    reference to a task), each one's failure handed to ``on_failure`` with the task's name.

    A failure is retrieved here in every case, so a task nobody awaits never ends in asyncio's
    "exception was never retrieved"; a cancelled task is no failure.
    """

    def __init__(self, on_failure: Callable[[str, BaseException], None] | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_failure = on_failure

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._on_failure is not None:
            self._on_failure(task.get_name(), exc)

    async def drain(self) -> None:
        """Wait until every task has ended, those spawned meanwhile included; their outcomes
        are theirs (see ``on_failure``)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        """The tasks still running, as they stand now (a copy: they leave as they end)."""
        return iter(set(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)


async def run_unless(
    event: asyncio.Event, work: Coroutine[Any, Any, Any], *, limit: float | None = None
) -> bool:
    """Run ``work`` until it ends, ``event`` is set or ``limit`` seconds pass, whichever comes
    first; in the last two cases cancel it. Whether it ended on its own: its exceptions
    propagate, and work that ignored its cancellation and finished counts as ended.

    ``work`` is awaited to its end before this returns, when this task is cancelled too.
    """
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, waiter), timeout=limit, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for each in (task, waiter):
            each.cancel()
        # Awaited here, so neither outlives the call; gathered, so that their outcomes are
        # read below and a cancellation of this task is not taken for the work's.
        await asyncio.gather(task, waiter, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


def raise_if_cancelled() -> None:
    """Raise :class:`asyncio.CancelledError` if this task has been asked to stop.

    On Python 3.11, ``asyncio.wait_for`` (which asyncpg uses for its timeouts) can lose a
    cancellation that races a result: the coroutine carries on, while the request stays counted
    in ``Task.cancelling()``. A loop that checks this at every turn still ends; without it, a
    later ``asyncio.timeout`` would even turn the lost request into an ordinary timeout.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
