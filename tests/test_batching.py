"""Batched statements: identity look-ups (and welcome acknowledgements) that arrive while a
statement runs share the next one. Real PostgreSQL; a statement is held up by a table lock
another session takes, so which requests share a statement is decided by the test, not by
timing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from hubd.errors import BatchFull, DatabaseUnavailable
from hubd.routing import Target
from hubd.server.batching import Batcher
from hubd.server.sockets import new_connection_id
from hubd.store import AllocationStore, Database, connect_database
from hubd.store.connection_values import (
    Admission,
    Record,
    RecordOutcome,
    RecordRequest,
    SidecarIdentity,
)
from hubd.store.connections import ConnectionStore
from hubd.store.secrets import Acknowledgement, Rotation
from hubd.tokens import hash_token, new_reconnect_secret
from tests.polling import eventually
from tests.wskit import (
    Sidecar,
    dial,
    record_row,
    rejection,
    running_hub,
    secret_acknowledged,
    sidecar_in,
    take_away,
    welcome_of,
    wrong_token,
)


@asynccontextmanager
async def table_locked(database_url: str, table: str = "hubd_allocations") -> AsyncIterator[None]:
    """Every statement reading ``table`` waits until the block ends."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await conn.close()


async def blocked_on_the_lock(database_url: str) -> bool:
    """Some session waits for a lock: the statement under test reached the server."""
    conn = await asyncpg.connect(database_url)
    try:
        n: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return n > 0
    finally:
        await conn.close()


class Counted:
    """``ConnectionStore.identities``, remembering the keys of each call."""

    def __init__(self, connections: ConnectionStore) -> None:
        self.connections = connections
        self.calls: list[list[str]] = []

    async def __call__(self, keys: list[str]) -> Mapping[str, SidecarIdentity]:
        self.calls.append(keys)
        return await self.connections.identities(keys)


async def several(store: AllocationStore, db: Database, n: int) -> list[Sidecar]:
    return [(await sidecar_in(store, db))[0] for _ in range(n)]


async def first_waits_rest_queue(
    batcher: Batcher[Any, Any], keys: list[Any], database_url: str, table: str
) -> list[Any]:
    """Request ``keys[0]`` while ``table`` is locked, so its statement waits on the lock, and the
    other keys meanwhile; their answers, in key order, once the lock is gone."""
    async with table_locked(database_url, table):
        first = asyncio.create_task(batcher.request(keys[0]))
        await eventually(lambda: batcher.batches == 1)
        rest = [asyncio.create_task(batcher.request(key)) for key in keys[1:]]
        await eventually(lambda: batcher.waiting == len(rest))
    return [await first, *[await task for task in rest]]


