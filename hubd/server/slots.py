"""The listener's handshake slots, as plain decisions over counters and a passed-in clock.

Which socket holds one of the ``max_handshakes`` slots for an unfinished handshake, which waits
for one and in what order, which is refused and what it is told, which handshake gives its slot
up and why (:mod:`hubd.server.limits` says how each bound was sized and what it costs). The
listener (:class:`~hubd.server.listener.SidecarServer`) reports what its sockets do and
carries out what :meth:`SourceGate.settle` decides. The counts the gate keeps are here too
(:class:`RateMeter`, :class:`Tally`).
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, KeysView
from typing import Final, Generic, TypeVar

import attrs

from hubd.server.handshake import Rejection
from hubd.server.limits import BucketMap, ListenerLimits

__all__ = [
    "OVER_SHARE",
    "SLOW",
    "RateMeter",
    "Settlement",
    "SourceGate",
    "Tally",
    "header_budget",
    "prefix_of",
]


def prefix_of(source: str) -> str:
    """The address range ``source`` is counted in: its /24 (IPv4, IPv4-mapped IPv6 included) or
    its /64 (IPv6). One host rarely has more addresses than that; a flood often does."""
    if ":" not in source:
        head, dot, _ = source.rpartition(".")
        return f"{head}.0/24" if dot else source
    try:
        address = ipaddress.IPv6Address(source.partition("%")[0])
    except ValueError:
        return source
    if address.ipv4_mapped is not None:
        return prefix_of(str(address.ipv4_mapped))
    return str(ipaddress.IPv6Network((address, 64), strict=False))


def header_budget(limits: ListenerLimits, held: int) -> float:
    """Seconds a handshake holding a slot may take to deliver its complete request, with
    ``held`` slots taken: ``header_timeout`` up to half of them, then shrinking in proportion to
    the slots left, to ``min_header_budget`` with none left."""
    left = max(0.0, 1.0 - held / limits.max_handshakes)
    if left >= 0.5:
        return limits.header_timeout
    spread = limits.header_timeout - limits.min_header_budget
    return limits.min_header_budget + spread * left / 0.5


K = TypeVar("K", bound=Hashable)

SLOW: Final = "request too slow for the load"
"""Why a handshake was evicted: its request was not complete within the budget, or, with every
slot taken, past its grace while a socket of a range in good standing waited."""
OVER_SHARE: Final = "address range over its share"
"""Why a handshake was evicted: its range held more than its share while another waited."""


@attrs.frozen
class _Slot:
    source: str
    prefix: str
    since: float


@attrs.frozen(kw_only=True)
class Settlement(Generic[K]):
    """What the listener must do now: handshakes to abort (and why), waiting sockets to refuse,
    and waiting sockets whose slot is taken for them, in that order. The gate's counts already
    say it is done."""

    evicted: tuple[tuple[K, str], ...] = ()
    refused: tuple[tuple[K, Rejection], ...] = ()
    admitted: tuple[K, ...] = ()


class SourceGate(Generic[K]):
    """Admission of new sockets to the handshake slots: counts of sockets and of handshakes
    per address, per range and in total, the sockets waiting for a slot, the failed-handshake
    bucket of each address. Every socket is a key (the listener's connection object); the
    listener reports what its sockets do and carries out what :meth:`settle` decides."""

    def __init__(self, limits: ListenerLimits, *, max_connections: int | None = None) -> None:
        self.limits = limits
        self.max_connections = max_connections or limits.max_connections
        # Waiting sockets take their descriptors from the sockets' cap: most of it stays for
        # sockets that are open or opening.
        self.max_waiting = max(1, min(limits.max_waiting, self.max_connections // 4))
        self.sockets = 0
        self._lingering = 0
        self._held: dict[K, _Slot] = {}
        # Handshakes whose request is not complete yet, oldest first: the eviction candidates.
        self._incomplete: OrderedDict[K, None] = OrderedDict()
        self._by_source: dict[str, int] = {}
        self._by_prefix: dict[str, int] = {}
        # Ranges holding more than their share: none or one with the default share, a half.
        self._over: set[str] = set()
        self._waiters: OrderedDict[K, _Slot] = OrderedDict()
        # Waiting sockets by range, then by address, each in arrival order; both levels are
        # served in turn (the first is served and moved to the end).
        self._rooms: OrderedDict[str, OrderedDict[str, deque[K]]] = OrderedDict()
        self._waiting_by_source = Tally()
        self._displaced: list[tuple[K, Rejection]] = []
        self._unfinished_by_prefix: dict[str, int] = {}
        # One token per range, spent by an eviction and back after ``eviction_memory``: a
        # range with its token is in good standing.
        self._standing = BucketMap(1.0 / limits.eviction_memory, 1, limits.max_tracked)
        self._grace_due: float | None = None
        self._freed = RateMeter()
        self._failures = BucketMap(
            limits.bad_handshake_rate, limits.bad_handshake_burst, limits.max_tracked
        )
        # Slots each address earned beyond ``max_handshakes_per_source``: one per request it
        # delivered whole, forfeited by a failed handshake or an eviction; least recently
        # earned first, at most ``max_tracked`` addresses.
        self._earned: OrderedDict[str, int] = OrderedDict()

    # -- what sockets do ------------------------------------------------------------------------

    def arrive(self, key: K, source: str, now: float) -> Rejection | bool:
        """A socket from ``source`` was accepted: ``True`` if it holds a handshake slot now,
        ``False`` if it waits for one, or why it is refused (before any byte of it is read)."""
        if self.sockets >= self.max_connections:
            retry = self.limits.retry_after
            return Rejection(status=503, reason="too many connections", retry_after=retry)
        if not self._failures.available(source, now):
            wait = max(self.limits.retry_after, round(self._failures.wait(source, now) + 0.5))
            return Rejection(status=429, reason="too many failed handshakes", retry_after=wait)
        prefix = prefix_of(source)
        if (
            not self._waiting_by_source[source]
            and self._by_source.get(source, 0) < self.cap(source)
            and len(self._held) < self.limits.max_handshakes
        ):
            self.sockets += 1
            self._take(key, _Slot(source, prefix, now))
            return True
        if len(self._waiters) >= self.max_waiting:
            # Full: the address with the most waiting sockets gives up its newest, unless it
            # is this one's own (a burst from one address queues behind itself, and no flood
            # pushes a sidecar of another address out).
            largest = self._waiting_by_source.largest()
            if largest is None or largest[1] <= self._waiting_by_source[source]:
                return self._refusal(source, now)
            self._displace(largest[0], now)
        self.sockets += 1
        self._queue(key, _Slot(source, prefix, now))
        return False

    def complete(self, key: K) -> None:
        """The handshake delivered its whole request: it is no longer a candidate for
        eviction, and its address earns a slot (:meth:`cap`)."""
        if key in self._incomplete:
            del self._incomplete[key]
            slot = self._held[key]
            self._count(self._unfinished_by_prefix, slot.prefix, -1)
            self._earn(slot.source)

    def handshake_over(self, key: K, now: float) -> None:
        """The handshake was decided (upgrade, refusal, eviction): its slot is free again."""
        slot = self._held.pop(key, None)
        if slot is not None:
            self._release(key, slot)
            self._freed.note(now)

    def leave(self, key: K) -> None:
        """The socket closed while it waited (or was refused from the queue)."""
        if key in self._waiters:
            self._unqueue(key)

    def closed(self) -> None:
        self.sockets -= 1

    def failed(self, source: str, now: float) -> None:
        """A handshake from ``source`` was refused for something the peer got wrong: it spends
        from the address's failure budget, and the address forfeits the slots it earned."""
        self._failures.take(source, now)
        self._earned.pop(source, None)

    def cap(self, source: str) -> int:
        """How many unfinished handshakes ``source`` may hold: ``max_handshakes_per_source``,
        and one more for every request it delivered whole since its last failed or evicted
        handshake, up to its range's share (``max_handshakes_per_prefix``).

        A host that dials many sidecars at once (the ``local`` provisioner, host-network
        containers, a NAT) earns its way to the throughput of many hosts while its handshakes
        complete; an address whose handshakes never deliver a request (a slow-loris) earns
        nothing, and one that fails or is evicted starts again from the base. Every address
        still holds at most a range's share, so the other half of the slots stays for others."""
        base = self.limits.max_handshakes_per_source
        return max(base, min(base + self._earned.get(source, 0), self._ceiling))

    @property
    def _ceiling(self) -> int:
        return min(self.limits.max_handshakes_per_prefix, self.limits.max_handshakes)

    def linger(self) -> bool:
        """A refused socket would stay open a moment, so that its peer reads the refusal:
        ``True`` if it may (it counts until :meth:`lingered`), ``False`` with as many sockets
        lingering as there are handshake slots (it is aborted instead)."""
        if self._lingering >= self.limits.max_handshakes:
            return False
        self._lingering += 1
        return True

    def lingered(self) -> None:
        """A socket :meth:`linger` let stay open closed."""
        self._lingering -= 1

    # -- what the listener must do --------------------------------------------------------------

    def settle(self, now: float) -> Settlement[K]:
        """Refuse the sockets that waited their bound, evict the handshakes too slow for the
        current load and those over their range's share, and give every free slot to the next
        waiting socket in turn."""
        refused = self._displaced
        self._displaced = []
        while self._waiters:
            key, waiter = next(iter(self._waiters.items()))
            if now - waiter.since < self.limits.max_queue_wait:
                break
            self._unqueue(key)
            refused.append((key, self._refusal(waiter.source, now)))
        evicted: list[tuple[K, str]] = []
        # One budget for the whole pass, from the load before it: the slots freed here are
        # taken again below.
        budget = header_budget(self.limits, len(self._held))
        while self._incomplete:
            key = next(iter(self._incomplete))
            if now - self._held[key].since < budget:
                break
            self._evict(key, now)
            evicted.append((key, SLOW))
        admitted: list[K] = []
        self._grace_due = None
        while True:
            if len(self._held) < self.limits.max_handshakes:
                turn = self._next_waiter()
                if turn is None:
                    break
                waiter = self._unqueue(turn)
                self._take(turn, _Slot(waiter.source, waiter.prefix, now))
                admitted.append(turn)
                continue
            victim = self._over_share(now)
            if victim is not None:
                self._evict(victim, now)
                evicted.append((victim, OVER_SHARE))
                continue
            victim = self._for_good_standing(now)
            if victim is None:
                break
            self._evict(victim, now)
            evicted.append((victim, SLOW))
        return Settlement(evicted=tuple(evicted), refused=tuple(refused), admitted=tuple(admitted))

    def next_deadline(self, now: float) -> float | None:
        """When :meth:`settle` has something to do next if nothing else happens first."""
        due: list[float] = []
        if self._waiters:
            due.append(next(iter(self._waiters.values())).since + self.limits.max_queue_wait)
        if self._incomplete:
            oldest = self._held[next(iter(self._incomplete))].since
            due.append(oldest + header_budget(self.limits, len(self._held)))
        if self._grace_due is not None:
            due.append(self._grace_due)
        return min(due, default=None)

    def drain(self) -> list[K]:
        """Every waiting socket, taken out of the queue (the listener is closing)."""
        waiting = list(self._waiters)
        for key in waiting:
            self._unqueue(key)
        return waiting

    # -- counts ---------------------------------------------------------------------------------

    @property
    def handshakes(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def lingering(self) -> int:
        """Refused sockets kept open a moment so their peers read the refusal."""
        return self._lingering

    @property
    def sources(self) -> int:
        """Addresses holding a slot or waiting for one."""
        return len(self._by_source.keys() | self._waiting_by_source.keys())

    def holding(self, key: K) -> bool:
        return key in self._held

    # -- inside ---------------------------------------------------------------------------------

    @staticmethod
    def _count(counts: dict[str, int], name: str, change: int) -> None:
        left = counts.get(name, 0) + change
        if left:
            counts[name] = left
        else:
            del counts[name]

    def _take(self, key: K, slot: _Slot) -> None:
        self._held[key] = slot
        self._incomplete[key] = None
        self._count(self._by_source, slot.source, 1)
        self._count(self._by_prefix, slot.prefix, 1)
        self._count(self._unfinished_by_prefix, slot.prefix, 1)
        if self._by_prefix[slot.prefix] > self.limits.max_handshakes_per_prefix:
            self._over.add(slot.prefix)

    def _release(self, key: K, slot: _Slot) -> None:
        if key in self._incomplete:
            del self._incomplete[key]
            self._count(self._unfinished_by_prefix, slot.prefix, -1)
        self._count(self._by_source, slot.source, -1)
        self._count(self._by_prefix, slot.prefix, -1)
        if self._by_prefix.get(slot.prefix, 0) <= self.limits.max_handshakes_per_prefix:
            self._over.discard(slot.prefix)

    def _evict(self, key: K, now: float) -> None:
        slot = self._held.pop(key)
        self._release(key, slot)
        self._freed.note(now)
        self._standing.take(slot.prefix, now)
        self._earned.pop(slot.source, None)

    def _earn(self, source: str) -> None:
        most = max(0, self._ceiling - self.limits.max_handshakes_per_source)
        self._earned[source] = min(self._earned.pop(source, 0) + 1, most)
        if len(self._earned) > self.limits.max_tracked:
            self._earned.popitem(last=False)

    def _in_good_standing(self, prefix: str, now: float) -> bool:
        """No handshake of the range is unfinished now, and none was evicted lately."""
        return not self._unfinished_by_prefix.get(prefix) and self._standing.available(prefix, now)

    def _queue(self, key: K, waiter: _Slot) -> None:
        self._waiters[key] = waiter
        self._waiting_by_source.add(waiter.source)
        room = self._rooms.get(waiter.prefix)
        if room is None:
            room = self._rooms[waiter.prefix] = OrderedDict()
            if self._in_good_standing(waiter.prefix, waiter.since):
                # A range in good standing is served first: one sidecar dialling through a
                # flood of other ranges waits for one slot, not for a turn of every range.
                self._rooms.move_to_end(waiter.prefix, last=False)
        room.setdefault(waiter.source, deque()).append(key)

    def _unqueue(self, key: K) -> _Slot:
        waiter = self._waiters.pop(key)
        self._waiting_by_source.remove(waiter.source)
        room = self._rooms[waiter.prefix]
        line = room[waiter.source]
        if line[0] is key:
            line.popleft()
        elif line[-1] is key:
            line.pop()
        else:
            line.remove(key)
        if not line:
            del room[waiter.source]
            if not room:
                del self._rooms[waiter.prefix]
        return waiter

    def _displace(self, source: str, now: float) -> None:
        prefix = prefix_of(source)
        newest = self._rooms[prefix][source][-1]
        self._unqueue(newest)
        self._displaced.append((newest, self._refusal(source, now)))

    def _refusal(self, source: str, now: float) -> Rejection:
        """The refusal of a socket that found the queue full or waited its bound: 429 when
        its own address is what fills it, else 503; ``Retry-After`` when a slot is expected."""
        rate = self._freed.rate(now)
        retry = self.limits.retry_after
        if rate > 0:
            retry = min(retry, max(1, math.ceil((len(self._waiters) + 1) / rate)))
        if self._waiting_by_source[source] or self._by_source.get(source, 0) >= self.cap(source):
            reason, status = "too many handshakes from this address", 429
        else:
            reason, status = "too many handshakes", 503
        return Rejection(status=status, reason=reason, retry_after=retry)

    def _crowded(self, prefix: str) -> bool:
        return self._by_prefix.get(prefix, 0) >= self.limits.max_handshakes_per_prefix

    def _next_waiter(self) -> K | None:
        """The next waiting socket whose address may take a slot: ranges in turn, addresses
        in turn within a range; a range at its share is passed over while another range has a
        socket that could take the slot. Few are ever passed over (at most
        ``max_handshakes / max_handshakes_per_source`` addresses are at their cap, and two
        ranges at their share), so this is not a scan of the queue."""
        for crowded_too in (False, True):
            for _ in range(len(self._rooms)):
                prefix, room = next(iter(self._rooms.items()))
                self._rooms.move_to_end(prefix)
                if not crowded_too and self._crowded(prefix):
                    continue
                for _ in range(len(room)):
                    source, line = next(iter(room.items()))
                    room.move_to_end(source)
                    if self._by_source.get(source, 0) < self.cap(source):
                        return line[0]
        return None

    def _for_good_standing(self, now: float) -> K | None:
        """With every slot taken: the oldest unfinished handshake past its grace, if the range
        first in turn is in good standing, within its share, and has a socket that could take
        the slot (so that the slot freed goes to it: it is the first :meth:`_next_waiter`
        looks at)."""
        if not self._rooms or not self._incomplete:
            return None
        prefix, room = next(iter(self._rooms.items()))
        if (
            self._crowded(prefix)
            or not self._in_good_standing(prefix, now)
            or all(self._by_source.get(source, 0) >= self.cap(source) for source in room)
        ):
            return None
        key = next(iter(self._incomplete))
        since = self._held[key].since
        if now - since >= self.limits.header_grace:
            return key
        due = since + self.limits.header_grace
        self._grace_due = due if self._grace_due is None else min(self._grace_due, due)
        return None

    def _over_share(self, now: float) -> K | None:
        """With every slot taken: the oldest unfinished handshake (past its grace) of a range
        holding more than its share, if a socket of a range within its share waits and could
        take the slot."""
        if not self._over:
            return None
        waiting_elsewhere = any(
            not self._crowded(prefix)
            and any(self._by_source.get(source, 0) < self.cap(source) for source in room)
            for prefix, room in self._rooms.items()
        )
        if not waiting_elsewhere:
            return None
        for key in self._incomplete:
            slot = self._held[key]
            if slot.prefix in self._over:
                if now - slot.since >= self.limits.header_grace:
                    return key
                # The oldest of them is still in its grace: settled again when it is not.
                due = slot.since + self.limits.header_grace
                self._grace_due = due if self._grace_due is None else min(self._grace_due, due)
                return None
        return None


# -- the counts the gate keeps: a rate of events lately, and counts per key with the largest
# at hand (plain values on a passed-in clock)


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
