"""The application API attacked as a hostile application would, through a login role that holds
only ``hubd_app`` (docs/security.md, "The application API"): no code of the caller's runs as the
functions' owner, no lock it can take stalls a commit, a spec costs little before it is refused,
a role walled into a tenant reads, requests and releases that tenant's allocations only, and the
daemons' notifications, which it may listen to, name no allocation.

Each attack runs against two deployments: the embedded default, where hubd's functions belong
to the server's superuser, and an external server as docs/operations.md sets one up, the
distribution's PostgreSQL with hubd's database owned by a plain role (tests/externalpg.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
import attrs
import pytest

from hubd.client import Client
from hubd.errors import AllocationNotFound
from hubd.store import AllocationStore, LedgerStore, Status, connect_database
from hubd.store.channels import (
    CONNECTED_CHANNEL,
    SOCKETS_CHANNEL,
    WAKE_CHANNEL,
    parse_connected_payload,
    parse_sockets_payload,
    read_notice_key,
)
from hubd.store.migrate import apply_migrations
from tests.apikit import SecretDsn, dsn_as
from tests.externalpg import OWNER, ExternalServer, external_server
from tests.polling import eventually, scaled
from tests.replicakit import Replica, ReplicaRig, sidecar_of
from tests.wskit import close_code_of

_names = itertools.count()

pytestmark = pytest.mark.timeout(180)


@attrs.frozen
class Deployment:
    admin: str
    """A superuser's DSN of hubd's database: creates the attackers' roles."""
    owner: str
    """The daemon's DSN: the role that ran the migrations and owns hubd's functions."""

    @contextlib.asynccontextmanager
    async def role(self, tenant: str | None = None, *, every: bool = False) -> AsyncIterator[str]:
        """A login role holding only ``hubd_app``, walled into ``tenant`` (or seeing every
        tenant with ``every``; unmapped with neither); yields its DSN."""
        name = f"hubd_attacker_{os.getpid()}_{next(_names)}"
        password = f"pw{os.urandom(8).hex()}"
        admin = await asyncpg.connect(self.admin)
        try:
            await admin.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE hubd_app")
            if tenant is not None or every:
                await admin.execute(
                    "INSERT INTO hubd_tenant_roles (role_name, tenant_id, every_tenant) "
                    "VALUES ($1, $2, $3)",
                    name,
                    tenant,
                    every,
                )
            try:
                yield SecretDsn(dsn_as(self.admin, name, password))
            finally:
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
                    name,
                )
                await admin.execute("DELETE FROM hubd_tenant_roles WHERE role_name = $1", name)
                await admin.execute(f"DROP OWNED BY {name}")
                await admin.execute(f"DROP ROLE {name}")
        finally:
            await admin.close()


@pytest.fixture(scope="module")
def external() -> Iterator[ExternalServer]:
    with external_server() as server:
        yield server


@pytest.fixture(params=["embedded", "external"])
async def deployment(
    request: pytest.FixtureRequest, database_url: str
) -> AsyncIterator[Deployment]:
    if request.param == "embedded":
        yield Deployment(admin=database_url, owner=database_url)
        return
    server: ExternalServer = request.getfixturevalue("external")
    name = f"hubd_ext_{next(_names)}"
    root = await asyncpg.connect(server.superuser())
    try:
        for role, options in ((OWNER, "LOGIN"), ("hubd_app", "NOLOGIN")):
            if not await root.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
                await root.execute(f"CREATE ROLE {role} {options}")
        await root.execute(f"CREATE DATABASE {name} OWNER {OWNER}")
        owner = await asyncpg.connect(server.owner(name))
        try:
            await apply_migrations(owner)
        finally:
            await owner.close()
        yield Deployment(admin=server.superuser(name), owner=server.owner(name))
    finally:
        await root.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await root.close()


