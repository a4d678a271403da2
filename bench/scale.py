"""What the daemon's periodic statements cost as history grows: 10,000 terminal rows against
many more, in two databases of their own with the same 1,000 active rows due in each, and the
same 200 allocated, connected ones (half of them on an instance that stopped heartbeating).

A statement's cost is the server's execution time of it, as ``EXPLAIN (ANALYZE, TIMING OFF)``
reports it: what grows with the table when a plan reads more than the active rows. The time
around the call, round trip included, is kept beside it but is not the measure: on two cores,
``SELECT 1`` took 0.06 ms on one connection and 0.13 ms on another to the same database, at the
same moment, as the scheduler placed the backend on the client's core or the other one; that
difference, not the table, had put the status count at 1.2-1.5x. A statement that writes runs
in a transaction that is rolled back, so every repetition sees the same rows. Both tables are
``VACUUM ANALYZE``d after their fill, as autovacuum would have done by then, and a checkpoint
writes the fill out before anything is timed. The two sizes are timed in alternation, a few
repetitions of each at a time and each first in every other round, so that whatever else the
machine does in the meantime, and what being timed second costs, falls on both alike. The result
is the median per statement and size, and the ratio large / small.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import asyncpg

from hubd.store.sessions import SESSION_SETTINGS

__all__ = ["ACTIVE_ROWS", "in_turn", "periodic_statements", "statement_costs"]

ACTIVE_ROWS = 1_000
READY_ROWS = 200


def periodic_statements() -> dict[str, tuple[str, Callable[[], tuple[Any, ...]]]]:
    """The statements measured, by name: the SQL the daemon runs and a maker of its arguments.

    Taken from hubd itself so the benchmark follows the code; when the daemon's claim, renewal
    or status counts change shape, change them here too.
    """
    from hubd.store.allocations import CLAIMS, SWEEPS
    from hubd.store.connections import SQL as CONNECTIONS
    from hubd.store.counts import SQL as COUNTS
    from hubd.store.instances import SQL as INSTANCES

    def claim() -> tuple[Any, ...]:
        # The dispatcher's statement, claiming for 16 free slots at once, with an identity per
        # slot for the pending rows it binds.
        bound = CLAIMS.claim_due(
            lease_ids=[uuid.uuid4().hex for _ in range(16)],
            effect_ids=[uuid.uuid4().hex for _ in range(16)],
            sidecar_ids=[uuid.uuid4().hex for _ in range(16)],
            token_hashes=[hashlib.sha256(uuid.uuid4().bytes).digest() for _ in range(16)],
            bindings=json.dumps({"bench": ["1", "bench"]}),
            connect_timeout=60.0,
            instance_id="bench",
            lease_duration=60.0,
            exclude=[],
            room=None,
            listed=[],
            rooms=[],
        )
        return tuple(bound.args)

    def renewal() -> tuple[Any, ...]:
        bound = CLAIMS.renew_leases(
            allocation_ids=[f"al_bench_due_{g}" for g in range(1, 17)],
            lease_ids=[uuid.uuid4().hex for _ in range(16)],
            lease_duration=60.0,
        )
        return tuple(bound.args)

    def bound(statement: Any) -> tuple[str, Callable[[], tuple[Any, ...]]]:
        """A statement whose arguments are the same each time."""
        args = tuple(statement.args)
        return statement.sql, lambda: args

    sample_renewal = CLAIMS.renew_leases(allocation_ids=[], lease_ids=[], lease_duration=60.0)
    # The repair sweep's, the socket check's and the heartbeat's, as the daemon binds them
    # (instance TTL 20 s, connect timeout 60 s, dead instances after ten TTLs).
    held = [f"al_bench_ready_{g}" for g in range(2, 34, 2)]
    return {
        "claim": (CLAIMS.claim_due.sql, claim),
        "renewal": (sample_renewal.sql, renewal),
        "status_count": (COUNTS.count_active().sql, tuple),
        "status_estimate": (COUNTS.estimate_statuses().sql, tuple),
        "repair": bound(
            SWEEPS.mark_unconnected(instance_ttl=20.0, connect_timeout=60.0, instance_id="bench")
        ),
        "stale_sweep": bound(
            CONNECTIONS.sweep_stale(ttl=20.0, instance_id="bench", connect_timeout=60.0)
        ),
        "socket_check": bound(
            CONNECTIONS.check_sockets(
                allocation_ids=held, connection_ids=[f"cn_bench_{g}" for g in range(2, 34, 2)]
            )
        ),
        "heartbeat": bound(INSTANCES.heartbeat(instance_id="bench")),
        "dead_instances": bound(INSTANCES.delete_dead(older_than=200.0)),
    }


async def _fill_terminal(conn: asyncpg.Connection, first: int, last: int) -> None:
    await conn.execute(
        """
        INSERT INTO hubd_allocations
            (id, status, generation, provisioner_id, finished_at, created_at, updated_at)
        SELECT 'al_bench_done_' || g, 'released', 2, 'bench', now(),
               now() - make_interval(secs => g), now()
        FROM generate_series($1::int, $2::int) AS g
        """,
        first,
        last,
    )
    await conn.execute("VACUUM ANALYZE hubd_allocations")


EXPLAIN = "EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) "


async def _samples(
    conn: asyncpg.Connection, sql: str, args: Callable[[], tuple[Any, ...]], reps: int
) -> list[tuple[float, float]]:
    """For each of ``reps`` runs of ``sql``, each rolled back: the server's execution time and
    the time around the call, in milliseconds."""
    samples = []
    for _ in range(reps):
        tx = conn.transaction()
        await tx.start()
        try:
            started = time.perf_counter()
            plan = await conn.fetchval(EXPLAIN + sql, *args())
            around = (time.perf_counter() - started) * 1000
            samples.append((float(json.loads(plan)[0]["Execution Time"]), around))
        finally:
            await tx.rollback()
    return samples


ROUNDS = 20
"""Alternations of the two sizes; each times ``reps / ROUNDS`` repetitions of a statement."""

T = TypeVar("T")


def in_turn(sides: list[T], round_index: int) -> list[T]:
    """The two sizes in the order round ``round_index`` times them: each goes first in every
    other round. The side timed second read slower whichever it was (a statement of 10-40 us
    2.0x with the large table second, 0.37x with it first), so a fixed order put that
    difference in the ratio."""
    return sides if round_index % 2 == 0 else sides[::-1]


async def _prepare(dsn: str, terminal: int) -> asyncpg.Connection:
    """A connection to ``dsn`` with the active rows and ``terminal`` terminal rows in place."""
    # The daemon's own session settings, so a statement is planned as the daemon plans it.
    conn = await asyncpg.connect(dsn, server_settings=SESSION_SETTINGS)
    await conn.execute(
        """
        INSERT INTO hubd_allocations (id, provisioner_id, next_attempt_at)
        SELECT 'al_bench_due_' || g, 'bench', now() - interval '1 second'
        FROM generate_series(1, $1::int) AS g
        """,
        ACTIVE_ROWS,
    )
    # Connected sidecars for the repair and the sweeps to find: READY_ROWS allocated, ready
    # rows, half recorded on a live instance and half on one that stopped heartbeating an hour
    # ago (the stale sweep clears those, the repair marks them lost, the dead instance goes).
    await conn.execute(
        """
        INSERT INTO hubd_instances (id, hostname, pid, heartbeat_at) VALUES
            ('bench', 'bench', 1, now()),
            ('bench_dead', 'bench', 2, now() - interval '1 hour')
        """
    )
    await conn.execute(
        """
        INSERT INTO hubd_allocations
            (id, status, provisioner_id, sidecar_id, token_hash, connection_ready)
        SELECT 'al_bench_ready_' || g, 'allocated', 'bench', 'sc_bench_' || g,
               sha256(g::text::bytea), true
        FROM generate_series(1, $1::int) AS g
        """,
        READY_ROWS,
    )
    await conn.execute(
        """
        INSERT INTO hubd_sidecar_connections
            (connection_id, allocation_id, generation, sidecar_id, instance_id)
        SELECT 'cn_bench_' || g, 'al_bench_ready_' || g, 1, 'sc_bench_' || g,
               CASE WHEN g % 2 = 0 THEN 'bench' ELSE 'bench_dead' END
        FROM generate_series(1, $1::int) AS g
        """,
        READY_ROWS,
    )
    await _fill_terminal(conn, 1, terminal)
    return conn


async def statement_costs(
    small_dsn: str, large_dsn: str, *, small: int, large: int, reps: int
) -> dict[str, Any]:
    """Milliseconds per statement at ``small`` and ``large`` terminal rows, and the ratios."""
    statements = periodic_statements()
    conns: list[asyncpg.Connection] = []
    try:
        conns.append(await _prepare(small_dsn, small))
        conns.append(await _prepare(large_dsn, large))
        # A role that may not checkpoint (an external server's) leaves it to the server.
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
            await conns[0].execute("CHECKPOINT")
        # One warm-up pass so both sizes are measured with plans and pages cached.
        for conn in conns:
            for sql, args in statements.values():
                await _samples(conn, sql, args, 5)
        samples: dict[str, tuple[list[tuple[float, float]], ...]] = {
            name: ([], []) for name in statements
        }
        per_round = max(1, reps // ROUNDS)
        for round_index in range(ROUNDS):
            # Each rolled-back write leaves dead row versions and index entries behind (the
            # repair and the stale sweep, 100 rows a run): left to pile up over hundreds of runs
            # in seconds, they slowed every later statement, the index-only status count most
            # (0.10 -> 0.7-1.1 ms). So every round starts clean at both sizes. INDEX_CLEANUP ON:
            # by default VACUUM leaves the index entries of so few dead rows in place when they
            # are on under 2% of the table's pages, which they are at 1,000,000 rows and not at
            # 10,000, and the large table alone kept its dead entries (the count 0.13 -> 0.42 ms).
            for conn in conns:
                await conn.execute(
                    "VACUUM (INDEX_CLEANUP ON)"
                    " hubd_allocations, hubd_sidecar_connections, hubd_instances"
                )
            for name, (sql, args) in statements.items():
                sides = list(zip(conns, samples[name], strict=True))
                for conn, taken in in_turn(sides, round_index):
                    taken.extend(await _samples(conn, sql, args, per_round))
    finally:
        for conn in conns:
            await conn.close()

    def median(taken: list[tuple[float, float]], which: int) -> float:
        return statistics.median(sample[which] for sample in taken)

    costs = {}
    for name, (at_small, at_large) in samples.items():
        ms_small, ms_large = median(at_small, 0), median(at_large, 0)
        costs[name] = {
            "ms_small": ms_small,
            "ms_large": ms_large,
            "ratio": ms_large / ms_small,
            "call_ms_small": median(at_small, 1),
            "call_ms_large": median(at_large, 1),
        }
    return {"small": small, "large": large, "reps": reps, "statements": costs}