class TestBatcher:
    async def test_lookups_arriving_meanwhile_share_the_next_statement(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Look-ups made while one statement runs all go in the next one, and each gets
        exactly the identity a look-up of its own would have returned (an unknown id:
        nothing)."""
        sidecars = await several(store, db, 5)
        connections = ConnectionStore(db, instance_id="in_test")
        counted = Counted(connections)
        batcher = Batcher(counted, name="test-lookups", timeout=30)
        keys = [s.allocation_id for s in sidecars] + ["al_unknown", sidecars[1].allocation_id]
        answers = await first_waits_rest_queue(batcher, keys, database_url, "hubd_allocations")
        assert counted.calls == [[keys[0]], keys[1:-1]]
        for key, answer in zip(keys, answers, strict=True):
            assert answer == await connections.identity(key)
        assert answers[-2] is None
        assert answers[-1] == answers[1]
        for sidecar, answer in zip(sidecars, answers, strict=False):
            assert answer is not None
            assert answer.allocation_id == sidecar.allocation_id
        assert batcher.batches == 2
        # Seven requests, the repeated key's two in one: what the metrics divide by batches.
        assert batcher.carried == len(keys)

    async def test_as_many_statements_at_once_as_allowed(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """With a concurrency of two, a second look-up goes at once while the first's
        statement runs; only a third one waits, and it shares the next statement."""
        sidecars = await several(store, db, 4)
        counted = Counted(ConnectionStore(db, instance_id="in_test"))
        batcher = Batcher(counted, name="test-lookups", timeout=30, concurrency=2)
        keys = [s.allocation_id for s in sidecars]
        async with table_locked(database_url):
            first = asyncio.create_task(batcher.request(keys[0]))
            await eventually(lambda: len(counted.calls) == 1)
            second = asyncio.create_task(batcher.request(keys[1]))
            await eventually(lambda: len(counted.calls) == 2)
            rest = [asyncio.create_task(batcher.request(key)) for key in keys[2:]]
            await eventually(lambda: batcher.waiting == len(rest))
            assert batcher.running == 2
        answers = [await first, await second, *[await task for task in rest]]
        assert [a.allocation_id if a else None for a in answers] == keys
        assert counted.calls == [[keys[0]], [keys[1]], keys[2:]]

    async def test_a_request_right_after_an_answer_gets_its_own(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A waiter that asks again as soon as it has its answer (before the statement's
        runner is fully gone) starts a statement of its own instead of waiting for nobody."""
        sidecars = await several(store, db, 3)
        batcher = Batcher(
            ConnectionStore(db, instance_id="in_test").identities,
            name="test-lookups",
            timeout=5,
        )
        for sidecar in sidecars:
            answer = await batcher.request(sidecar.allocation_id)
            assert answer is not None
            assert answer.allocation_id == sidecar.allocation_id
        assert batcher.batches == len(sidecars)

    async def test_a_cancelled_waiter_leaves_the_others_their_answers(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """A waiter cancelled while its statement runs, and one cancelled while it still
        queues, take nothing from the others: they get their answers, and the queued one's
        key is not asked for."""
        running, cancelled_running, queued, cancelled_queued = await several(store, db, 4)
        counted = Counted(ConnectionStore(db, instance_id="in_test"))
        batcher = Batcher(counted, name="test-lookups", timeout=30)
        async with table_locked(database_url):
            first = asyncio.create_task(batcher.request(running.allocation_id))
            gone = asyncio.create_task(batcher.request(cancelled_running.allocation_id))
            await eventually(lambda: len(counted.calls) == 1)
            later = asyncio.create_task(batcher.request(queued.allocation_id))
            dropped = asyncio.create_task(batcher.request(cancelled_queued.allocation_id))
            await eventually(lambda: batcher.waiting == 2)
            gone.cancel()
            dropped.cancel()
            await eventually(lambda: batcher.waiting == 1)
        first_answer, later_answer = await first, await later
        assert first_answer is not None
        assert first_answer.allocation_id == running.allocation_id
        assert later_answer is not None
        assert later_answer.allocation_id == queued.allocation_id
        assert gone.cancelled()
        assert dropped.cancelled()
        assert counted.calls == [
            [running.allocation_id, cancelled_running.allocation_id],
            [queued.allocation_id],
        ]

    async def test_an_error_reaches_every_waiter_of_the_statement(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """A statement that fails fails every look-up it carried, as unavailable (never as
        "no such allocation"), and the next statement runs again."""
        sidecars = await several(store, db, 3)
        spare = await connect_spare(database_url)
        try:
            batcher = Batcher(
                ConnectionStore(spare, instance_id="in_test").identities,
                name="test-lookups",
                timeout=30,
            )
            await take_away(spare)
            results = await asyncio.gather(
                *(batcher.request(s.allocation_id) for s in sidecars), return_exceptions=True
            )
            assert all(isinstance(result, DatabaseUnavailable) for result in results)
            assert batcher.batches < len(sidecars)
        finally:
            await spare.close()

    async def test_waiters_beyond_the_cap_are_refused_at_once(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """With as many look-ups waiting as allowed, one more is refused at once; one that
        times out frees its place and the rest still get their answers."""
        first, second, third = await several(store, db, 3)
        counted = Counted(ConnectionStore(db, instance_id="in_test"))
        batcher = Batcher(counted, name="test-lookups", timeout=30, max_waiting=1)
        async with table_locked(database_url):
            running = asyncio.create_task(batcher.request(first.allocation_id))
            await eventually(lambda: len(counted.calls) == 1)
            waiting = asyncio.create_task(batcher.request(second.allocation_id))
            await eventually(lambda: batcher.waiting == 1)
            with pytest.raises(BatchFull):
                await batcher.request(third.allocation_id)
        assert (await running) is not None
        assert (await waiting) is not None
        assert batcher.waiting == 0

    async def test_a_statement_past_its_timeout_times_out_its_waiters(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """A statement that does not answer within the timeout leaves no waiter hanging."""
        (sidecar,) = await several(store, db, 1)
        batcher = Batcher(
            ConnectionStore(db, instance_id="in_test").identities,
            name="test-lookups",
            timeout=0.2,
        )
        async with table_locked(database_url):
            with pytest.raises(TimeoutError):
                await batcher.request(sidecar.allocation_id)
        assert await batcher.request(sidecar.allocation_id) is not None

    async def test_each_request_times_out_at_its_own_deadline(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Requests share one timer: the first request times out with its statement, and the
        one that queued behind it times out at its own deadline, while the statement that
        took it after the first timed out still waits; the batcher then answers again."""
        first, queued = await several(store, db, 2)
        counted = Counted(ConnectionStore(db, instance_id="in_test"))
        batcher = Batcher(counted, name="test-lookups", timeout=0.5)

        async def running_when_it_timed_out(allocation_id: str) -> int:
            with pytest.raises(TimeoutError):
                await batcher.request(allocation_id)
            return batcher.running

        loop = asyncio.get_running_loop()
        async with table_locked(database_url):
            sent = loop.time()
            leading = asyncio.create_task(running_when_it_timed_out(first.allocation_id))
            await eventually(lambda: len(counted.calls) == 1)
            # The second request comes at least a quarter second after the first, so that its
            # own deadline falls that long after the first's timeout: a loaded machine's late
            # timer must not expire both at once, before a statement could take the second.
            await eventually(lambda: loop.time() >= sent + 0.25, every=0.01)
            behind = asyncio.create_task(running_when_it_timed_out(queued.allocation_id))
            await leading
            # Its own deadline, not its statement's timeout half a second later.
            assert await behind == 1
            assert counted.calls == [[first.allocation_id], [queued.allocation_id]]
        answer = await batcher.request(queued.allocation_id)
        assert answer is not None
        assert answer.allocation_id == queued.allocation_id


async def connect_spare(database_url: str) -> Database:
    """Pools of their own, for a test to take away."""
    return await connect_database(database_url, pool_size=2)


class TestBatchedHandshakes:
    async def test_concurrent_handshakes_share_statements_and_a_wrong_token_is_401(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Handshakes that arrive while an admission runs are checked together, each against
        its own identity: the good ones are welcomed, the one with a wrong token is 401 and
        leaves no record."""
        sidecars = await several(store, db, 6)
        impostor = sidecars[3]
        async with running_hub(db, lookup_timeout=60) as hub:
            lookups = hub.server.admissions

            async def handshake(sidecar: Sidecar) -> int:
                if sidecar is impostor:
                    headers = sidecar.headers(Authorization=f"Bearer {wrong_token()}")
                    return (await rejection(hub.url, headers)).response.status_code
                async with dial(hub.url, sidecar.headers()) as ws:
                    welcome = await welcome_of(ws)
                    assert welcome["allocation_id"] == sidecar.allocation_id
                    return 101

            async with table_locked(database_url):
                tasks = [asyncio.create_task(handshake(s)) for s in sidecars]
                # However many made the first statement, the rest wait for the second.
                await eventually(lambda: lookups.running + lookups.waiting == len(sidecars))
                await eventually(lambda: blocked_on_the_lock(database_url))
            statuses = [await task for task in tasks]
            assert statuses == [101, 101, 101, 401, 101, 101]
            # One statement at a time: the first, and the one the rest shared.
            assert lookups.batches <= 2
            assert await record_row(db, impostor.allocation_id) is None

    async def test_the_hubs_admissions_and_lookups_run_one_statement_at_a_time(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """While one admission statement (or look-up statement) of the hub runs, the requests
        that arrive wait for the next one rather than start a second: every record notifies,
        and PostgreSQL commits notifying transactions one at a time, so a second statement
        would only wait for the first's commit (docs/performance.md)."""
        sidecars = await several(store, db, 4)
        async with running_hub(db, lookup_timeout=60) as hub:
            admissions = hub.server.admissions
            requests = [
                Admission(
                    connection_id=new_connection_id(),
                    target=each.target,
                    sidecar_id=each.sidecar_id,
                    version=2,
                    token_hash=hash_token(each.token),
                    presented_hash=None,
                    secret_hash=hash_token(new_reconnect_secret()),
                )
                for each in sidecars
            ]
            table = "hubd_sidecar_connections"
            written = await first_waits_rest_queue(admissions, requests, database_url, table)
            assert [a and a.record and a.record.outcome for a in written] == [
                RecordOutcome.RECORDED
            ] * len(requests)
            assert admissions.batches == 2
            for each, request in zip(sidecars, requests, strict=True):
                row = await record_row(db, each.allocation_id)
                assert row is not None
                assert row["connection_id"] == request.connection_id

            lookups = hub.server.lookups
            keys = [each.allocation_id for each in sidecars]
            found = await first_waits_rest_queue(lookups, keys, database_url, "hubd_allocations")
            assert [i and i.sidecar_id for i in found] == [each.sidecar_id for each in sidecars]
            assert lookups.batches == 2

    async def test_every_waiting_handshake_is_503_while_the_database_is_down(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """With the identity pool's database gone, every handshake of a batch is refused
        with 503 and Retry-After, never 401."""
        sidecars = await several(store, db, 4)
        spare = await connect_spare(database_url)
        try:
            async with running_hub(db, lookup_db=spare, retry_after=3) as hub:
                await take_away(spare)
                refusals = await asyncio.gather(
                    *(rejection(hub.url, s.headers()) for s in sidecars)
                )
            for refused in refusals:
                assert refused.response.status_code == 503
                assert refused.response.headers["Retry-After"] == "3"
        finally:
            await spare.close()


async def rotated(connections: ConnectionStore, sidecar: Sidecar) -> bytes:
    """Record a v2 connection of ``sidecar``: its generation gets a fresh, unacknowledged
    secret, whose digest is returned."""
    secret_hash = hash_token(new_reconnect_secret())
    rotation = Rotation(seen_hash=None, secret_hash=secret_hash, presented_hash=None)
    record = await connections.record(
        new_connection_id(), sidecar.target, sidecar.sidecar_id, rotation=rotation
    )
    assert record.outcome is RecordOutcome.RECORDED
    return secret_hash


class TestAcknowledgements:
    async def test_each_acknowledgement_of_a_statement_is_guarded_on_its_own(
        self, db: Database, store: AllocationStore
    ) -> None:
        """Several acknowledgements in one statement: each takes effect exactly when it would
        alone (the current secret of the current identity, not yet acknowledged); a stale
        secret or another generation's acknowledgement changes nothing."""
        good, stale, other_generation, also_good = await several(store, db, 4)
        connections = ConnectionStore(db, instance_id="in_test")
        hashes = [await rotated(connections, each) for each in (good, stale, other_generation)]
        also_hash = await rotated(connections, also_good)
        acks = [
            Acknowledgement(good.target, good.sidecar_id, hashes[0]),
            Acknowledgement(stale.target, stale.sidecar_id, hash_token(new_reconnect_secret())),
            Acknowledgement(
                Target(other_generation.allocation_id, other_generation.generation + 1),
                other_generation.sidecar_id,
                hashes[2],
            ),
            Acknowledgement(also_good.target, also_good.sidecar_id, also_hash),
        ]
        assert await connections.acknowledge_secrets(acks) == {acks[0]: True, acks[3]: True}
        assert await secret_acknowledged(db, good.allocation_id)
        assert await secret_acknowledged(db, also_good.allocation_id)
        assert not await secret_acknowledged(db, stale.allocation_id)
        assert not await secret_acknowledged(db, other_generation.allocation_id)
        # Acknowledged already: nothing to do again.
        assert await connections.acknowledge_secrets(acks[:1]) == {}

    async def test_acknowledgements_arriving_meanwhile_share_the_next_statement(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Acknowledgements made while one statement runs go together in the next; each
        waiter learns whether its own took effect."""
        sidecars = await several(store, db, 4)
        connections = ConnectionStore(db, instance_id="in_test")
        acks = [
            Acknowledgement(each.target, each.sidecar_id, await rotated(connections, each))
            for each in sidecars
        ]
        calls: list[int] = []

        async def counted(keys: list[Acknowledgement]) -> Mapping[Acknowledgement, bool]:
            calls.append(len(keys))
            return await connections.acknowledge_secrets(keys)

        batcher = Batcher(counted, name="test-acknowledgements", timeout=30)
        answers = await first_waits_rest_queue(batcher, acks, database_url, "hubd_sidecar_secrets")
        assert answers == [True] * len(acks)
        assert calls == [1, len(acks) - 1]
        for each in sidecars:
            assert await secret_acknowledged(db, each.allocation_id)


class TestRecords:
    async def test_each_record_of_a_statement_is_guarded_on_its_own(
        self, db: Database, store: AllocationStore
    ) -> None:
        """Several connections recorded in one statement: each outcome is the one it would
        have had alone, and only the accepted ones are written (their records, their secret
        rotations)."""
        good, wrong_sidecar, finished, lost_rotation, rotating = await several(store, db, 5)
        connections = ConnectionStore(db, instance_id="in_test")
        await rotated(connections, lost_rotation)
        earlier = await record_row(db, lost_rotation.allocation_id)
        assert earlier is not None
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET status = 'released', next_attempt_at = NULL,"
                " connection_ready = false, lease_id = NULL, lease_expires_at = NULL"
                " WHERE id = $1",
                finished.allocation_id,
            )
        fresh_secret = hash_token(new_reconnect_secret())
        requests = [
            RecordRequest("cn_good", good.target, good.sidecar_id),
            RecordRequest("cn_wrong", wrong_sidecar.target, "sc_someone_else"),
            RecordRequest("cn_finished", finished.target, finished.sidecar_id),
            RecordRequest("cn_missing", Target("al_missing", 1), "sc_missing"),
            # Saw no secret, but the generation has one now: another handshake rotated first.
            RecordRequest(
                "cn_lost",
                lost_rotation.target,
                lost_rotation.sidecar_id,
                Rotation(seen_hash=None, secret_hash=fresh_secret, presented_hash=None),
            ),
            RecordRequest(
                "cn_rotating",
                rotating.target,
                rotating.sidecar_id,
                Rotation(seen_hash=None, secret_hash=fresh_secret, presented_hash=None),
            ),
        ]
        outcomes = await connections.record_many(requests)
        assert [outcomes[r].outcome for r in requests] == [
            RecordOutcome.RECORDED,
            RecordOutcome.FENCED,
            RecordOutcome.RETIRED,
            RecordOutcome.RETIRED,
            RecordOutcome.SUPERSEDED,
            RecordOutcome.RECORDED,
        ]
        for sidecar, expected in [
            (good, "cn_good"),
            (wrong_sidecar, None),
            (finished, None),
            (lost_rotation, earlier["connection_id"]),
            (rotating, "cn_rotating"),
        ]:
            row = await record_row(db, sidecar.allocation_id)
            assert (row and row["connection_id"]) == expected
        async with db.pool.acquire() as conn:
            secrets = dict(
                await conn.fetch(
                    "SELECT allocation_id, secret_hash FROM hubd_sidecar_secrets"
                    " WHERE allocation_id = ANY ($1::text[])",
                    [lost_rotation.allocation_id, rotating.allocation_id],
                )
            )
        assert bytes(secrets[rotating.allocation_id]) == fresh_secret
        assert bytes(secrets[lost_rotation.allocation_id]) != fresh_secret

    async def test_records_arriving_meanwhile_share_the_next_statement(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Connections recorded while one statement runs go together in the next, and each
        is written."""
        sidecars = await several(store, db, 5)
        connections = ConnectionStore(db, instance_id="in_test")
        requests = [
            RecordRequest(new_connection_id(), each.target, each.sidecar_id) for each in sidecars
        ]
        calls: list[int] = []

        async def counted(keys: list[RecordRequest]) -> Mapping[RecordRequest, Record]:
            calls.append(len(keys))
            return await connections.record_many(keys)

        batcher = Batcher(counted, name="test-records", timeout=30)
        table = "hubd_sidecar_connections"
        records = await first_waits_rest_queue(batcher, requests, database_url, table)
        assert [r and r.outcome for r in records] == [RecordOutcome.RECORDED] * len(requests)
        assert calls == [1, len(requests) - 1]
        for request in requests:
            row = await record_row(db, request.target.allocation_id)
            assert row is not None
            assert row["connection_id"] == request.connection_id
