"""The asyncio primitives (hubd.aio): a per-key FIFO lock, tracked tasks, and work run unless
an event comes first. Each property is one a caller leans on: order, no leak, no lost task, no
lost exception, nothing left running."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from hubd.aio import KeyedFifo, TrackedTasks, raise_if_cancelled, run_unless
from tests.polling import eventually


async def _await_point() -> None:
    """Where a coroutine gives the loop a turn, as a real one's I/O would: an event the loop
    sets on its next turn."""
    turned = asyncio.Event()
    asyncio.get_running_loop().call_soon(turned.set)
    await turned.wait()


class TestKeyedFifo:
    async def test_holders_of_one_key_take_turns_in_the_order_they_asked(self) -> None:
        fifo = KeyedFifo()
        order: list[str] = []
        gate = asyncio.Event()

        async def turn(name: str, key: str) -> None:
            async with fifo.hold(key):
                order.append(f"{name} in")
                if name == "first":
                    await gate.wait()
                await _await_point()
                order.append(f"{name} out")

        tasks = [
            asyncio.create_task(turn(name, "a"), name=name) for name in ("first", "second", "third")
        ]
        await eventually(lambda: fifo.users("a") == 3, within=5, every=0.001)
        assert order == ["first in"]
        gate.set()
        await asyncio.gather(*tasks)
        assert order == [
            "first in",
            "first out",
            "second in",
            "second out",
            "third in",
            "third out",
        ]

    async def test_keys_do_not_wait_for_each_other(self) -> None:
        fifo = KeyedFifo()
        held = asyncio.Event()
        release = asyncio.Event()

        async def hold_a() -> None:
            async with fifo.hold("a"):
                held.set()
                await release.wait()

        holder = asyncio.create_task(hold_a(), name="hold a")
        await held.wait()
        async with asyncio.timeout(1):
            async with fifo.hold("b"):
                assert len(fifo) == 2
        release.set()
        await holder

    async def test_a_key_is_forgotten_once_nobody_holds_or_waits_for_it(self) -> None:
        fifo = KeyedFifo()
        async with fifo.hold("a"):
            assert len(fifo) == 1
        assert len(fifo) == 0
        with pytest.raises(RuntimeError):
            async with fifo.hold("a"):
                raise RuntimeError("the block failed")
        assert len(fifo) == 0

    async def test_a_waiter_cancelled_in_line_leaves_no_key_and_no_stuck_lock(self) -> None:
        fifo = KeyedFifo()
        release = asyncio.Event()
        entered: list[str] = []

        async def turn(name: str) -> None:
            async with fifo.hold("a"):
                entered.append(name)
                if name == "first":
                    await release.wait()

        first = asyncio.create_task(turn("first"), name="first")
        await eventually(lambda: entered == ["first"], within=5, every=0.001)
        second = asyncio.create_task(turn("second"), name="second")
        third = asyncio.create_task(turn("third"), name="third")
        await eventually(lambda: fifo.users("a") == 3, within=5, every=0.001)
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        release.set()
        await asyncio.gather(first, third)
        assert entered == ["first", "third"]
        assert len(fifo) == 0


class TestTrackedTasks:
    async def test_a_task_is_held_until_done_and_then_let_go(self) -> None:
        tasks = TrackedTasks()
        release = asyncio.Event()
        task = tasks.spawn(release.wait(), name="waiting")
        assert len(tasks) == 1
        assert list(tasks) == [task]
        release.set()
        await tasks.drain()
        assert len(tasks) == 0
        assert task.result() is True

    async def test_a_failure_is_handed_over_by_name_and_a_cancellation_is_not_one(self) -> None:
        failures: list[tuple[str, BaseException]] = []
        unretrieved: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
        try:
            tasks = TrackedTasks(on_failure=lambda name, exc: failures.append((name, exc)))

            async def fail() -> None:
                raise ValueError("broken")

            tasks.spawn(fail(), name="failing")
            cancelled = tasks.spawn(asyncio.Event().wait(), name="cancelled")
            await eventually(lambda: len(failures) == 1, within=5, every=0.001)
            cancelled.cancel()
            await tasks.drain()
            assert [(name, str(exc)) for name, exc in failures] == [("failing", "broken")]
            # Retrieved: dropping the task raises no "exception was never retrieved".
            del cancelled
            gc.collect()
            assert unretrieved == []
        finally:
            loop.set_exception_handler(previous)

    async def test_a_failure_is_retrieved_when_nobody_is_told(self) -> None:
        unretrieved: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
        try:
            tasks = TrackedTasks()

            async def fail() -> None:
                raise ValueError("broken")

            tasks.spawn(fail(), name="failing")
            await tasks.drain()
            gc.collect()
            assert unretrieved == []
        finally:
            loop.set_exception_handler(previous)

    async def test_drain_waits_for_tasks_spawned_while_it_waits(self) -> None:
        tasks = TrackedTasks()
        finished: list[str] = []

        async def later() -> None:
            await _await_point()
            await _await_point()
            finished.append("later")

        async def first() -> None:
            await _await_point()
            tasks.spawn(later(), name="later")
            finished.append("first")

        tasks.spawn(first(), name="first")
        await tasks.drain()
        assert finished == ["first", "later"]
        assert len(tasks) == 0


class TestRunUnless:
    async def test_work_that_ends_first_is_true_and_its_error_propagates(self) -> None:
        never = asyncio.Event()

        async def done() -> int:
            await _await_point()
            return 1

        assert await run_unless(never, done()) is True

        async def failing() -> None:
            await _await_point()
            raise ValueError("broken")

        with pytest.raises(ValueError, match="broken"):
            await run_unless(never, failing())

    async def test_the_event_cancels_the_work_and_waits_for_its_end(self) -> None:
        event = asyncio.Event()
        cleaned: list[str] = []

        async def work() -> None:
            try:
                event.set()
                await asyncio.Event().wait()
            finally:
                await _await_point()  # a clean-up that itself awaits
                cleaned.append("cleaned")

        assert await run_unless(event, work()) is False
        assert cleaned == ["cleaned"]

    async def test_an_event_already_set_ends_it_at_once(self) -> None:
        event = asyncio.Event()
        event.set()
        async with asyncio.timeout(1):
            assert await run_unless(event, asyncio.Event().wait()) is False

    async def test_the_limit_cancels_the_work(self) -> None:
        ended: list[BaseException] = []

        async def work() -> None:
            try:
                await asyncio.Event().wait()
            except BaseException as exc:
                ended.append(exc)
                raise

        assert await run_unless(asyncio.Event(), work(), limit=0.01) is False
        assert [type(exc) for exc in ended] == [asyncio.CancelledError]

    async def test_work_that_finishes_despite_its_cancellation_counts_as_ended(self) -> None:
        event = asyncio.Event()

        async def stubborn() -> None:
            try:
                event.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                return

        assert await run_unless(event, stubborn()) is True

    async def test_cancelling_the_caller_cancels_the_work_before_it_returns(self) -> None:
        started = asyncio.Event()
        cleaned: list[str] = []

        async def work() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                await _await_point()
                cleaned.append("cleaned")

        caller = asyncio.create_task(run_unless(asyncio.Event(), work()), name="caller")
        await started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert cleaned == ["cleaned"]


class TestRaiseIfCancelled:
    async def test_a_cancellation_swallowed_below_still_ends_the_loop(self) -> None:
        """A cancellation lost on its way (caught below, as ``wait_for`` may on 3.11) is still
        counted by the task, and the loop's next check raises it; a task never asked to stop
        goes on."""
        turns = 0
        swallowed = asyncio.Event()
        never = asyncio.Event()

        async def loop() -> None:
            nonlocal turns
            while True:
                raise_if_cancelled()
                turns += 1
                try:
                    await never.wait()  # work that only a cancellation ends
                except asyncio.CancelledError:
                    swallowed.set()  # lost, as a racing result would lose it

        task = asyncio.create_task(loop())
        await eventually(lambda: turns == 1)
        raise_if_cancelled()  # this test's own task was never asked to stop
        task.cancel()
        await swallowed.wait()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert turns == 1
