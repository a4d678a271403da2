"""Opening hubd's database: an external server by URL, or the embedded one under the state dir."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import structlog

from hubd.redaction import redact_dsn
from hubd.store.database import Database, connect_database
from hubd.store.embedded import EmbeddedPostgres, ensure_database

__all__ = ["open_database", "resolve_dsn"]

log = structlog.get_logger(__name__)


@asynccontextmanager
async def resolve_dsn(url: str, state_dir: Path) -> AsyncIterator[str]:
    """Yield the DSN to use: ``url`` as is, or (when empty) the embedded server's ``hubd``
    database, which is created on first use and let go when the block ends."""
    if url:
        yield url
        return
    embedded = EmbeddedPostgres(state_dir)
    maintenance = await asyncio.to_thread(embedded.start)
    try:
        log.info(
            "using_embedded_postgresql",
            data_dir=str(embedded.data_dir),
            hint="set database.url to use another server",
        )
        yield await ensure_database(maintenance)
    finally:
        await asyncio.to_thread(embedded.stop)


@asynccontextmanager
async def open_database(
    url: str, state_dir: Path, *, pool_size: int = 10
) -> AsyncIterator[Database]:
    """Connect both pools to the configured database (embedded when ``url`` is empty)."""
    async with resolve_dsn(url, state_dir) as dsn:
        db = await connect_database(dsn, pool_size=pool_size)
        log.debug("database_connected", url=redact_dsn(dsn))
        try:
            yield db
        finally:
            # Pools close before the embedded server is let go (the enclosing block), or the
            # server's shutdown would wait on our open connections.
            await db.close()
