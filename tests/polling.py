"""Waiting for something to become true: poll with a deadline, never sleep a fixed time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


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