async def _schema(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return str(
            await conn.fetchval(
                "SELECT n.nspname FROM pg_class AS c JOIN pg_namespace AS n "
                "ON n.oid = c.relnamespace WHERE c.relname = 'hubd_allocations'"
            )
        )
    finally:
        await conn.close()


_ATTACK = """
CREATE TEMP TABLE hubd_attack_log (who text, what text);
GRANT ALL ON pg_temp.hubd_attack_log TO PUBLIC;
CREATE FUNCTION pg_temp.hubd_attack(what text) RETURNS integer LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pg_temp.hubd_attack_log VALUES (current_user, what);
    BEGIN
        EXECUTE format('ALTER ROLE %I SUPERUSER', session_user);
    EXCEPTION WHEN OTHERS THEN
        NULL;
    END;
    RETURN 1;
END;
$$;
"""


class TestNoCodeOfTheCallersRunsAsAnotherRole:
    async def test_shadowing_every_relation_in_the_temporary_schema_changes_nothing(
        self, deployment: Deployment
    ) -> None:
        """Every relation hubd's functions name, shadowed in the caller's temporary schema (a
        view that runs the caller's function; a sequence that would hand out positions), before
        each hubd_v1 function and each way the feed's trigger fires: every call works on hubd's
        own relations, the caller's code never runs, and the caller gains nothing."""
        schema = await _schema(deployment.owner)
        admin = await asyncpg.connect(deployment.admin)
        try:
            relations = await admin.fetch(
                "SELECT c.relname, c.relkind::text AS relkind FROM pg_class AS c "
                "WHERE c.relnamespace = $1::regnamespace AND c.relname LIKE 'hubd\\_%' "
                "AND c.relkind IN ('r', 'v', 'S', 'p', 'm')",
                schema,
            )
            api_views = [
                r["viewname"]
                for r in await admin.fetch(
                    "SELECT viewname FROM pg_views WHERE schemaname = 'hubd_v1'"
                )
            ]
        finally:
            await admin.close()
        assert {"hubd_allocations", "hubd_events", "hubd_event_position"} <= {
            r["relname"] for r in relations
        }
        async with deployment.role() as dsn:
            app = await asyncpg.connect(dsn)
            try:
                await app.execute(_ATTACK)
                for relation in relations:
                    name = relation["relname"]
                    if relation["relkind"] == "S":
                        await app.execute(f"CREATE TEMP SEQUENCE {name} START 9000000000000000")
                    else:
                        await app.execute(
                            f"CREATE TEMP VIEW {name} AS SELECT pg_temp.hubd_attack('{name}') "
                            "AS position"
                        )
                for name in api_views:
                    await app.execute(
                        f"CREATE TEMP VIEW {name} AS SELECT pg_temp.hubd_attack('{name}') AS id"
                    )
                made = await app.fetchval(
                    "SELECT id FROM hubd_v1.request('fake', session => 'shadowed', "
                    "spec => '{\"a\": 1}')"
                )
                async with app.transaction():
                    second = await app.fetchval("SELECT id FROM hubd_v1.request('fake')")
                    await app.execute("SET CONSTRAINTS ALL IMMEDIATE")
                cursor = await app.fetchval("SELECT hubd_v1.event_cursor()")
                seen = await app.fetch("SELECT * FROM hubd_v1.events_after(0)")
                listed = await app.fetch("SELECT * FROM hubd_v1.allocations")
                await app.fetch("SELECT * FROM hubd_v1.events")
                released = await app.fetchrow("SELECT * FROM hubd_v1.release($1)", made)
                extended = await app.fetchrow(
                    "SELECT * FROM hubd_v1.extend($1, interval '1 hour')", second
                )
                touched = await app.fetchrow("SELECT * FROM hubd_v1.touch($1)", second)
                ran = await app.fetch("SELECT * FROM pg_temp.hubd_attack_log")
                handed_out = await app.fetchval("SELECT is_called FROM pg_temp.hubd_event_position")
                superuser = await app.fetchval(
                    "SELECT rolsuper FROM pg_roles WHERE rolname = session_user"
                )
            finally:
                await app.close()
        assert ran == [], "the caller's code ran inside a hubd function"
        assert superuser is False
        assert handed_out is False, "a hubd function took a position from the caller's sequence"
        assert released["status"] == "released"
        assert extended["expires_at"] is not None
        assert touched["id"] == second
        assert {r["id"] for r in listed} == {made, second}
        assert [e["event"] for e in seen] == ["requested", "requested"]
        assert cursor == seen[-1]["position"]
        admin = await asyncpg.connect(deployment.admin)
        try:
            rows = await admin.fetch(
                "SELECT allocation_id, event, position FROM hubd_events ORDER BY position"
            )
        finally:
            await admin.close()
        assert [(r["allocation_id"], r["event"]) for r in rows] == [
            (made, "requested"),
            (second, "requested"),
            (made, "released"),
            (second, "extended"),
        ]
        assert max(r["position"] for r in rows) < 1000

    async def test_every_hubd_function_names_its_objects_and_none_is_public(
        self, deployment: Deployment
    ) -> None:
        """The audit a reviewer runs: every function in hubd's schema and in hubd_v1 resolves
        names on pg_catalog, hubd's schema, pg_temp last; PUBLIC may execute none; hubd_app may
        execute the API and hubd_caller_scope (which tells a caller its own wall) only; no one
        but the owner may create objects where the functions look."""
        schema = await _schema(deployment.owner)
        admin = await asyncpg.connect(deployment.admin)
        try:
            functions = await admin.fetch(
                """
                SELECT p.oid::regprocedure::text AS name, p.pronamespace::regnamespace::text
                    AS namespace, p.proconfig, p.prosecdef,
                    has_function_privilege('hubd_app', p.oid, 'EXECUTE') AS app_may,
                    EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl,
                        acldefault('f', p.proowner))) AS a
                        WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE') AS public_may
                FROM pg_proc AS p
                WHERE (p.pronamespace = $1::regnamespace AND p.proname LIKE 'hubd\\_%')
                   OR p.pronamespace = 'hubd_v1'::regnamespace""",
                schema,
            )
            creators = await admin.fetch(
                "SELECT r.rolname FROM pg_roles AS r, pg_namespace AS n WHERE n.nspname = ANY($1) "
                "AND has_schema_privilege(r.oid, n.oid, 'CREATE') AND NOT r.rolsuper "
                "AND r.rolname NOT IN (pg_get_userbyid(n.nspowner), $2) "
                "AND NOT pg_has_role(r.oid, n.nspowner, 'USAGE')",
                [schema, "hubd_v1"],
                OWNER,
            )
        finally:
            await admin.close()
        assert len(functions) > 15
        fixed = f"search_path=pg_catalog, {schema}, pg_temp"
        assert [f["name"] for f in functions if fixed not in (f["proconfig"] or [])] == []
        assert [f["name"] for f in functions if f["public_may"]] == []
        allowed = {f["name"] for f in functions if f["app_may"]}
        assert allowed == {f["name"] for f in functions if f["namespace"] == "hubd_v1"} | {
            "hubd_caller_scope()"
        }
        assert [r["rolname"] for r in creators] == []


class TestNoLockStallsACommit:
    async def test_every_lock_the_role_sees_held_forever_leaves_commits_flowing(
        self, deployment: Deployment
    ) -> None:
        """The attacker watches pg_locks while requests commit and takes every lock it sees
        another backend hold, advisory keys included (the feed's former key among them), and
        keeps them; requests and the daemon's own writes still commit, and none of hubd's
        relations could be locked."""
        async with deployment.role() as dsn:
            attacker = await asyncpg.connect(dsn)
            writer = await asyncpg.connect(dsn)
            daemon = await asyncpg.connect(deployment.owner)
            try:
                await attacker.execute("SELECT pg_advisory_lock(hashtext('hubd.events'))")
                await attacker.execute("BEGIN")
                advisory: set[tuple[int, int, int]] = set()
                locked: set[str] = set()
                stop = asyncio.Event()

                async def write() -> None:
                    while not stop.is_set():
                        async with asyncio.timeout(scaled(10)):
                            await writer.fetchval("SELECT id FROM hubd_v1.request('fake')")

                async def take() -> None:
                    for _ in range(200):
                        seen = await attacker.fetch(
                            "SELECT locktype, classid, objid, objsubid, relation::regclass::text "
                            "AS relation FROM pg_locks WHERE granted AND pid <> pg_backend_pid() "
                            "AND locktype IN ('advisory', 'relation')"
                        )
                        for lock in seen:
                            if lock["locktype"] == "advisory":
                                key = (lock["classid"], lock["objid"], lock["objsubid"])
                                if key not in advisory:
                                    advisory.add(key)
                                    await _take_advisory(attacker, key)
                            elif (
                                lock["relation"]
                                and lock["relation"] not in locked
                                and await _try_lock(attacker, lock["relation"])
                            ):
                                locked.add(lock["relation"])
                    stop.set()

                await asyncio.gather(write(), take())
                # Everything taken is held now: requests, releases and the daemon's own writes
                # still commit, each well within its deadline.
                for _ in range(20):
                    async with asyncio.timeout(scaled(10)):
                        made = await writer.fetchval("SELECT id FROM hubd_v1.request('fake')")
                        await writer.fetchrow("SELECT * FROM hubd_v1.release($1)", made)
                        await daemon.fetchval(
                            "SELECT id FROM hubd_request_allocation('fake', NULL, NULL, '{}', "
                            "NULL, NULL, NULL)"
                        )
            finally:
                for conn in (attacker, writer, daemon):
                    await conn.close()
        hubd_relations = {r for r in locked if r.split(".")[-1].startswith("hubd")}
        assert hubd_relations == set()

    async def test_the_advisory_keys_hubd_once_used_stop_no_start_and_no_sweep(
        self, deployment: Deployment
    ) -> None:
        """An application holding the keys that elected the migrating replica and the orphan
        sweeper (any role may take an advisory key): a daemon's start still migrates, and a
        sweeper is still elected, each well within its deadline."""
        async with deployment.role() as dsn:
            attacker = await asyncpg.connect(dsn)
            owner = await asyncpg.connect(deployment.owner)
            try:
                await attacker.execute("SELECT pg_advisory_lock(hashtext('hubd.migrate'))")
                await attacker.execute(
                    "SELECT pg_advisory_lock(hashtext('hubd_orphans'), hashtext('fake'))"
                )
                async with asyncio.timeout(scaled(10)):
                    assert await apply_migrations(owner) == []
                db = await connect_database(deployment.owner)
                try:
                    store = AllocationStore(db, instance_id="in_attacked")
                    async with asyncio.timeout(scaled(10)):
                        async with store.sweep_lock("fake") as held:
                            assert held is not None
                            # One sweeper at a time: a second replica is told someone sweeps.
                            async with store.sweep_lock("fake") as second:
                                assert second is None
                finally:
                    await db.close()
                # The attacker cannot take the sweeper's lock either.
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await attacker.execute("SELECT * FROM hubd_sweep_locks FOR UPDATE")
            finally:
                await attacker.close()
                await owner.close()


async def _take_advisory(conn: asyncpg.Connection, key: tuple[int, int, int]) -> None:
    classid, objid, objsubid = key
    if objsubid == 1:  # one bigint key, split over classid (high) and objid (low)
        await conn.execute(
            "SELECT pg_try_advisory_lock(($1::bigint << 32) | $2::bigint)", classid, objid
        )
    else:
        await conn.execute(
            "SELECT pg_try_advisory_lock($1::oid::bigint::integer, $2::oid::bigint::integer)",
            classid,
            objid,
        )


async def _try_lock(conn: asyncpg.Connection, relation: str) -> bool:
    """Whether the role could lock ``relation`` (kept locked when it could)."""
    await conn.execute("SAVEPOINT probe")
    try:
        await conn.execute(f"LOCK TABLE {relation} IN ACCESS EXCLUSIVE MODE NOWAIT")
    except (asyncpg.InsufficientPrivilegeError, asyncpg.LockNotAvailableError):
        await conn.execute("ROLLBACK TO SAVEPOINT probe")
        return False
    except asyncpg.PostgresError:
        await conn.execute("ROLLBACK TO SAVEPOINT probe")
        return False
    await conn.execute("RELEASE SAVEPOINT probe")
    return True


class TestInputIsBoundedBeforeItCosts:
    async def test_a_64_mib_spec_is_refused_at_a_small_memory_cost(
        self, deployment: Deployment
    ) -> None:
        """The spec's text is measured before it is parsed: a 64 MiB spec is refused with 22023,
        and the backend's peak grows by about four times the text: three for PostgreSQL
        receiving any 64 MiB parameter (its buffer doubles as it reads the message, then the
        value is copied out), one for the call. Parsed into jsonb first, it grew by eight
        times (512 MiB) before any hubd code ran."""
        huge = '{"a": "' + "x" * (64 * 1024 * 1024) + '"}'
        async with deployment.role() as dsn:
            app = await asyncpg.connect(dsn)
            try:
                pid = await app.fetchval("SELECT pg_backend_pid()")
                status = Path(f"/proc/{pid}/status")
                try:
                    before = _kib(status, "VmRSS")
                except FileNotFoundError:
                    pytest.skip("the server's backends are not on this host")
                with pytest.raises(asyncpg.InvalidParameterValueError, match="64 KiB"):
                    await app.fetchrow("SELECT * FROM hubd_v1.request('fake', spec => $1)", huge)
                peak = _kib(status, "VmHWM")
                deep = "[" * 100_000 + "]" * 100_000
                with pytest.raises(asyncpg.InvalidParameterValueError, match="deeper than 32"):
                    await app.fetchrow("SELECT * FROM hubd_v1.request('fake', spec => $1)", deep)
                assert await app.fetchval("SELECT count(*) FROM hubd_v1.allocations") == 0
            finally:
                await app.close()
        grown_mib = (peak - before) / 1024
        assert grown_mib < 5 * 64, f"the backend grew by {grown_mib:.0f} MiB for a 64 MiB spec"


def _kib(status: Path, field: str) -> int:
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"{status} has no {field}")


