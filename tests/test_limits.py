"""The listener's resource bounds as plain decisions: no sockets, no database, no clock."""

from __future__ import annotations

import subprocess
import sys

import attrs

from hubd.daemon.fdlimit import plan_descriptors
from hubd.logs import Sampler
from hubd.server.handshake import Rejection
from hubd.server.limits import (
    DESCRIPTOR_HEADROOM,
    BucketMap,
    HeaderScanner,
    ListenerLimits,
    TokenBucket,
    connection_cap,
)
from hubd.server.slots import (
    OVER_SHARE,
    SLOW,
    RateMeter,
    SourceGate,
    Tally,
    header_budget,
    prefix_of,
)

LIMITS = ListenerLimits(
    max_connections=4,
    max_handshakes=3,
    max_handshakes_per_source=2,
    max_handshake_bytes=200,
    max_header_lines=3,
    max_header_line=40,
    bad_handshake_rate=1.0,
    bad_handshake_burst=2,
    max_tracked=3,
)
# Handshake slots small enough to fill by hand: 4 in all, 2 per address, 2 per range.
GATE = ListenerLimits(
    max_connections=64,
    max_handshakes=4,
    max_handshakes_per_source=2,
    max_handshakes_per_prefix=2,
    max_waiting=4,
)


class TestHeaderScanner:
    def test_request_in_bounds(self) -> None:
        """A short request, fed a byte at a time or at once, stays in bounds and completes."""
        request = b"GET / HTTP/1.1\r\nHost: x\r\nA: 1\r\nB: 2\r\n\r\n"
        whole = HeaderScanner(LIMITS)
        assert whole.feed(request) is None
        assert whole.complete
        trickled = HeaderScanner(LIMITS)
        assert all(trickled.feed(request[i : i + 1]) is None for i in range(len(request)))
        assert trickled.complete

    def test_too_many_lines(self) -> None:
        """More header lines than allowed are refused before the header block ends."""
        scanner = HeaderScanner(LIMITS)
        assert scanner.feed(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n") is None
        assert scanner.feed(b"D: 4\r\n") == "too many request headers"

    def test_long_line_across_chunks(self) -> None:
        """A line is measured across the chunks it arrives in."""
        scanner = HeaderScanner(LIMITS)
        assert scanner.feed(b"GET / HTTP/1.1\r\nA: " + b"x" * 30) is None
        assert scanner.feed(b"x" * 20) == "request header line too long"

    def test_total_bytes_after_the_headers(self) -> None:
        """Bytes sent after the header block, before the upgrade, count against the total."""
        scanner = HeaderScanner(LIMITS)
        assert scanner.feed(b"GET / HTTP/1.1\r\n\r\n") is None
        assert scanner.feed(b"z" * 150) is None
        assert scanner.feed(b"z" * 100) == "request header too large"


class TestSourceGate:
    def test_per_source_and_total(self) -> None:
        """Unfinished handshakes are capped per source, then in total; a socket over either cap
        waits instead of being refused, and takes the slot its turn frees."""
        gate: SourceGate[str] = SourceGate(GATE)
        assert gate.arrive("a1", "10.0.0.1", 0.0) is True
        assert gate.arrive("a2", "10.0.0.1", 0.0) is True
        assert gate.arrive("a3", "10.0.0.1", 0.0) is False
        assert gate.arrive("b1", "10.0.1.1", 0.0) is True
        assert gate.arrive("c1", "10.0.2.1", 0.0) is True
        assert gate.arrive("d1", "10.0.3.1", 0.0) is False
        assert (gate.handshakes, gate.waiting, gate.sockets) == (4, 2, 6)
        gate.handshake_over("b1", 0.1)
        # b1's slot is not a3's address's: it goes to the socket waiting for any slot.
        assert gate.settle(0.1).admitted == ("d1",)
        gate.handshake_over("a1", 0.2)
        assert gate.settle(0.2).admitted == ("a3",)
        assert (gate.handshakes, gate.waiting, gate.sources) == (4, 0, 3)

    def test_source_waits_in_arrival_order(self) -> None:
        """Sockets of one address over its cap take its freed slots in the order they came."""
        gate: SourceGate[str] = SourceGate(GATE)
        for key in ("a1", "a2", "a3", "a4", "a5"):
            gate.arrive(key, "10.0.0.1", 0.0)
        turns = []
        for key in ("a1", "a2", "a3"):
            gate.handshake_over(key, 1.0)
            turns += gate.settle(1.0).admitted
        assert turns == ["a3", "a4", "a5"]

    def test_waiting_is_bounded_in_time(self) -> None:
        """A socket that waited ``max_queue_wait`` is refused; Retry-After says when a slot is
        expected from the rate slots were freed at lately (whole seconds, at least 1), and is
        the general one when none were."""
        gate: SourceGate[str] = SourceGate(GATE)
        for key in ("a1", "a2", "a3"):
            gate.arrive(key, "10.0.0.1", 0.0)
        assert gate.next_deadline(0.0) == GATE.max_queue_wait
        assert gate.settle(GATE.max_queue_wait - 0.01).refused == ()
        [(key, refusal)] = gate.settle(GATE.max_queue_wait).refused
        assert key == "a3"
        assert (refusal.status, refusal.reason) == (429, "too many handshakes from this address")
        assert refusal.retry_after == GATE.retry_after
        # Slots freed fast lately: the queue is expected to move within the second.
        busy: SourceGate[str] = SourceGate(GATE)
        for index in range(50):
            busy.arrive(f"x{index}", f"10.1.{index}.1", index / 100)
            busy.handshake_over(f"x{index}", index / 100)
        for index in range(GATE.max_handshakes):
            busy.arrive(f"h{index}", f"10.0.{index}.1", 0.5)
        for index in range(GATE.max_waiting):
            busy.arrive(f"w{index}", "10.0.9.1", 0.5)
        soon = busy.arrive("late", "10.0.9.1", 0.5)
        assert isinstance(soon, Rejection)
        assert (soon.status, soon.retry_after) == (429, 1)

    def test_full_queue_displaces_the_largest_address(self) -> None:
        """With the queue full, a socket of an address with fewer waiting takes the place of
        the newest socket of the address with the most; one of that address itself is
        refused with 429."""
        gate: SourceGate[str] = SourceGate(GATE, max_connections=64)
        assert gate.max_waiting == GATE.max_waiting
        for index in range(GATE.max_handshakes):
            gate.arrive(f"h{index}", f"10.9.{index}.1", 0.0)
        for index in range(GATE.max_waiting):
            assert gate.arrive(f"f{index}", "10.0.0.1", 0.0) is False
        refused = gate.arrive("late", "10.0.0.1", 0.0)
        assert isinstance(refused, Rejection)
        assert (refused.status, refused.retry_after) == (429, GATE.retry_after)
        assert gate.arrive("sidecar", "192.168.0.1", 0.0) is False
        last = f"f{GATE.max_waiting - 1}"
        assert [(key, r.status) for key, r in gate.settle(0.0).refused] == [(last, 429)]
        assert gate.waiting == GATE.max_waiting

    def test_waiting_takes_a_quarter_of_the_sockets_at_most(self) -> None:
        """Waiting sockets are capped to a quarter of the socket cap when that is lower."""
        assert SourceGate(GATE, max_connections=8).max_waiting == 2

    def test_socket_cap(self) -> None:
        """Established sockets count until closed; over the cap a socket gets 503."""
        gate: SourceGate[str] = SourceGate(LIMITS, max_connections=1)
        assert gate.arrive("a", "a", 0.0) is True
        gate.handshake_over("a", 0.0)
        refused = gate.arrive("b", "b", 0.0)
        assert isinstance(refused, Rejection)
        assert (refused.status, refused.reason, refused.retry_after) == (
            503,
            "too many connections",
            LIMITS.retry_after,
        )
        gate.closed()
        assert gate.arrive("b", "b", 0.0) is True

    def test_failures_per_source(self) -> None:
        """A source that keeps failing is refused with 429 until its bucket refills; others are
        not affected."""
        gate: SourceGate[str] = SourceGate(LIMITS)
        gate.failed("a", 0.0)
        gate.failed("a", 0.0)
        refused = gate.arrive("a1", "a", 0.0)
        assert isinstance(refused, Rejection)
        assert refused.status == 429
        assert refused.retry_after is not None
        assert refused.retry_after >= 1
        assert gate.arrive("b1", "b", 0.0) is True
        assert gate.arrive("a2", "a", 1.0) is True

    def test_lingering_refusals_are_capped(self) -> None:
        """As many refused sockets as there are handshake slots may linger; one more may not,
        until one of them closes."""
        gate: SourceGate[str] = SourceGate(LIMITS)
        assert [gate.linger() for _ in range(LIMITS.max_handshakes + 1)] == [
            *[True] * LIMITS.max_handshakes,
            False,
        ]
        assert gate.lingering == LIMITS.max_handshakes
        gate.lingered()
        assert gate.linger() is True
        assert gate.lingering == LIMITS.max_handshakes


class TestEarnedSlots:
    """An address earns slots beyond ``max_handshakes_per_source`` by delivering whole requests,
    up to its range's share, and forfeits them by failing or being evicted."""

    LIMITS = attrs.evolve(GATE, max_handshakes=8, max_handshakes_per_prefix=4, max_waiting=8)

    @staticmethod
    def _burst(gate: SourceGate[str], tag: str, n: int, now: float) -> list[bool | Rejection]:
        return [gate.arrive(f"{tag}{i}", "10.0.0.1", now) for i in range(n)]

    @staticmethod
    def _finish(gate: SourceGate[str], keys: list[str], now: float) -> None:
        for key in keys:
            gate.complete(key)
            gate.handshake_over(key, now)
            gate.closed()

    def test_whole_requests_earn_slots_up_to_the_ranges_share(self) -> None:
        gate: SourceGate[str] = SourceGate(self.LIMITS)
        assert self._burst(gate, "a", 3, 0.0) == [True, True, False]
        assert gate.cap("10.0.0.1") == 2
        self._finish(gate, ["a0", "a1"], 0.1)
        # Two requests delivered whole: two slots earned, the waiting socket takes one.
        assert gate.cap("10.0.0.1") == 4
        assert gate.settle(0.1).admitted == ("a2",)
        assert self._burst(gate, "b", 4, 0.2) == [True, True, True, False]
        self._finish(gate, ["a2", "b0", "b1", "b2"], 0.3)
        # Never past the range's share, however many it delivered: the rest stays for others.
        assert gate.cap("10.0.0.1") == 4
        assert gate.settle(0.3).admitted == ("b3",)
        assert self._burst(gate, "c", 4, 0.4) == [True, True, True, False]
        assert gate.arrive("other", "10.0.9.1", 0.4) is True

    def test_a_failed_handshake_forfeits_what_was_earned(self) -> None:
        gate: SourceGate[str] = SourceGate(self.LIMITS)
        self._burst(gate, "a", 2, 0.0)
        self._finish(gate, ["a0", "a1"], 0.1)
        assert gate.cap("10.0.0.1") == 4
        gate.failed("10.0.0.1", 0.2)
        assert gate.cap("10.0.0.1") == 2
        assert self._burst(gate, "b", 3, 0.3) == [True, True, False]

    def test_an_eviction_forfeits_what_was_earned(self) -> None:
        limits = attrs.evolve(self.LIMITS, header_timeout=1.0, min_header_budget=1.0)
        gate: SourceGate[str] = SourceGate(limits)
        self._burst(gate, "a", 2, 0.0)
        self._finish(gate, ["a0", "a1"], 0.1)
        assert self._burst(gate, "b", 1, 0.2) == [True]
        # b0 never delivers its request: evicted past its budget, and the address starts over.
        assert gate.settle(1.3).evicted == (("b0", SLOW),)
        assert gate.cap("10.0.0.1") == 2

    def test_a_slow_loris_earns_nothing(self) -> None:
        gate: SourceGate[str] = SourceGate(self.LIMITS)
        assert self._burst(gate, "a", 4, 0.0) == [True, True, False, False]
        for key in ("a0", "a1"):
            gate.handshake_over(key, 0.1)  # ended without a whole request (timed out, closed)
            gate.closed()
        assert gate.cap("10.0.0.1") == 2
        assert gate.settle(0.1).admitted == ("a2", "a3")
        assert gate.arrive("a4", "10.0.0.1", 0.2) is False

    def test_earnings_are_remembered_for_max_tracked_addresses(self) -> None:
        limits = attrs.evolve(self.LIMITS, max_tracked=2)
        gate: SourceGate[str] = SourceGate(limits)
        for n, source in enumerate(("10.0.0.1", "10.0.1.1", "10.0.2.1")):
            gate.arrive(f"k{n}", source, 0.0)
            gate.complete(f"k{n}")
        # The least recently earning address is forgotten first.
        assert [gate.cap(s) for s in ("10.0.0.1", "10.0.1.1", "10.0.2.1")] == [2, 3, 3]


class TestEviction:
    def test_budget_shrinks_as_slots_fill(self) -> None:
        """A handshake has ``header_timeout`` to deliver its request while half the slots or
        more are free, then less in proportion to the slots left, ``min_header_budget`` with
        none left."""
        limits = ListenerLimits(max_handshakes=100, header_timeout=10.0, min_header_budget=0.5)
        budgets = [header_budget(limits, held) for held in (0, 50, 75, 99, 100)]
        assert budgets[:2] == [10.0, 10.0]
        assert budgets[2] == 0.5 + 9.5 * 0.5
        assert budgets[3] < 1.0
        assert budgets[4] == 0.5
        assert budgets == sorted(budgets, reverse=True)

    def test_slow_request_evicted_complete_kept(self) -> None:
        """With every slot taken, handshakes that have not delivered their request within the
        budget are evicted, oldest first; an older one whose request is complete is kept, and
        the freed slots go to the waiting sockets."""
        gate: SourceGate[str] = SourceGate(GATE)
        gate.arrive("fast", "10.0.0.1", 0.0)
        gate.complete("fast")
        for key, source in (("slow1", "10.0.1.1"), ("slow2", "10.0.2.1"), ("young", "10.0.3.1")):
            gate.arrive(key, source, 0.1 if key != "young" else 0.5)
        # Of a range with an unfinished handshake: it waits for the budget like the others.
        gate.arrive("next", "10.0.3.2", 0.5)
        due = gate.next_deadline(0.5)
        assert due == 0.1 + GATE.min_header_budget
        assert gate.settle(due - 0.01).evicted == ()
        settled = gate.settle(due)
        assert [key for key, _ in settled.evicted] == ["slow1", "slow2"]
        assert {why for _, why in settled.evicted} == {SLOW}
        assert settled.admitted == ("next",)
        assert gate.holding("fast")
        assert gate.holding("young")

    def test_range_in_good_standing_takes_an_unfinished_slot(self) -> None:
        """With every slot taken, a socket of a range in good standing takes at once the slot
        of the oldest handshake still unfinished past its grace; a range that has had a
        handshake evicted lately waits for the budget like any other, until its memory
        fades."""
        gate: SourceGate[str] = SourceGate(attrs.evolve(GATE, min_header_budget=60.0))
        for index in range(4):
            gate.arrive(f"f{index}", f"10.0.{index}.1", 0.0)
        gate.arrive("sidecar", "192.168.0.1", 0.01)
        assert gate.settle(0.01).evicted == ()
        assert gate.next_deadline(0.01) == GATE.header_grace
        settled = gate.settle(GATE.header_grace)
        assert settled.evicted == (("f0", SLOW),)
        assert settled.admitted == ("sidecar",)
        gate.complete("sidecar")
        # 10.0.0.0/24 lost its standing with f0: its next socket waits its turn.
        gate.arrive("f0-again", "10.0.0.1", 1.0)
        assert gate.settle(1.0).evicted == ()
        gate.handshake_over("sidecar", 1.5)
        assert gate.settle(1.5).admitted == ("f0-again",)
        gate.complete("f0-again")
        gate.arrive("f0-later", "10.0.0.2", 1.0 + GATE.eviction_memory)
        settled = gate.settle(1.0 + GATE.eviction_memory)
        assert [key for key, _ in settled.evicted] == ["f1"]
        assert settled.admitted == ("f0-later",)

    def test_no_eviction_while_slots_are_free(self) -> None:
        """With most slots free a slow handshake keeps its slot for ``header_timeout``."""
        gate: SourceGate[str] = SourceGate(ListenerLimits(max_handshakes=256))
        gate.arrive("slow", "10.0.0.1", 0.0)
        assert gate.settle(9.9).evicted == ()
        assert gate.next_deadline(9.9) == 10.0

    def test_range_over_its_share_gives_way(self) -> None:
        """With every slot held by one /24, a socket of another range that waits gets one at
        once: the range's oldest unfinished handshake past its grace is evicted for it. Nobody
        else waiting, the range keeps every slot."""
        limits = attrs.evolve(GATE, max_handshakes_per_source=4, min_header_budget=60.0)
        gate: SourceGate[str] = SourceGate(limits)
        for index in range(4):
            assert gate.arrive(f"f{index}", "10.0.0.1", 0.0) is True
        assert gate.arrive("f4", "10.0.0.2", 0.0) is False
        assert gate.settle(1.0).evicted == ()
        assert gate.arrive("sidecar", "192.168.0.1", 1.0) is False
        settled = gate.settle(1.0)
        assert settled.evicted == (("f0", OVER_SHARE),)
        assert settled.admitted == ("sidecar",)
        # Within its grace a handshake is not taken for a share: it may not have been read.
        fresh: SourceGate[str] = SourceGate(limits)
        for index in range(4):
            fresh.arrive(f"f{index}", "10.0.0.1", 0.0)
        fresh.arrive("sidecar", "192.168.0.1", 0.0)
        assert fresh.settle(limits.header_grace / 2).evicted == ()
        assert fresh.next_deadline(limits.header_grace / 2) == limits.header_grace
        assert [key for key, _ in fresh.settle(limits.header_grace).evicted] == ["f0"]

    def test_new_range_served_first(self) -> None:
        """A range that held no slot when its socket came is served before ranges that have
        been waiting in turn; ranges and addresses are then served in turn."""
        gate: SourceGate[str] = SourceGate(
            attrs.evolve(GATE, max_handshakes_per_prefix=4, max_waiting=8)
        )
        for index in range(4):
            gate.arrive(f"h{index}", f"10.0.{index}.1", 0.0)
        for index in range(4):
            gate.arrive(f"w{index}", f"10.0.{index % 2}.{index}", 0.0)
        gate.arrive("sidecar", "192.168.0.1", 0.0)
        turns = []
        for index in range(4):
            gate.handshake_over(f"h{index}", 1.0)
            turns += gate.settle(1.0).admitted
        assert turns == ["sidecar", "w0", "w1", "w2"]

    def test_prefix_of(self) -> None:
        """Addresses count in their /24 (IPv4, mapped or not) or their /64 (IPv6)."""
        assert prefix_of("192.0.2.77") == "192.0.2.0/24"
        assert prefix_of("::ffff:192.0.2.77") == "192.0.2.0/24"
        assert prefix_of("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
        assert prefix_of("fe80::1%eth0") == "fe80::/64"
        assert prefix_of("") == ""


class TestBuckets:
    def test_token_bucket(self) -> None:
        """A bucket allows its burst, then its rate; it says how long until the next token."""
        bucket = TokenBucket(rate=2.0, burst=2, now=0.0)
        assert bucket.take(0.0)
        assert bucket.take(0.0)
        assert not bucket.take(0.0)
        assert bucket.wait(0.0) == 0.5
        assert bucket.take(0.5)

    def test_bucket_map_bounded(self) -> None:
        """A flood of distinct keys keeps at most ``limit`` buckets; full ones go first."""
        buckets = BucketMap(rate=0.001, burst=1, limit=3)
        assert buckets.take("limited", 0.0)
        for index in range(100):
            buckets.take(f"k{index}", 0.0)
        assert len(buckets) <= 3

    def test_tally_finds_the_largest(self) -> None:
        """A tally names a key with the largest count as counts go up and down."""
        tally = Tally()
        for key in ("a", "b", "b", "c", "b"):
            tally.add(key)
        assert tally.largest() == ("b", 3)
        for _ in range(3):
            tally.remove("b")
        assert tally.largest() == ("a", 1)
        assert len(tally) == 2
        tally.remove("a")
        tally.remove("c")
        assert tally.largest() is None

    def test_rate_meter(self) -> None:
        """A steady rate of events reads as that rate, and fades once they stop."""
        meter = RateMeter(window=1.0)
        for index in range(1000):
            meter.note(index / 100)
        assert 95 < meter.rate(10.0) < 105
        assert meter.rate(20.0) < 0.01

    def test_connection_cap(self) -> None:
        """The socket cap is lowered to leave the reserved descriptors free, never below 1."""
        assert connection_cap(4096, 1024, 300) == 724
        assert connection_cap(100, 1_048_576, 300) == 100
        assert connection_cap(100, 200, 300) == 1


class TestSampler:
    def test_flood_is_a_few_lines_with_a_count(self) -> None:
        """The first lines of a key in a window pass; the rest are counted and reported with
        the first line of the next window; other keys are independent."""
        sampler = Sampler(burst=2, window=10.0)
        passed = [sampler.admit("k", 1.0) for _ in range(100)]
        assert passed[:2] == [0, 0]
        assert passed[2:] == [None] * 98
        assert sampler.admit("other", 1.0) == 0
        assert sampler.admit("k", 11.0) == 98


class TestDescriptors:
    def test_plan_reserves_pools_and_headroom(self) -> None:
        """The socket cap keeps the pools' connections and the headroom free, and says when the
        limit forced it below what was asked."""
        low = plan_descriptors(1024, requested=4096, pool_connections=15)
        assert low.max_connections == 1024 - 15 - DESCRIPTOR_HEADROOM
        assert low.too_low
        high = plan_descriptors(65536, requested=4096, pool_connections=15)
        assert high.max_connections == 4096
        assert not high.too_low

    def test_soft_limit_raised_to_hard(self) -> None:
        """In a process started with a low soft limit, the soft limit is raised to the hard
        one."""
        script = (
            "import resource\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "from hubd.daemon.fdlimit import raise_open_file_limit\n"
            "after = raise_open_file_limit()\n"
            "print(after[0], hard if hard != resource.RLIM_INFINITY else 1 << 20)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
        )
        soft, hard = result.stdout.split()
        assert soft == hard
        assert int(soft) > 256
