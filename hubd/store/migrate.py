"""Numbered schema migrations shipped in the package, applied under a lock.

Each ``migrations/NNNN_name.sql`` runs once, in order. The whole run is one transaction holding
the lock of ``hubd_schema_migrations`` (an advisory key only before that table exists):
replicas starting together queue on it, and the second finds everything applied.
"""

from __future__ import annotations

import re
from importlib import resources

import asyncpg
import attrs

from hubd.errors import StoreError
from hubd.store.driver_errors import translate_errors
from hubd.store.queries import load_queries

__all__ = ["Migration", "apply_migrations", "available_migrations", "current_schema_sql"]

_SQL = load_queries("migrations.sql")
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@attrs.frozen(kw_only=True)
class Migration:
    version: int
    name: str
    sql: str


def available_migrations() -> list[Migration]:
    """Every migration in the package, in version order; gaps and duplicates are errors."""
    found: list[Migration] = []
    for entry in resources.files("hubd.store").joinpath("migrations").iterdir():
        match = _NAME.match(entry.name)
        if match is None:
            continue
        found.append(
            Migration(
                version=int(match.group(1)),
                name=match.group(2),
                sql=entry.read_text(encoding="utf-8"),
            )
        )
    found.sort(key=lambda m: m.version)
    expected = list(range(1, len(found) + 1))
    if [m.version for m in found] != expected:
        raise StoreError(f"migrations are not numbered 1..{len(found)} without gaps")
    return found


def current_schema_sql() -> str:
    """The schema description that every migration applied in order must reproduce."""
    return resources.files("hubd.store").joinpath("schema.sql").read_text(encoding="utf-8")


async def apply_migrations(conn: asyncpg.Connection) -> list[Migration]:
    """Apply what is missing; returns the migrations applied by this call (empty when none)."""
    migrations = available_migrations()
    with translate_errors("migrate"):
        async with conn.transaction():
            # On the caller's connection, inside this one transaction: no pool is involved, so
            # the bound statements run on it directly.
            await conn.execute(_SQL.lock().sql)
            await conn.execute(_SQL.create_table().sql)
            await conn.execute(_SQL.lock_table().sql)
            applied = {row["version"] for row in await conn.fetch(_SQL.applied().sql)}
            unknown = applied - {m.version for m in migrations}
            if unknown:
                raise StoreError(
                    f"the database has migrations this hubd does not know ({sorted(unknown)}); "
                    "it was migrated by a newer hubd"
                )
            done: list[Migration] = []
            for migration in migrations:
                if migration.version in applied:
                    continue
                await conn.execute(migration.sql)
                record = _SQL.record(version=migration.version, name=migration.name)
                await conn.execute(record.sql, *record.args)
                done.append(migration)
    return done