class TestTenantsAreWalledOff:
    async def test_a_walled_role_reads_requests_and_releases_its_tenant_only(
        self, deployment: Deployment
    ) -> None:
        async with (
            deployment.role("acme") as acme_dsn,
            deployment.role("globex") as globex_dsn,
            deployment.role(every=True) as ops_dsn,
            deployment.role() as single_dsn,
        ):
            acme = await asyncpg.connect(acme_dsn)
            globex = await asyncpg.connect(globex_dsn)
            try:
                mine = await acme.fetchrow("SELECT * FROM hubd_v1.request('fake', session => 's')")
                assert mine["tenant"] == "acme"
                named = await acme.fetchrow(
                    "SELECT * FROM hubd_v1.request('fake', tenant => 'acme')"
                )
                assert named["tenant"] == "acme"
                with pytest.raises(asyncpg.InsufficientPrivilegeError, match="tenant 'acme'"):
                    await acme.fetchrow("SELECT * FROM hubd_v1.request('fake', tenant => 'globex')")
                theirs = await globex.fetchrow(
                    "SELECT * FROM hubd_v1.request('fake', idempotency_key => 'k')"
                )
                same_key = await acme.fetchrow(
                    "SELECT * FROM hubd_v1.request('fake', idempotency_key => 'k')"
                )
                assert same_key["id"] != theirs["id"]
                acme_ids = {mine["id"], named["id"], same_key["id"]}
                for conn in (acme, globex):
                    # A SET ROLE to a role with no wall (hubd_app itself) keeps the login's wall.
                    for role in ("NONE", "hubd_app"):
                        await conn.execute(f"SET ROLE {role}")
                        ids = {
                            r["id"] for r in await conn.fetch("SELECT id FROM hubd_v1.allocations")
                        }
                        tenants = {
                            r["tenant"]
                            for r in await conn.fetch("SELECT tenant FROM hubd_v1.events")
                        }
                        after = await conn.fetch(
                            "SELECT * FROM hubd_v1.events_after(0, tenant => 'acme')"
                        )
                        if conn is acme:
                            assert ids == acme_ids
                            assert tenants == {"acme"}
                        else:
                            assert ids == {theirs["id"]}
                            assert tenants == {"globex"}
                            assert after == []
                    await conn.execute("RESET ROLE")
                # Another tenant's id is as unknown as an id no allocation has, to release, to
                # extend and to touch alike; the tenant's own extends, and a lifetime it inflates is
                # refused before it is written.
                with pytest.raises(asyncpg.NoDataFoundError, match="no allocation"):
                    await acme.fetchrow("SELECT * FROM hubd_v1.release($1)", theirs["id"])
                with pytest.raises(asyncpg.NoDataFoundError, match="no allocation"):
                    await acme.fetchrow(
                        "SELECT * FROM hubd_v1.extend($1, interval '1 hour')", theirs["id"]
                    )
                with pytest.raises(asyncpg.NoDataFoundError, match="no allocation"):
                    await acme.fetchrow("SELECT * FROM hubd_v1.touch($1)", theirs["id"])
                touched = await acme.fetchrow("SELECT * FROM hubd_v1.touch($1)", mine["id"])
                assert touched["id"] == mine["id"]
                extended = await acme.fetchrow(
                    "SELECT * FROM hubd_v1.extend($1, interval '1 hour')", mine["id"]
                )
                assert extended["expires_at"] is not None
                with pytest.raises(asyncpg.InvalidParameterValueError, match="at most 10 years"):
                    await acme.fetchrow(
                        "SELECT * FROM hubd_v1.extend($1, interval '1000000 years')", mine["id"]
                    )
                await acme.execute("SET ROLE hubd_app")
                with pytest.raises(asyncpg.NoDataFoundError, match="no allocation"):
                    await acme.fetchrow("SELECT * FROM hubd_v1.release($1)", theirs["id"])
                async with await Client.connect(acme_dsn) as client:
                    with pytest.raises(AllocationNotFound):
                        await client.get(theirs["id"])
                    assert {a.id for a in await client.list()} == acme_ids
            finally:
                await acme.close()
                await globex.close()
            for dsn in (ops_dsn, single_dsn):
                conn = await asyncpg.connect(dsn)
                try:
                    ids = {r["id"] for r in await conn.fetch("SELECT id FROM hubd_v1.allocations")}
                finally:
                    await conn.close()
                assert ids == acme_ids | {theirs["id"]}
        admin = await asyncpg.connect(deployment.admin)
        try:
            status = await admin.fetchval(
                "SELECT status FROM hubd_v1.allocations WHERE id = $1", theirs["id"]
            )
        finally:
            await admin.close()
        assert status == "pending"

    async def test_a_walled_follower_sees_its_tenants_feed_whole_and_in_order(
        self, deployment: Deployment
    ) -> None:
        """Two tenants request and release, interleaved; each one's follower reads exactly its
        tenant's events of the raw feed, in commit order, nothing missing and nothing twice, and
        its notifications name positions only."""
        async with deployment.role("acme") as acme_dsn, deployment.role("globex") as globex_dsn:
            notes: list[str] = []
            listener = await asyncpg.connect(acme_dsn)
            await listener.add_listener("hubd_events", lambda *args: notes.append(args[3]))
            try:
                async with (
                    await Client.connect(acme_dsn) as acme,
                    await Client.connect(globex_dsn) as globex,
                ):
                    for round_ in range(10):
                        a = await acme.request("fake", session=f"a{round_}")
                        g = await globex.request("fake", session=f"g{round_}")
                        if round_ % 2:
                            await acme.release(a.id)
                            await globex.release(g.id)
                    admin = await asyncpg.connect(deployment.admin)
                    try:
                        raw = await admin.fetch(
                            "SELECT position, tenant FROM hubd_v1.events ORDER BY position"
                        )
                    finally:
                        await admin.close()
                    for client, tenant in ((acme, "acme"), (globex, "globex")):
                        expected = [r["position"] for r in raw if r["tenant"] == tenant]
                        seen: list[int] = []
                        async with asyncio.timeout(scaled(30)):
                            async for event in client.events(since=0):
                                assert event.tenant == tenant
                                seen.append(event.position)
                                if len(seen) == len(expected):
                                    break
                        assert seen == expected
                await eventually(lambda: len(notes) >= len(raw), within=scaled(10))
            finally:
                await listener.close()
        assert all(set(json.loads(n)) == {"position"} for n in notes), notes[:3]


