"""The listener's admission: one statement authenticates a handshake and records its connection.

The statement decides what to write from its own check of the credentials; the listener decides
its answer with :func:`hubd.server.handshake.authorize` on the identity the statement returns.
These tests hold the two to the same answer over every combination of identity, secret state
and presented credentials, on a real PostgreSQL, and check what the statement writes.
"""

from __future__ import annotations

import asyncio
import itertools

import attrs
import pytest

from hubd.routing import Target
from hubd.server.handshake import HandshakeRequest, authorize
from hubd.server.sockets import new_connection_id
from hubd.store import AllocationStore, Database, Status
from hubd.store.channels import SocketControl
from hubd.store.connection_values import Admission, Admitted, RecordOutcome
from hubd.store.connections import ConnectionStore
from hubd.tokens import hash_token, new_reconnect_secret
from tests.polling import eventually
from tests.test_batching import blocked_on_the_lock, table_locked
from tests.wskit import (
    Sidecar,
    connection_seq,
    first_message_or_close,
    raw_socket,
    record_row,
    running_hub,
    sidecar_in,
    upgrade_request,
    wrong_token,
)


@attrs.frozen
class Secrets:
    """The raw secrets a test's secret state is made of."""

    current: str = attrs.field(factory=new_reconnect_secret)
    previous: str = attrs.field(factory=new_reconnect_secret)
    other: str = attrs.field(factory=new_reconnect_secret)


# How the generation's row in hubd_sidecar_secrets stands: (secret, previous, acknowledged),
# each secret named by its field of Secrets (None: NULL), or None for no row at all.
SECRET_STATES = {
    "none": None,
    "acknowledged": ("current", None, True),
    "unacknowledged, after a secret": ("current", "previous", False),
    "unacknowledged, after the token alone": ("current", None, False),
}


async def set_identity_state(
    db: Database, sidecar: Sidecar, secrets: Secrets, state: str, *, foreign: bool
) -> Sidecar:
    """Move ``sidecar``'s allocation to generation 2 and give it the secret ``state``;
    ``foreign``: the secret row is another sidecar's (no secret of this identity)."""
    async with db.pool.acquire() as conn:
        generation = await conn.fetchval(
            "UPDATE hubd_allocations SET generation = 2 WHERE id = $1 RETURNING generation",
            sidecar.allocation_id,
        )
        spec = SECRET_STATES[state]
        if spec is not None:
            secret, previous, acknowledged = spec
            await conn.execute(
                """
                INSERT INTO hubd_sidecar_secrets
                    (allocation_id, generation, sidecar_id, secret_hash, previous_hash,
                     acknowledged)
                VALUES ($1, $2, $3, $4, $5, $6)
                """,
                sidecar.allocation_id,
                generation,
                "sc_someone_else" if foreign else sidecar.sidecar_id,
                hash_token(getattr(secrets, secret)),
                hash_token(getattr(secrets, previous)) if previous else None,
                acknowledged,
            )
    return attrs.evolve(sidecar, generation=generation)


def handshakes(sidecar: Sidecar, secrets: Secrets) -> list[HandshakeRequest]:
    """Every combination the check tells apart: generation older, equal and newer; sidecar id
    and token right or wrong; v1 (no secret) or v2 with no secret, the current, the previous
    or another one."""
    presented = [(1, None), (2, None)] + [
        (2, getattr(secrets, which)) for which in ("current", "previous", "other")
    ]
    return [
        HandshakeRequest(
            allocation_id=sidecar.allocation_id,
            sidecar_id=sidecar_id,
            generation=sidecar.generation + offset,
            token=token,
            origin=None,
            version=version,
            secret=secret,
        )
        for offset, sidecar_id, token, (version, secret) in itertools.product(
            (-1, 0, 1),
            (sidecar.sidecar_id, "sc_not_this_one"),
            (sidecar.token, wrong_token()),
            presented,
        )
    ]


