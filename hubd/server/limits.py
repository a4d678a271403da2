"""Resource bounds of the sidecar listener, as plain decisions over counters and a passed-in clock.

The listener faces every process that can reach it, so every resource a peer can make it hold
has a cap, and the caps multiply out to a bound on memory and descriptors:

* unfinished handshakes: at most ``max_handshakes`` in total and ``max_handshakes_per_source``
  from one address, each allowed ``max_handshake_bytes`` before it is upgraded, so unfinished
  handshakes hold at most ``max_handshakes * max_handshake_bytes`` (2 MiB by default) and one
  address at most ``max_handshakes_per_source * max_handshake_bytes`` (256 KiB);
* header shape: ``max_header_lines`` lines of at most ``max_header_line`` bytes. A handshake
  needs about a dozen short headers (Host, Upgrade, Connection, four Sec-WebSocket-*,
  Authorization, three Hubd-*, User-Agent), the longest being the ~80-byte Authorization line.
  nginx's defaults (``client_header_buffer_size 1k``, ``large_client_header_buffers 4 8k``) fit
  general-purpose browsers; these are sized for this protocol with room to spare;
* sockets: at most ``max_connections`` (pending and established) at once, chosen below the
  descriptor limit with headroom for the database pools, the admin listener and provisioners
  (:func:`connection_cap`); more are refused with 503 and ``Retry-After`` before any header is
  read;
* a peer that does not read: its write buffer may grow to ``max_write_buffer`` and writing may
  stall for ``write_stall_timeout``; then the socket is aborted. websockets' own flow control
  (``write_limit``) only makes writers wait in ``drain()``, and its keepalive ping and close
  both wait there too, so without this a non-reading peer is never dropped;
* failed handshakes: a token bucket per source address; an address that keeps failing is
  refused with 429 for a while before its headers are read (what nginx's ``limit_req`` does);
* reconnects: a token bucket per allocation, so a token holder reconnecting in a loop cannot
  append ledger rows and connection records without limit (429 with ``Retry-After``).
"""

from __future__ import annotations

import math
from typing import Final

import attrs

from hubd.server.handshake import Rejection

__all__ = [
    "DESCRIPTOR_HEADROOM",
    "BucketMap",
    "HeaderScanner",
    "ListenerLimits",
    "SourceGate",
    "TokenBucket",
    "connection_cap",
]

DESCRIPTOR_HEADROOM: Final = 256
"""Descriptors kept free beyond the listener's sockets and the pools: the admin listener, the
wake-up connection, provisioners' pipes and children, log files and the odd ``open()``."""


@attrs.frozen(kw_only=True)
class ListenerLimits:
    """The listener's caps (see the module docstring for how they were sized)."""

    max_connections: int = 4096
    max_handshakes: int = 256
    max_handshakes_per_source: int = 32
    max_handshake_bytes: int = 8192
    max_header_lines: int = 32
    max_header_line: int = 2048
    # websockets' guidance: memory per connection is about max_size * max_queue on the way in;
    # 4 queued 64 KiB messages is plenty for a peer that sends a heartbeat every 20 s.
    max_queue: int = 4
    max_write_buffer: int = 256 * 1024
    write_stall_timeout: float = 5.0
    bad_handshake_rate: float = 1.0
    bad_handshake_burst: int = 30
    reconnect_rate: float = 0.2
    reconnect_burst: int = 10
    max_tracked: int = 10_000
    """Source addresses and allocations whose buckets are remembered; beyond it the fullest
    (least interesting) are forgotten first."""
    retry_after: int = 5
    handshake_eviction_age: float = 1.0
    """With every handshake slot taken, a new socket evicts the oldest unfinished handshake
    that has run this long instead of being refused: a real sidecar finishes its handshake in
    milliseconds, so slots held longer are the likeliest to be a half-open flood (the reason
    nginx keeps `client_header_timeout` short), and a legitimate sidecar is not sent away to
    wait out Retry-After behind them."""