class TestNotificationsNameNoAllocation:
    async def test_a_listening_role_hears_tags_not_ids_tenants_or_sessions(
        self, deployment: Deployment
    ) -> None:
        """A walled role listens on the daemons' channels while its allocation is requested,
        connected to one replica, taken over on the other, released and destroyed. It hears
        every step (the takeover and the release reach the replica holding the socket by
        notification alone), and no payload holds the allocation's id, its tenant, its session
        or its sidecar's id: only the provisioner, tags, generations, numbers and connection
        ids. The key the tags are made with, and the functions that make them, are out of its
        reach."""
        schema = await _schema(deployment.owner)
        heard: list[tuple[str, str]] = []
        async with deployment.role("acme") as dsn:
            spy = await asyncpg.connect(dsn)
            app = await asyncpg.connect(dsn)
            db = await connect_database(deployment.owner)
            try:
                for channel in (WAKE_CHANNEL, CONNECTED_CHANNEL, SOCKETS_CHANNEL):
                    await spy.add_listener(channel, lambda *args: heard.append(args[2:4]))
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await spy.fetch(f"SELECT * FROM {schema}.hubd_notice_key")  # noqa: S608
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await spy.fetchval(f"SELECT {schema}.hubd_notice_tag('al_x')")
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await spy.fetchval(f"SELECT {schema}.hubd_notice('al_x', '1:retire')")
                key = await read_notice_key(db)
                store = AllocationStore(db, instance_id="in_attacked")
                async with AsyncExitStack() as exits:
                    rig = ReplicaRig(
                        db=db,
                        database_url=deployment.owner,
                        store=store,
                        ledger=LedgerStore(db, instance_id="in_attacked"),
                        exits=exits,
                    )
                    async with rig.pair() as (a, b):
                        made = await app.fetchrow(
                            "SELECT * FROM hubd_v1.request('fake', session => 'confidential-s')"
                        )
                        assert made["tenant"] == "acme"
                        assert await a.reconciler.reconcile_next()
                        sidecar = sidecar_of(a.provisioner.ensure_calls[-1])
                        on_b = await rig.open_socket(b, sidecar)
                        assert await a.reconciler.reconcile_next()
                        assert (await store.get(made["id"])).ready
                        # Recorded on A: B hears of it by notification only.
                        on_a = await rig.open_socket(a, sidecar)
                        assert await close_code_of(on_b) == 4000
                        # Released by the application: A hears of it by notification only.
                        await app.fetchrow("SELECT * FROM hubd_v1.release($1)", made["id"])
                        assert await close_code_of(on_a) == 4002
                        assert await a.reconciler.reconcile_next()
                        assert (await store.get(made["id"])).status is Status.RELEASED
                        await eventually(
                            lambda: any(":retire:" in p for _, p in heard),
                            within=scaled(10),
                            what="the retirement",
                        )
            finally:
                for conn in (spy, app):
                    await conn.close()
                await db.close()
        tag = key.tag(made["id"])
        connected = [parse_connected_payload(p, key) for c, p in heard if c == CONNECTED_CHANNEL]
        controls = [parse_sockets_payload(p, key) for c, p in heard if c == SOCKETS_CHANNEL]
        assert len(connected) >= 2
        assert None not in connected
        assert None not in controls
        assert {(n.tag, n.generation) for n in connected if n is not None} == {(tag, 1)}
        assert [(c.tag, c.generation, c.retire) for c in controls if c is not None] == [
            (tag, 2, False),
            (tag, 2, True),
        ]
        assert {p for c, p in heard if c == WAKE_CHANNEL} == {"fake"}
        hidden = (
            made["id"],
            made["id"].removeprefix("al_"),
            "acme",
            "confidential-s",
            sidecar.sidecar_id,
        )
        assert [p for _, p in heard if any(secret in p for secret in hidden)] == []


