"""Capped exponential backoff: the one formula hubd's retries wait by, each with its own base
and cap.

:class:`Backoff` is the pure schedule (attempt ``n`` → at most ``min(cap, base * 2**n)``); the
reference sidecar draws its reconnect waits from it with full jitter. :class:`Retries` is the
attempt counter a daemon loop keeps over it: each failure waits the next ceiling, a success
starts over. Daemon loops do not jitter: each is one per process, not one per sidecar, so there
is no herd to spread. The reconciler's durable retries use the same ceiling with the attempt
counted on the allocation's row instead (:data:`hubd.reconciler.decisions.RETRY_SCHEDULE`:
1 s doubling to 30 s).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

__all__ = ["Backoff", "Retries"]


@attrs.frozen
class Backoff:
    """Capped exponential backoff with full jitter (AWS architecture blog, "Exponential
    Backoff And Jitter"): attempt ``n`` waits a uniformly random time below
    ``min(cap, base * 2**n)``."""

    base: float = 0.5
    cap: float = 30.0

    def __attrs_post_init__(self) -> None:
        if not (self.base > 0 and self.cap >= self.base):
            raise ValueError("backoff needs 0 < base <= cap")

    def ceiling(self, attempt: int) -> float:
        return min(self.cap, self.base * 2.0 ** min(max(attempt, 0), 32))

    def delay(self, attempt: int, random: Callable[[], float], *, floor: float = 0.0) -> float:
        """The wait before reconnect attempt ``attempt`` (0-based); ``random`` returns [0, 1).

        A server's ``Retry-After`` is a ``floor`` the jitter is added above, not a fixed wait:
        every sidecar refused in the same second would otherwise return in the same second.
        """
        floor = min(max(floor, 0.0), self.cap)
        return min(self.cap, floor + random() * self.ceiling(attempt))


@attrs.define
class Retries:
    """One retry loop's attempts over ``backoff``: :meth:`next_delay` after each failure,
    :meth:`reset` after a success."""

    backoff: Backoff
    attempt: int = 0

    @classmethod
    def doubling(cls, first: float, cap: float) -> Retries:
        """``first``, twice that, and so on up to ``cap`` (``first`` is lowered to a smaller
        ``cap``)."""
        return cls(Backoff(base=min(first, cap), cap=cap))

    def next_delay(self) -> float:
        delay = self.backoff.ceiling(self.attempt)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
