"""The garbage collector's pace in a daemon that holds thousands of sockets.

CPython collects its young generation every 700 net allocations, and the whole heap whenever the
objects that survived into the old generation have grown by a quarter since the last full
collection. Each socket the listener holds is a few dozen long-lived objects (websockets'
connection and protocol, the transport, their tasks, the router's entry), so while sockets
arrive by the thousand, as in a reconnect storm, the heap keeps growing by a quarter and every
full collection walks all of it. In a storm of 5,000 reconnects (``bench --only sockets``) that
was 28% of the daemon's CPU: six full collections of 260,000 to 520,000 objects, about 0.24 s
each, during which the event loop stood still. The daemon's CPU per handshake rose with the
number of sockets it held (1.05 ms at 2,000, 1.39 ms at 5,000).

With the young generation collected every 10,000 net allocations, each older generation is
collected 14 times less often as well (their thresholds count collections of the generation
below); the storm's collections took 0.45 s instead of 1.74 s, the CPU per handshake at 5,000
sockets was 1.08 to 1.19 ms across runs, and the memory per idle socket did not change.

Every 50,000 is better still. A claim, a handshake and a close each leave objects that live a
few milliseconds (tasks, futures, rows, log events); collected every 10,000 allocations, many
were still alive, survived into the middle generation and were walked again there. In one run
of the bench's 16-claim phase (a 2,000-allocation lifecycle, then latency samples) the
collections took 155 ms at 10,000 (59 young, 5 middle at about 20 ms each, 1 full at 46 ms)
and 77 ms at 50,000 (32 young, up to 11 ms each, 3 middle, no full). In interleaved pairs
(``bench.compare``) the lifecycle ran 1.03x and the 2,000-socket reconnect storm 1.05x as
fast, the memory per idle socket unchanged (1.07x bare websockets at 2,000 sockets, 1.09x at
5,000). A young collection walks at most the objects still alive among the last 50,000, and
cyclic garbage (a dropped socket's objects refer to each other) waits for the same
collections: an idle daemon allocates little, so it can hold an earlier storm's garbage for
longer, as the default pace also does once the heap stops growing.
"""

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
