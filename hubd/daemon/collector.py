"""The garbage collector's pace in a daemon that holds thousands of sockets: the young
generation is collected every :data:`YOUNG_THRESHOLD` net allocations instead of CPython's 700.
Why and what it measured: docs/performance.md, "The collector's pace"."""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["YOUNG_THRESHOLD", "pace_collector"]

YOUNG_THRESHOLD: Final = 50_000
"""Net allocations between collections of the young generation (CPython's default: 700)."""


def pace_collector() -> None:
    """Collect the young generation every :data:`YOUNG_THRESHOLD` net allocations; the older
    generations keep their thresholds, which count collections of the generation below."""
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
