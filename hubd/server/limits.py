"""Resource bounds of the sidecar listener, as plain decisions over counters and a passed-in clock
(who gets a handshake slot is :mod:`hubd.server.slots`).

The listener faces every process that can reach it, so every resource a peer can make it hold
has a cap, and the caps multiply out to a bound on memory and descriptors:

* unfinished handshakes: at most ``max_handshakes`` in total and ``max_handshakes_per_source``
  from one address, plus one for every request the address delivered whole since its last
  failed or evicted handshake, up to ``max_handshakes_per_prefix`` (its range's share: a host
  dialling many sidecars earns the throughput of many hosts, a slow-loris earns nothing), each
  allowed ``max_handshake_bytes`` before it is upgraded, so unfinished handshakes hold at most
  ``max_handshakes * max_handshake_bytes`` (2 MiB by default) and one address at most
  ``max_handshakes_per_prefix * max_handshake_bytes`` (1 MiB);
* sockets waiting for a handshake slot: at most ``max_waiting``, each for ``max_queue_wait``.
  A socket that finds its address's slots (or every slot) taken waits for one instead of being
  refused, as HAProxy's ``maxconn`` queue holds a connection rather than refusing it. It waits
  unread: its request stays in the kernel's socket buffer, so it costs a descriptor and the
  connection object, within ``max_connections``, and no handshake bytes (should the event loop
  deliver a first read before the pause takes hold, that one read is kept for its turn, within
  ``max_handshake_bytes``: 1 MiB for all of them at worst). Slots go to waiting sockets in turn
  by address range (a /24 or a /64), by address within a range, and in arrival order within an
  address; a range in good standing (below) is served first, as fq_codel serves new flows
  first, so a sidecar dialling through a flood from other ranges waits for one slot, not for
  the flood. A refusal says when a slot is expected (``Retry-After``: the queue over the rate
  slots were freed at lately), at least 1 s (``Retry-After`` is whole seconds) and at most
  ``retry_after``;
* behaviour, not age: a handshake must deliver its complete request (a real client sends the
  request line and headers in one write right after connecting) within a budget that shrinks
  as slots fill, from ``header_timeout`` with half the slots free or more to
  ``min_header_budget`` with none (Envoy's overload manager scales its timeouts the same way;
  nginx's ``client_header_timeout`` is the fixed form); one that has not is evicted. With every
  slot taken, the oldest unfinished handshake past ``header_grace`` gives its slot at once to a
  waiting socket of a range in good standing (none of its handshakes unfinished now or evicted
  within ``eviction_memory``, as HAProxy's stick tables remember a source's behaviour), and, while
  a socket of another range waits, to one of a range within its share when its own range holds
  more than ``max_handshakes_per_prefix``. A flood's ranges lose their standing with their first
  eviction, so a flood cannot churn the slots faster than the budget lets it. A handshake whose
  request is complete (authenticating, waiting for the database) is never evicted: the delay is
  the hub's, and ``max_handshakes`` bounds it;
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

from typing import Final

import attrs

__all__ = [
    "DESCRIPTOR_HEADROOM",
    "BucketMap",
    "HeaderScanner",
    "ListenerLimits",
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
    """The ``Retry-After`` of a refusal whose end nothing predicts (all sockets taken, the
    database unavailable), and the most a refusal for a handshake slot says."""
    max_handshakes_per_prefix: int = 128
    """Slots one address range (/24, /64) may hold while a socket of another range waits: half,
    so a flood from many addresses of one range leaves the other half to everyone else."""
    max_waiting: int = 128
    """Sockets waiting for a handshake slot (lowered to a quarter of ``max_connections``): half
    as many as the slots, enough for a burst from one address to queue behind its own cap
    without the queue's descriptors and connection objects outgrowing the slots' own."""
    max_queue_wait: float = 5.0
    """How long a socket waits for a slot before it is refused; below the handshake's 10 s
    (``open_timeout``, counted from the connection), so that a refusal, not a reset, ends it."""
    header_timeout: float = 10.0
    """How long a handshake may take to deliver its complete request while half the slots or
    more are free: the whole handshake's own bound."""
    min_header_budget: float = 0.5
    """The same with every slot taken. A real sidecar's request arrives within a turn of each
    event loop; half a second leaves a loaded machine's stalls room, and a flood that holds
    every slot gives up all of them twice a second."""
    header_grace: float = 0.05
    """A handshake's first moments, in which its request has not been read yet for reasons of
    the hub's own (the read comes on the loop's next turn): no waiting socket takes it then."""
    eviction_memory: float = 10.0
    """How long a range whose handshake was evicted waits its turn like any other range instead
    of taking an unfinished handshake's slot."""


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