def connection_cap(requested: int, descriptor_limit: int, reserved: int) -> int:
    """The sockets the listener may hold: ``requested``, lowered so that ``reserved``
    descriptors (pools, headroom) stay free under ``descriptor_limit``; at least 1."""
    return max(1, min(requested, descriptor_limit - reserved))


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` kept; the clock is passed in."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = now

    def _refill(self, now: float) -> None:
        self._tokens = min(self._burst, self._tokens + max(0.0, now - self._at) * self._rate)
        self._at = now

    def take(self, now: float) -> bool:
        """Spend one token; ``False`` (and nothing spent) when none is left."""
        self._refill(now)
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def available(self, now: float) -> bool:
        self._refill(now)
        return self._tokens >= 1

    def full(self, now: float) -> bool:
        self._refill(now)
        return self._tokens >= self._burst

    def wait(self, now: float) -> float:
        """Seconds until a token is available."""
        self._refill(now)
        return max(0.0, (1 - self._tokens) / self._rate) if self._rate > 0 else float("inf")


class BucketMap:
    """A token bucket per key, for at most ``limit`` keys.

    Full buckets carry no information and are forgotten first; if every bucket is in use, the
    oldest goes, so a flood of distinct keys costs bounded memory (it can at worst make the
    map forget a key that was being limited, never refuse one that was not).
    """

    def __init__(self, rate: float, burst: int, limit: int) -> None:
        self._rate = rate
        self._burst = burst
        self._limit = limit
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, key: str, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            self._make_room(now)
            bucket = self._buckets[key] = TokenBucket(self._rate, self._burst, now)
        return bucket.take(now)

    def available(self, key: str, now: float) -> bool:
        bucket = self._buckets.get(key)
        return bucket is None or bucket.available(now)

    def wait(self, key: str, now: float) -> float:
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.wait(now)

    def _make_room(self, now: float) -> None:
        if len(self._buckets) < self._limit:
            return
        for key in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[key]
        while len(self._buckets) >= self._limit:
            del self._buckets[next(iter(self._buckets))]

    def __len__(self) -> int:
        return len(self._buckets)


class HeaderScanner:
    """Counts what a peer sends before its upgrade: total bytes, header lines and their length.

    Fed every chunk as it arrives, before websockets buffers and parses it, so an oversized
    handshake is refused after at most ``max_handshake_bytes`` have been read.
    """

    def __init__(self, limits: ListenerLimits) -> None:
        self._limits = limits
        self.received = 0
        self._line = 0
        self._lines = 0
        self.complete = False

    def feed(self, data: bytes) -> str | None:
        """``None`` while the handshake stays in bounds; otherwise what it exceeded."""
        self.received += len(data)
        if self.received > self._limits.max_handshake_bytes:
            return "request header too large"
        if self.complete:
            return None
        pieces = data.split(b"\n")
        for index, piece in enumerate(pieces):
            self._line += len(piece)
            if self._line > self._limits.max_header_line:
                return "request header line too long"
            if index == len(pieces) - 1:
                break
            if self._line <= 1:  # "\r\n" alone: the end of the header block
                self.complete = True
                return None
            self._lines += 1
            # The request line is one of them, and is not a header.
            if self._lines > self._limits.max_header_lines + 1:
                return "too many request headers"
            self._line = 0
        return None


class SourceGate:
    """Admission of new sockets: counts of sockets and unfinished handshakes, per source
    address and in total, and the failed-handshake bucket of each source."""

    def __init__(self, limits: ListenerLimits, *, max_connections: int | None = None) -> None:
        self.limits = limits
        self.max_connections = max_connections or limits.max_connections
        self.sockets = 0
        self.handshakes = 0
        self.lingering = 0
        """Refused sockets kept open a moment so their peers read the refusal."""
        self._per_source: dict[str, int] = {}
        self._failures = BucketMap(
            limits.bad_handshake_rate, limits.bad_handshake_burst, limits.max_tracked
        )

    def admit(self, source: str, now: float) -> Rejection | None:
        """Whether a socket that just arrived from ``source`` may start a handshake."""
        retry = self.limits.retry_after
        if self.sockets >= self.max_connections:
            return Rejection(status=503, reason="too many connections", retry_after=retry)
        if self.handshakes >= self.limits.max_handshakes:
            # Every slot was taken less than the eviction age ago (an older one would have
            # been evicted for this socket): one is evictable by then, so come back then
            # rather than after the general Retry-After.
            soon = max(1, math.ceil(self.limits.handshake_eviction_age))
            return Rejection(status=503, reason="too many handshakes", retry_after=soon)
        if self._per_source.get(source, 0) >= self.limits.max_handshakes_per_source:
            return Rejection(
                status=429, reason="too many handshakes from this address", retry_after=retry
            )
        if not self._failures.available(source, now):
            wait = max(retry, round(self._failures.wait(source, now) + 0.5))
            return Rejection(status=429, reason="too many failed handshakes", retry_after=wait)
        return None

    def opened(self, source: str) -> None:
        self.sockets += 1
        self.handshakes += 1
        self._per_source[source] = self._per_source.get(source, 0) + 1

    def handshake_over(self, source: str) -> None:
        self.handshakes -= 1
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            del self._per_source[source]

    def closed(self) -> None:
        self.sockets -= 1

    def failed(self, source: str, now: float) -> None:
        """A handshake from ``source`` was refused for something the peer got wrong."""
        self._failures.take(source, now)

    @property
    def sources(self) -> int:
        return len(self._per_source)

    @property
    def handshakes_full(self) -> bool:
        return self.handshakes >= self.limits.max_handshakes