def _forged(replica: Replica, channel: str) -> float:
    """The payloads on ``channel`` the replica dropped as not authenticated."""
    labels = {"channel": channel}
    return replica.metrics.registry.get_sample_value("hubd_notices_forged_total", labels) or 0.0


def _closed_for_peers(replica: Replica) -> float:
    value = replica.metrics.registry.get_sample_value("hubd_sockets_closed_for_peers_total")
    return value or 0.0


class TestForgedNotices:
    async def test_forged_notices_close_nothing_and_replayed_ones_change_nothing(
        self, deployment: Deployment
    ) -> None:
        """A role walled into one tenant hears its own allocation connected and released (a
        fence and a retirement) and another tenant's sidecar connected to one replica, then
        taken over by the other. For that sidecar's tag it then sends what would have ended it:
        a retirement and fences of newer generations, unsigned or with a mac it heard on
        another notice, and records with a huge number or a newer generation. It also sends
        again every genuine notice it heard. Every replica drops each forged payload and counts
        it (``hubd_notices_forged``); the replays change nothing: the sidecar's socket stays
        open, nothing is closed for a peer, and the allocation stays ready. The other tenant's
        own release still closes the socket with 4002."""
        heard: list[tuple[str, str]] = []
        async with deployment.role("acme") as acme_dsn, deployment.role("globex") as globex_dsn:
            spy = await asyncpg.connect(acme_dsn)
            tenant = await asyncpg.connect(globex_dsn)
            db = await connect_database(deployment.owner)
            try:
                for channel in (CONNECTED_CHANNEL, SOCKETS_CHANNEL):
                    await spy.add_listener(channel, lambda *args: heard.append(args[2:4]))
                key = await read_notice_key(db)
                store = AllocationStore(db, instance_id="in_attacked")
                async with AsyncExitStack() as exits:
                    rig = ReplicaRig(
                        db=db,
                        database_url=deployment.owner,
                        store=store,
                        ledger=LedgerStore(db, instance_id="in_attacked"),
                        exits=exits,
                    )
                    async with rig.pair() as (a, b):
                        # The spy's own allocation, connected and released: it hears a genuine
                        # fence and a genuine retirement.
                        mine = await spy.fetchrow("SELECT * FROM hubd_v1.request('fake')")
                        assert await a.reconciler.reconcile_next()
                        own = await rig.open_socket(b, sidecar_of(a.provisioner.ensure_calls[-1]))
                        assert await a.reconciler.reconcile_next()
                        await spy.fetchrow("SELECT * FROM hubd_v1.release($1)", mine["id"])
                        assert await close_code_of(own) == 4002
                        assert await a.reconciler.reconcile_next()
                        # The other tenant's: recorded on A, then on B, which holds it now.
                        theirs = await tenant.fetchrow("SELECT * FROM hubd_v1.request('fake')")
                        assert await a.reconciler.reconcile_next()
                        sidecar = sidecar_of(a.provisioner.ensure_calls[-1])
                        on_a = await rig.open_socket(a, sidecar)
                        assert await a.reconciler.reconcile_next()
                        on_b = await rig.open_socket(b, sidecar)
                        assert await close_code_of(on_a) == 4000
                        assert (await store.get(theirs["id"])).ready

                        def said(channel: str) -> list[str]:
                            return [p for c, p in heard if c == channel]

                        await eventually(
                            lambda: (
                                len(said(CONNECTED_CHANNEL)) == 3
                                and len(said(SOCKETS_CHANNEL)) == 2
                            ),
                            within=scaled(10),
                            what="the notices",
                        )
                        fence, retire = said(SOCKETS_CHANNEL)
                        earlier, latest = said(CONNECTED_CHANNEL)[1:]
                        victim = latest.split(":")[0]
                        assert victim == key.tag(theirs["id"])
                        heard_mac = latest.rsplit(":", 1)[1]
                        replays = {
                            SOCKETS_CHANNEL: [fence, retire],
                            CONNECTED_CHANNEL: [earlier, latest],
                        }
                        forgeries = {
                            SOCKETS_CHANNEL: [
                                f"{victim}:1:retire",  # what a daemon believed before macs
                                f"{victim}:2:retire:{retire.rsplit(':', 1)[1]}",
                                f"{victim}:2:fence:{fence.rsplit(':', 1)[1]}",
                                f"{victim}:9:fence:{heard_mac}",
                                f"{victim}:9:fence:{'0' * 32}",
                            ],
                            CONNECTED_CHANNEL: [
                                f"{victim}:1:{2**62}:cn_forged",
                                f"{victim}:1:{2**62}:cn_forged:{heard_mac}",
                                f"{victim}:2:1:cn_forged:{heard_mac}",
                            ],
                        }
                        replicas = (a, b)
                        before = {(r.name, c): _forged(r, c) for r in replicas for c in forgeries}
                        closed_before = _closed_for_peers(b)
                        # Delivered in the order sent: once a replica has counted the last
                        # forgery, it has acted on every replay before it too.
                        for sent in (replays, forgeries):
                            for channel, payloads in sent.items():
                                for payload in payloads:
                                    await spy.execute("SELECT pg_notify($1, $2)", channel, payload)
                        await eventually(
                            lambda: all(
                                _forged(r, c) == before[r.name, c] + len(forgeries[c])
                                for r in replicas
                                for c in forgeries
                            ),
                            within=scaled(10),
                            what="every forgery dropped on both replicas",
                        )
                        assert [e.closed_by_hub for e in b.router.sockets(theirs["id"])] == [None]
                        assert _closed_for_peers(b) == closed_before
                        async with asyncio.timeout(10):
                            await (await on_b.ping())
                        still = await store.get(theirs["id"])
                        assert still.status is Status.ALLOCATED
                        assert still.ready
                        # The tenant's own release reaches B by notification, as ever.
                        await tenant.fetchrow("SELECT * FROM hubd_v1.release($1)", theirs["id"])
                        assert await close_code_of(on_b) == 4002
            finally:
                for conn in (spy, tenant):
                    await conn.close()
                await db.close()


