"""The bench's own databases on a PostgreSQL server: made fresh for a part (dropped first if a
run before left one behind), migrated unless the part wants an empty one, and dropped after."""

from __future__ import annotations

import asyncpg

from hubd.dburl import with_database
from hubd.store.migrate import apply_migrations

__all__ = ["drop", "fresh"]


async def fresh(maintenance: str, name: str, *, migrate: bool = True) -> str:
    """Database ``name`` on ``maintenance``'s server, new and (unless ``migrate`` is false)
    migrated by this checkout; its DSN."""
    conn = await asyncpg.connect(maintenance)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    dsn = with_database(maintenance, name)
    if migrate:
        conn = await asyncpg.connect(dsn)
        try:
            await apply_migrations(conn)
        finally:
            await conn.close()
    return dsn


async def drop(maintenance: str, *names: str) -> None:
    """Drop each of ``names``, whoever is still connected."""
    conn = await asyncpg.connect(maintenance)
    try:
        for name in names:
            await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()
