"""Shared fixtures: one PostgreSQL for the session, a fresh migrated database for every test.

By default the session starts the embedded server (the ``embedded`` extra) in a temporary
directory. Set ``HUBD_TEST_DATABASE_URL`` to a server's maintenance DSN (a role that may create
databases) to test against an external PostgreSQL instead.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import attrs
import pytest
import structlog

from hubd.dburl import with_database
from hubd.store import AllocationStore, Database, LedgerStore, connect_database
from hubd.store.channels import NoticeKey, read_notice_key
from hubd.store.embedded import EmbeddedPostgres
from hubd.store.migrate import apply_migrations
from tests.wskit import Sidecar, sidecar_in

_counter = itertools.count()


@attrs.frozen
class PostgresServer:
    """A running server: its maintenance DSN and the migrated template to clone."""

    maintenance_dsn: str
    template: str
    embedded: EmbeddedPostgres | None

    def dsn(self, database: str) -> str:
        return with_database(self.maintenance_dsn, database)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    template = f"hubd_template_{os.getpid()}"
    external = os.environ.get("HUBD_TEST_DATABASE_URL")
    embedded: EmbeddedPostgres | None = None
    tmp: str | None = None
    if external:
        maintenance = external
    else:
        # Short path: the server's Unix socket lives in its data directory.
        tmp = tempfile.mkdtemp(prefix="hubd-t")
        embedded = EmbeddedPostgres(Path(tmp))
        maintenance = embedded.start()
    server = PostgresServer(maintenance_dsn=maintenance, template=template, embedded=embedded)
    asyncio.run(_create_template(server))
    try:
        yield server
    finally:
        asyncio.run(drop_database(server, template))
        if embedded is not None:
            embedded.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


async def _create_template(server: PostgresServer) -> None:
    # The suite runs in several processes (pytest-xdist), each with its template; on one external
    # server their migrations would race to create the cluster's roles (hubd_app, ...).
    maintenance = await asyncpg.connect(server.maintenance_dsn)
    try:
        await maintenance.execute("SELECT pg_advisory_lock(hashtext('hubd_test_templates'))")
        conn = await asyncpg.connect(await fresh_database(server, server.template))
        try:
            await apply_migrations(conn)
        finally:
            await conn.close()
    finally:
        await maintenance.close()


async def drop_database(server: PostgresServer, name: str) -> None:
    conn = await asyncpg.connect(server.maintenance_dsn)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()


async def fresh_database(server: PostgresServer, name: str, *, template: str = "") -> str:
    """An empty database ``name`` (a clone of ``template`` when given); returns its DSN."""
    conn = await asyncpg.connect(server.maintenance_dsn)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        clone = f" TEMPLATE {template}" if template else ""
        await conn.execute(f"CREATE DATABASE {name}{clone}")
    finally:
        await conn.close()
    return server.dsn(name)


@pytest.fixture
async def database_url(postgres_server: PostgresServer) -> AsyncIterator[str]:
    """A fresh database cloned from the migrated template, dropped after the test."""
    name = f"hubd_t{os.getpid()}_{next(_counter)}"
    dsn = await fresh_database(postgres_server, name, template=postgres_server.template)
    try:
        yield dsn
    finally:
        await drop_database(postgres_server, name)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = await connect_database(database_url, pool_size=20)
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
async def notice_key(db: Database) -> NoticeKey:
    """The test database's key for the allocation tags of the daemons' notifications."""
    return await read_notice_key(db)


@pytest.fixture
def store(db: Database) -> AllocationStore:
    return AllocationStore(db, instance_id="in_test")


@pytest.fixture
def ledger(db: Database) -> LedgerStore:
    return LedgerStore(db, instance_id="in_test")


@pytest.fixture
async def sidecar(db: Database, store: AllocationStore) -> Sidecar:
    """An allocated allocation whose sidecar identity (and token) the test knows."""
    allocated, _ = await sidecar_in(store, db)
    return allocated


@pytest.fixture
def collector_off() -> Iterator[None]:
    """Python's cyclic garbage collector off for the test: whatever is freed meanwhile was freed
    by reference counting alone."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# -- fixtures of the tests that run hubd processes ---------------------------------------------


@pytest.fixture
def marker() -> Iterator[str]:
    """A marker for the sidecar processes a test starts; whatever carries it is killed after."""
    from tests.daemonkit import kill_sidecars, new_marker

    value = new_marker()
    try:
        yield value
    finally:
        kill_sidecars(value)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short: an embedded server's Unix socket may live under it.
    with tempfile.TemporaryDirectory(prefix="hubd-d") as path:
        yield Path(path)


@pytest.fixture
async def observer(database_url: str) -> AsyncIterator[AllocationStore]:
    """A store on the test database for reading what the processes wrote."""
    db = await connect_database(database_url)
    try:
        yield AllocationStore(db, instance_id="observer")
    finally:
        await db.close()


@pytest.fixture
def process_settings() -> Iterator[None]:
    """For a test that runs ``hubd.cli.main`` in this process: CPython's collector thresholds
    for the test, whatever the process had before and after, and the logging the command
    configures undone."""
    saved = gc.get_threshold()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    gc.set_threshold(700, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()
