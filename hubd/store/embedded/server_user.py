"""The system user the embedded server runs as when hubd runs as root, made once per host.

The library makes :data:`~hubd.store.embedded.state_dir.SERVER_USER` itself when it is missing, but
outside its inter-process lock, as a look-up then ``useradd`` that fails on any error: two hubd
processes starting at once on a fresh host (the service's first start and an operator's
``hubd migrate``) both found no user, both ran ``useradd``, and the one that came second failed
with exit 9 ("username already in use"), which ended it with exit 3. hubd makes the user before
the library looks, under the library's lock, and takes a ``useradd`` that failed because another
process made the user meanwhile for done: the lock is per ``XDG_RUNTIME_DIR`` (the library keeps
it there), so two root shells need not share it, and a process that is not hubd never takes it.
"""

from __future__ import annotations

import pwd
import subprocess
from typing import Final

import structlog

from hubd.errors import EmbeddedPostgresError
from hubd.store.embedded.state_dir import SERVER_USER

__all__ = ["USERADD", "ensure_server_user", "user_exists"]

USERADD: Final = ("useradd", "-s", "/bin/bash")
"""How the user is made: as the library would make it, so a host where the library made it
and one where hubd did hold the same account."""

_USERADD_TIMEOUT: Final = 60

log = structlog.get_logger(__name__)


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def ensure_server_user(name: str = SERVER_USER) -> None:
    """Make the system user ``name`` unless it exists. Blocking; root only.

    A ``useradd`` that fails while another process makes the same user (exit 9, or a
    contended lock on ``/etc/passwd``) is no error when the user exists afterwards: whoever made
    it, it is the account the server needs. Only a failure after which there is still no such
    user is raised.
    """
    if user_exists(name):
        return
    try:
        made = subprocess.run(  # noqa: S603 -- a fixed command and the fixed user name
            [*USERADD, name],
            capture_output=True,
            text=True,
            timeout=_USERADD_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        # Looked again below: a maker we could not run may still have had a rival that could.
        outcome = f"did not run: {exc}"
    else:
        if made.returncode == 0:
            log.info("embedded_postgresql_system_user_made", user=name)
            return
        outcome = f"exited {made.returncode}: {made.stderr.strip() or made.stdout.strip()}"
    if user_exists(name):
        # Made by another process between our look-up and our useradd.
        log.info("embedded_postgresql_system_user_made_by_another_process", user=name)
        return
    raise EmbeddedPostgresError(
        f"running as root, the embedded PostgreSQL runs as the system user {name}, which does "
        f"not exist and could not be made: {' '.join(USERADD)} {name} {outcome}; make it "
        f"(useradd {name}) or set database.url"
    )
