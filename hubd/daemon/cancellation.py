"""Ending long-running loops reliably when they are asked to stop."""

from __future__ import annotations

import asyncio

__all__ = ["raise_if_cancelled"]


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
