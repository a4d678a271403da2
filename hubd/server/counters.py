"""Counts the handshake gate keeps (:class:`~hubd.server.slots.SourceGate`): a rate of events
lately, and counts per key with the largest at hand. Plain values on a passed-in clock."""

from __future__ import annotations

import math
from collections.abc import KeysView

__all__ = ["RateMeter", "Tally"]


class RateMeter:
    """Events a second lately: an exponentially weighted count with a time constant of
    ``window`` seconds, on a passed-in clock."""

    def __init__(self, window: float = 1.0) -> None:
        self._window = window
        self._value = 0.0
        self._at = 0.0

    def note(self, now: float) -> None:
        self._value = self.rate(now) + 1.0 / self._window
        self._at = now

    def rate(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._at) / self._window)


class Tally:
    """Counts per key, with the key of the largest count at hand: counts move by one, so
    keeping the keys of each count is enough to find the largest without a scan."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._at: dict[int, dict[str, None]] = {}
        self._top = 0

    def __getitem__(self, key: str) -> int:
        return self._counts.get(key, 0)

    def add(self, key: str) -> None:
        count = self._counts.get(key, 0)
        self._move(key, count, count + 1)
        self._top = max(self._top, count + 1)

    def remove(self, key: str) -> None:
        count = self._counts[key]
        self._move(key, count, count - 1)
        while self._top and not self._at.get(self._top):
            self._top -= 1

    def largest(self) -> tuple[str, int] | None:
        """The key with the largest count (the first to reach it), and the count."""
        if not self._top:
            return None
        return next(iter(self._at[self._top])), self._top

    def _move(self, key: str, old: int, new: int) -> None:
        if old:
            keys = self._at[old]
            del keys[key]
            if not keys:
                del self._at[old]
        if new:
            self._at.setdefault(new, {})[key] = None
            self._counts[key] = new
        else:
            del self._counts[key]

    def __len__(self) -> int:
        return len(self._counts)

    def keys(self) -> KeysView[str]:
        return self._counts.keys()
