"""Where an application reaches this hubd's database (``hubd db-url``).

An external database is the configured URL. The embedded server (:mod:`~hubd.store.embedded.server`)
listens on a Unix socket only, in its data directory ``<state dir>/pgdata``, and takes the
database role ``postgres`` with trust authentication on that socket: whoever can enter the data
directory (mode 0700, the user hubd runs as) is let in. Its address is worked out from the
state dir and, while the server runs, its ``postmaster.pid``; nothing here starts the server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final
from urllib.parse import quote

from hubd.errors import ConfigError
from hubd.redaction import redact_dsn
from hubd.store.embedded.server import DATABASE_NAME

__all__ = ["EMBEDDED_ROLE", "application_dsn", "embedded_dsn"]

EMBEDDED_ROLE: Final = "postgres"
"""The role the embedded server's cluster was initialised with (``initdb -U postgres``)."""

_DEFAULT_PORT: Final = 5432
_SUN_PATH_MAX: Final = 107
"""The longest Unix socket path the kernel takes (``sun_path`` is 108 bytes with its NUL)."""


def application_dsn(url: str, state_dir: Path, *, show_password: bool = False) -> str:
    """The DSN of the configured database (``url``; the embedded one's when empty), its
    password hidden unless ``show_password``."""
    if url:
        return url if show_password else redact_dsn(url)
    return embedded_dsn(state_dir)


def embedded_dsn(state_dir: Path) -> str:
    """The embedded server's ``hubd`` database as libpq and asyncpg read it: the socket
    directory as ``host``, the role as ``user``. :class:`ConfigError` when the socket's place
    cannot be known without starting the server."""
    data_dir = (state_dir / "pgdata").resolve()
    socket_dir, port = _running_socket(data_dir) or (data_dir, _DEFAULT_PORT)
    if socket_dir == data_dir and len(os.fsencode(data_dir / f".s.PGSQL.{port}")) > _SUN_PATH_MAX:
        # The server then puts its socket in a directory of its own, chosen when it starts.
        raise ConfigError(
            f"state.dir {state_dir}: the path of the embedded server's socket would be too long "
            "for a Unix socket, so the server chooses another place when it starts; start it "
            "(hubd run) and ask again, or choose a shorter state.dir"
        )
    dsn = f"postgresql:///{DATABASE_NAME}?host={quote(str(socket_dir), safe='/')}"
    if port != _DEFAULT_PORT:
        dsn += f"&port={port}"
    return f"{dsn}&user={EMBEDDED_ROLE}"


def _running_socket(data_dir: Path) -> tuple[Path, int] | None:
    """The socket directory and port a server on ``data_dir`` recorded in its lock file, when
    one is there: ``postmaster.pid`` lines are pid, data directory, start time, port, socket
    directory, listen address, shared memory key, status."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
    except OSError:
        return None
    if len(lines) < 5 or not lines[3].strip().isdigit() or not lines[4].strip():
        return None
    return Path(lines[4].strip()), int(lines[3].strip())