def admission_of(request: HandshakeRequest) -> Admission:
    return Admission(
        connection_id=new_connection_id(),
        target=Target(request.allocation_id, request.generation),
        sidecar_id=request.sidecar_id,
        version=request.version,
        token_hash=hash_token(request.token),
        presented_hash=hash_token(request.secret) if request.secret is not None else None,
        secret_hash=hash_token(new_reconnect_secret()) if request.version == 2 else None,
    )


async def admit_all(
    connections: ConnectionStore, requests: list[HandshakeRequest]
) -> list[tuple[HandshakeRequest, Admission, Admitted]]:
    admissions = [admission_of(request) for request in requests]
    answers = await connections.admit_many(admissions)
    return [(r, a, answers[a]) for r, a in zip(requests, admissions, strict=True)]


class TestTheStatementChecksAsTheProtocolDoes:
    @pytest.mark.parametrize(
        "status", [Status.PROVISIONING, Status.ALLOCATED, Status.RELEASING, Status.REPLACING]
    )
    @pytest.mark.parametrize("state", list(SECRET_STATES))
    async def test_every_combination(
        self, db: Database, store: AllocationStore, status: Status, state: str
    ) -> None:
        """Each handshake is written exactly when ``authorize`` accepts it on the identity the
        statement returns, and that identity is what a look-up reads. Of the admitted ones of
        an allocation, the last is recorded and the others superseded."""
        connections = ConnectionStore(db, instance_id="in_test")
        for foreign in (False, True) if state != "none" else (False,):
            secrets = Secrets()
            sidecar, _ = await sidecar_in(store, db, status)
            sidecar = await set_identity_state(db, sidecar, secrets, state, foreign=foreign)
            before = await connections.identity(sidecar.allocation_id)
            assert before is not None
            results = await admit_all(connections, handshakes(sidecar, secrets))
            accepted = []
            for request, admission, admitted in results:
                assert admitted.identity == before
                expected = authorize(request, before) is None
                assert (admitted.record is not None) == expected, (request, state, foreign)
                if expected:
                    accepted.append((admission, admitted))
            # The protocol accepts something in every accepting status: the right token and
            # the credential the state asks for.
            assert bool(accepted) == (status in (Status.PROVISIONING, Status.ALLOCATED))
            if accepted:
                *outvoted, (last, written) = accepted
                assert written.record is not None
                assert written.record.outcome is RecordOutcome.RECORDED
                assert all(
                    a.record is not None and a.record.outcome is RecordOutcome.SUPERSEDED
                    for _, a in outvoted
                )
                row = await record_row(db, sidecar.allocation_id)
                assert row is not None
                assert row["connection_id"] == last.connection_id
            else:
                assert await record_row(db, sidecar.allocation_id) is None

    async def test_an_unknown_allocation(self, db: Database) -> None:
        """No such allocation: no identity, nothing written, and ``authorize`` says 401."""
        connections = ConnectionStore(db, instance_id="in_test")
        request = HandshakeRequest(
            allocation_id="al_" + "0" * 32,
            sidecar_id="sc_x",
            generation=1,
            token=wrong_token(),
            origin=None,
        )
        ((_, _, admitted),) = await admit_all(connections, [request])
        assert admitted == Admitted(None, None)
        rejection = authorize(request, None)
        assert rejection is not None
        assert rejection.status == 401


