"""Waiting for something to become true: poll with a deadline, never sleep a fixed time."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Final


def _time_scale() -> float:
    text = os.environ.get("HUBD_TEST_TIME_SCALE", "1")
    try:
        scale = float(text)
    except ValueError:
        raise RuntimeError(f"HUBD_TEST_TIME_SCALE must be a number, not {text!r}") from None
    if not scale > 0:
        raise RuntimeError(f"HUBD_TEST_TIME_SCALE must be positive, not {text!r}")
    return scale


TIME_SCALE: Final = _time_scale()
"""How much slower than a quiet laptop this machine runs the tests (``HUBD_TEST_TIME_SCALE``,
default 1): a loaded CI runner sets 3 or 5, and every real-time budget a test gives the code
under test stretches by it."""


def scaled(seconds: float) -> float:
    """A real-time budget the code under test runs against (a lease, an operation timeout),
    stretched by :data:`TIME_SCALE`. Only for budgets that must stay short for the test to mean
    anything; deadlines of :func:`eventually` are generous already."""
    return seconds * TIME_SCALE


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    *,
    within: float = 10.0,
    every: float = 0.01,
    what: str = "condition",
) -> None:
    """Poll ``check`` until it holds; fail after ``within`` seconds (a deadline, not a sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(every)
