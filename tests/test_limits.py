"""The listener's resource bounds as plain decisions: no sockets, no database, no clock."""

from __future__ import annotations

import subprocess
import sys

from hubd.daemon.fdlimit import plan_descriptors
from hubd.logs import Sampler
from hubd.server.limits import (
    DESCRIPTOR_HEADROOM,
    BucketMap,
    HeaderScanner,
    ListenerLimits,
    SourceGate,
    TokenBucket,
    connection_cap,
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
        """Unfinished handshakes are capped per source, then in total; finishing frees both."""
        gate = SourceGate(LIMITS)
        for source in ("a", "a"):
            assert gate.admit(source, 0.0) is None
            gate.opened(source)
        refused = gate.admit("a", 0.0)
        assert refused is not None
        assert refused.status == 429
        gate.opened("b")
        total = gate.admit("c", 0.0)
        assert total is not None
        # A slot is evictable within the eviction age: the refused socket is told to come
        # back then, not after the general Retry-After.
        assert (total.status, total.reason, total.retry_after) == (503, "too many handshakes", 1)
        assert LIMITS.retry_after > 1
        gate.handshake_over("a")
        assert gate.admit("c", 0.0) is None
        assert gate.sources == 2

    def test_socket_cap(self) -> None:
        """Established sockets count until closed; over the cap a socket gets 503."""
        gate = SourceGate(LIMITS, max_connections=1)
        gate.opened("a")
        gate.handshake_over("a")
        refused = gate.admit("b", 0.0)
        assert refused is not None
        assert (refused.status, refused.reason, refused.retry_after) == (
            503,
            "too many connections",
            LIMITS.retry_after,
        )
        gate.closed()
        assert gate.admit("b", 0.0) is None

    def test_failures_per_source(self) -> None:
        """A source that keeps failing is refused with 429 until its bucket refills; others are
        not affected."""
        gate = SourceGate(LIMITS)
        gate.failed("a", 0.0)
        gate.failed("a", 0.0)
        refused = gate.admit("a", 0.0)
        assert refused is not None
        assert refused.status == 429
        assert refused.retry_after is not None
        assert refused.retry_after >= 1
        assert gate.admit("b", 0.0) is None
        assert gate.admit("a", 1.0) is None


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
