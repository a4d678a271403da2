"""The log stream: what one event-loop iteration logs leaves in one write, in order."""

from __future__ import annotations

import asyncio
import io
import json
import threading

import structlog

from hubd.logs import configure_logging, flush_logs
from hubd.logstream import CoalescingStream


class _Target(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError("reader gone")


async def _after_due_callbacks() -> None:
    """Return once every callback already due on the loop has run."""
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done


async def test_lines_of_one_iteration_leave_in_one_write() -> None:
    target = _Target()
    stream = CoalescingStream(target)
    for n in range(20):
        print(f"line {n}", file=stream, flush=True)
    # Held back until the iteration ends: nothing has reached the target yet.
    assert target.writes == []
    await _after_due_callbacks()
    assert target.writes == ["".join(f"line {n}\n" for n in range(20))]
    print("next", file=stream, flush=True)
    await _after_due_callbacks()
    assert target.writes[1:] == ["next\n"]


def test_outside_an_event_loop_each_line_is_written_at_once() -> None:
    target = _Target()
    stream = CoalescingStream(target)
    print("first", file=stream, flush=True)
    assert target.getvalue() == "first\n"
    print("second", file=stream, flush=True)
    assert target.getvalue() == "first\nsecond\n"


async def test_more_than_the_limit_is_written_at_once() -> None:
    target = _Target()
    stream = CoalescingStream(target, limit=100)
    print("x" * 60, file=stream, flush=True)
    assert target.writes == []
    print("y" * 60, file=stream, flush=True)
    assert target.getvalue() == "x" * 60 + "\n" + "y" * 60 + "\n"
    await _after_due_callbacks()
    assert len(target.writes) == 1


async def test_another_thread_writes_after_the_lines_held_back() -> None:
    """A thread without a loop writes at once, and takes the lines held back with it, so the
    order is the order the lines were logged in."""
    target = _Target()
    stream = CoalescingStream(target)
    print("loop line", file=stream, flush=True)

    def other() -> None:
        print("thread line", file=stream, flush=True)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert target.getvalue() == "loop line\nthread line\n"
    await _after_due_callbacks()
    assert target.getvalue() == "loop line\nthread line\n"


async def test_a_closed_reader_loses_the_lines_and_raises_nothing() -> None:
    stream = CoalescingStream(_ClosedPipe())
    print("lost", file=stream, flush=True)
    await _after_due_callbacks()
    stream.write_out()


def test_a_loop_that_stops_before_the_write_leaves_lines_for_flush_logs() -> None:
    """Lines of the iteration in which the loop stopped are written by flush_logs, as the
    command line does before its own last message (and atexit at the latest)."""
    target = _Target()
    configure_logging(fmt="json", level="info", stream=target)
    try:
        loop = asyncio.new_event_loop()
        try:

            def log_and_stop() -> None:
                structlog.get_logger("t").info("last_words", n=1)
                loop.stop()

            loop.call_soon(log_and_stop)
            loop.run_forever()
        finally:
            loop.close()
        assert target.writes == []
        flush_logs()
        assert json.loads(target.getvalue())["event"] == "last_words"
    finally:
        structlog.reset_defaults()


async def test_structlog_lines_of_one_iteration_share_a_write() -> None:
    target = _Target()
    configure_logging(fmt="json", level="info", stream=target)
    try:
        for n in range(5):
            structlog.get_logger("t").info("released", n=n)
        await _after_due_callbacks()
    finally:
        structlog.reset_defaults()
    assert len(target.writes) == 1
    assert [json.loads(line)["n"] for line in target.getvalue().splitlines()] == list(range(5))