class TestTheNarrowingWall:
    async def test_hubd_wall_narrows_a_caller_and_never_widens_or_moves_one(
        self, deployment: Deployment
    ) -> None:
        """``hubd.wall`` (what the HTTP API sets for a tenant's key) walls a role that sees
        every tenant into one; a role walled into a tenant that sets it to another, in its
        session, in a transaction, or on the request itself, still sees, requests, touches and
        releases its own tenant's allocations only."""
        async with deployment.role(every=True) as ops_dsn:
            ops = await asyncpg.connect(ops_dsn)
            try:
                theirs = await ops.fetchval(
                    "SELECT id FROM hubd_v1.request('fake', tenant => 'globex')"
                )
                mine = await ops.fetchval(
                    "SELECT id FROM hubd_v1.request('fake', tenant => 'acme')"
                )
                await ops.execute("SET hubd.wall = 'acme'")
                assert await ops.fetchrow("SELECT * FROM hubd_caller_scope()") == (True, "acme")
                seen = {r["id"] for r in await ops.fetch("SELECT id FROM hubd_v1.allocations")}
                assert seen == {mine}
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await ops.fetch("SELECT * FROM hubd_v1.request('fake', tenant => 'globex')")
                await ops.execute("RESET hubd.wall")
                seen = {r["id"] for r in await ops.fetch("SELECT id FROM hubd_v1.allocations")}
                assert seen == {mine, theirs}
            finally:
                await ops.close()
            async with deployment.role("acme") as acme_dsn:
                acme = await asyncpg.connect(acme_dsn)
                try:
                    for setting in ("SET hubd.wall = 'globex'", "SET hubd.wall = ''"):
                        await acme.execute(setting)
                        assert await acme.fetchrow("SELECT * FROM hubd_caller_scope()") == (
                            True,
                            "acme",
                        )
                        seen = {
                            r["id"] for r in await acme.fetch("SELECT id FROM hubd_v1.allocations")
                        }
                        assert seen == {mine}
                        for call in (
                            "SELECT * FROM hubd_v1.touch($1)",
                            "SELECT * FROM hubd_v1.release($1)",
                        ):
                            with pytest.raises(asyncpg.NoDataFoundError):
                                await acme.fetchrow(call, theirs)
                    async with acme.transaction():
                        await acme.execute("SELECT set_config('hubd.wall', 'globex', true)")
                        with pytest.raises(asyncpg.InsufficientPrivilegeError):
                            await acme.fetch(
                                "SELECT * FROM hubd_v1.request('fake', tenant => 'globex')"
                            )
                finally:
                    await acme.close()