class TestWhatAnAdmissionWrites:
    async def test_the_rotation_is_guarded_on_the_secret_the_statement_read(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A welcome's secret opens the next connection, and the credential that opened this
        one keeps working until the welcome is acknowledged: an admission rotates the secret
        exactly as a record with the state it saw would."""
        connections = ConnectionStore(db, instance_id="in_test")
        sidecar, _ = await sidecar_in(store, db)
        first = HandshakeRequest(
            allocation_id=sidecar.allocation_id,
            sidecar_id=sidecar.sidecar_id,
            generation=sidecar.generation,
            token=sidecar.token,
            origin=None,
        )
        ((_, admission, admitted),) = await admit_all(connections, [first])
        assert admitted.record is not None
        assert admitted.record.outcome is RecordOutcome.RECORDED
        # The token alone no longer opens anything once a secret is set... unless the welcome
        # was lost: until it is acknowledged, what opened the latest connection still does.
        identity = await connections.identity(sidecar.allocation_id)
        assert identity is not None
        assert identity.secret.secret_hash == admission.secret_hash
        assert not identity.secret.acknowledged
        ((_, _, again),) = await admit_all(connections, [first])
        assert again.record is not None
        assert again.record.outcome is RecordOutcome.RECORDED
        assert again.record.seq is not None
        assert again.record.seq > (admitted.record.seq or 0)


class TestTheListenersAdmission:
    async def test_a_handshake_abandoned_after_its_admission_leaves_no_record(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """The peer leaves while its admission runs: the record the admission wrote is
        cleared once it is known, and the disconnect reported; nothing was welcomed."""
        sidecar, _ = await sidecar_in(store, db)
        before = await connection_seq(db, sidecar.allocation_id)
        async with running_hub(db) as hub:
            async with (
                table_locked(database_url, "hubd_sidecar_connections"),
                raw_socket(hub.server) as (_, writer),
            ):
                writer.write(upgrade_request(hub.url, sidecar.headers()))
                await eventually(lambda: hub.server.admissions.batches == 1)
                await eventually(lambda: blocked_on_the_lock(database_url))
                writer.close()
                await eventually(lambda: hub.server.gate.sockets == 0)
            await eventually(lambda: hub.events.disconnected == [sidecar.target])
            assert hub.events.connected == []
            assert hub.router.connection_count == 0
            await eventually(lambda: hub.router.busy_allocations == 0)
        assert await record_row(db, sidecar.allocation_id) is None
        # Written (one bump) and cleared (another): the admission did record it.
        assert await connection_seq(db, sidecar.allocation_id) == before + 2

    async def test_a_fence_that_arrives_during_the_admission_closes_the_socket_once_open(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """A newer generation announced while a handshake's admission runs: the socket is
        opened and closed with 4002 at once, never welcomed, whatever its admission wrote. The
        notice finds the handshake by its allocation's tag; a retirement tagged for another
        allocation closes nothing."""
        sidecar, _ = await sidecar_in(store, db)
        other, _ = await sidecar_in(store, db)
        async with running_hub(db) as hub:
            tag = hub.notice_key.tag
            async with table_locked(database_url, "hubd_sidecar_connections"):
                dialing = asyncio.create_task(first_message_or_close(hub.url, sidecar))
                await eventually(lambda: hub.server.admissions.batches == 1)
                hub.router.repair.apply_control(
                    SocketControl(tag(other.allocation_id), sidecar.generation, retire=True)
                )
                hub.router.repair.apply_control(
                    SocketControl(tag(sidecar.allocation_id), sidecar.generation + 1, retire=False)
                )
            assert await dialing == (4002, None)
            assert hub.events.connected == []

    async def test_handshakes_of_one_allocation_admitted_together(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Two handshakes of one allocation with the same credential share an admission
        statement: the later one is recorded and welcomed, the earlier is superseded (4000)
        without a welcome, and the record is the later one's."""
        sidecar, _ = await sidecar_in(store, db)
        other, _ = await sidecar_in(store, db)
        async with running_hub(db, lookup_timeout=60) as hub:
            admissions = hub.server.admissions
            seen: list[str] = []

            async def while_open() -> None:
                (current,) = hub.router.sockets(sidecar.allocation_id)
                row = await record_row(db, sidecar.allocation_id)
                assert row is not None
                seen.extend([row["connection_id"], current.connection_id])

            async with table_locked(database_url, "hubd_sidecar_connections"):
                first = asyncio.create_task(first_message_or_close(hub.url, other))
                await eventually(lambda: admissions.batches == 1)
                earlier = asyncio.create_task(first_message_or_close(hub.url, sidecar))
                await eventually(lambda: admissions.waiting == 1)
                later = asyncio.create_task(first_message_or_close(hub.url, sidecar, while_open))
                await eventually(lambda: admissions.waiting == 2)
            assert await earlier == (4000, None)
            assert await later == (1000, "welcome")
            assert seen[0] == seen[1]
            assert await first == (1000, "welcome")
            assert admissions.batches == 2
