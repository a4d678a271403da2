"""Schema migrations: idempotent, race-free, and equal to the current schema description."""

from __future__ import annotations

import asyncio

import asyncpg

from hubd.store.migrate import apply_migrations, available_migrations, current_schema_sql
from tests.conftest import PostgresServer, drop_database, fresh_database

DESCRIBE = {
    "columns": """
        SELECT table_name, column_name, data_type, domain_name, is_nullable, column_default,
            is_identity
        FROM information_schema.columns WHERE table_schema IN ('public', 'hubd_v1')
          AND table_name <> 'hubd_schema_migrations'
        ORDER BY 1, 2""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace
          AND conrelid::regclass::text <> 'hubd_schema_migrations'
        ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'
          AND tablename <> 'hubd_schema_migrations'
        ORDER BY 1, 2""",
    "views": """
        SELECT schemaname, viewname, definition FROM pg_views WHERE schemaname = 'hubd_v1'
        ORDER BY 1, 2""",
    "grants": """
        SELECT table_schema, table_name, grantee, privilege_type
        FROM information_schema.role_table_grants WHERE table_schema = 'hubd_v1'
        ORDER BY 1, 2, 3, 4""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid)
        FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1, 2""",
    "functions": """
        SELECT pronamespace::regnamespace::text, proname, prosrc, proconfig::text,
            prosecdef, proacl::text
        FROM pg_proc WHERE pronamespace::regnamespace::text IN ('public', 'hubd_v1')
        ORDER BY 1, 2""",
}


async def describe(dsn: str) -> dict[str, list[tuple[object, ...]]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {
            name: [tuple(row) for row in await conn.fetch(sql)] for name, sql in DESCRIBE.items()
        }
    finally:
        await conn.close()


class TestMigrations:
    async def test_migrations_equal_current_schema(self, postgres_server: PostgresServer) -> None:
        """Applying every migration in order yields exactly the schema in schema.sql."""
        migrated = await fresh_database(postgres_server, "hubd_schema_migrated")
        described = await fresh_database(postgres_server, "hubd_schema_described")
        try:
            conn = await asyncpg.connect(migrated)
            try:
                applied = await apply_migrations(conn)
            finally:
                await conn.close()
            assert [m.version for m in applied] == [m.version for m in available_migrations()]
            conn = await asyncpg.connect(described)
            try:
                await conn.execute(current_schema_sql())
            finally:
                await conn.close()
            left, right = await describe(migrated), await describe(described)
            assert left["columns"], "the schema description found no tables"
            assert left == right
        finally:
            await drop_database(postgres_server, "hubd_schema_migrated")
            await drop_database(postgres_server, "hubd_schema_described")

    async def test_rerun_is_a_no_op(self, database_url: str) -> None:
        """Migrating an up-to-date database applies nothing and changes nothing."""
        before = await describe(database_url)
        conn = await asyncpg.connect(database_url)
        try:
            assert await apply_migrations(conn) == []
        finally:
            await conn.close()
        assert await describe(database_url) == before

    async def test_concurrent_migrations_both_succeed(
        self, postgres_server: PostgresServer
    ) -> None:
        """Two migrators starting together on an empty database both succeed; each migration is
        applied once."""
        dsn = await fresh_database(postgres_server, "hubd_schema_race")
        try:
            conns = [await asyncpg.connect(dsn) for _ in range(2)]
            try:
                results = await asyncio.gather(*(apply_migrations(c) for c in conns))
            finally:
                for conn in conns:
                    await conn.close()
            assert sorted(len(r) for r in results) == [0, len(available_migrations())]
            conn = await asyncpg.connect(dsn)
            try:
                count = await conn.fetchval("SELECT count(*) FROM hubd_schema_migrations")
            finally:
                await conn.close()
            assert count == len(available_migrations())
        finally:
            await drop_database(postgres_server, "hubd_schema_race")
