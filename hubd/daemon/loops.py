"""The daemon's event loop, as ``[runtime] event_loop`` names it.

uvloop (libuv's loop, in C) is the default. Much of a daemon's CPU goes to the loop's own work
(its socket transports, selector and callbacks took a third of the samples of a lifecycle's
profile), which uvloop does in C, and asyncpg's protocol uses uvloop's transports directly
(docs/performance.md has the measurements). The standard library's loop is the fallback for a
host uvloop does not build on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import get_args

from hubd.config import EventLoop
from hubd.errors import ConfigError

__all__ = ["EVENT_LOOPS", "loop_factory", "loop_name"]

EVENT_LOOPS: tuple[EventLoop, ...] = get_args(EventLoop)
"""Every loop ``[runtime] event_loop`` may name."""


def loop_factory(name: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The ``loop_factory`` of an :class:`asyncio.Runner` that runs on the event loop ``name``
    (``None``: the standard library's, exactly as :func:`asyncio.run` makes it); a
    :class:`~hubd.errors.ConfigError` when that loop cannot be had here."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        raise ConfigError(
            'runtime.event_loop: "uvloop" is not installed for this Python; '
            'install it (pip install uvloop) or set event_loop = "asyncio"'
        ) from None
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> EventLoop:
    """Which kind of loop ``loop`` is, as the config names it."""
    return "uvloop" if type(loop).__module__.partition(".")[0] == "uvloop" else "asyncio"
