"""What a data directory's ``postmaster.pid`` says of the server that wrote it, once every process
that used the server is gone: an orphan to stop, a stale file to remove, or nothing to act on.

Whether a process runs is asked of ``kill(pid, 0)``, never of ``/proc`` alone: under systemd's
``ProtectProc=invisible`` a restarted service does not see the processes of its previous run
there. :class:`~hubd.store.embedded.server.EmbeddedPostgres` acts on the verdict.
"""

from __future__ import annotations

import enum
import os
import socket
from pathlib import Path
from typing import Final

import attrs

__all__ = [
    "LOCK_FILE",
    "LockFile",
    "LockVerdict",
    "judge_lock_file",
    "pid_alive",
    "pid_state",
    "process_name",
    "read_lock_file",
    "socket_answers",
]

LOCK_FILE: Final = "postmaster.pid"


class LockVerdict(enum.Enum):
    """What a ``postmaster.pid`` whose users are all gone stands for."""

    NONE = "none"
    """No server to act on: its pid is gone (the server replaces such a file itself), or it
    belongs to another user, or nothing tells whether it is PostgreSQL."""
    STALE = "stale"
    """Its pid runs, but as another program: the server that wrote it is gone."""
    ORPHAN = "orphan"
    """A server runs on this data directory, and nobody uses it."""


def judge_lock_file(*, alive: bool | None, command: str | None, answers: bool) -> LockVerdict:
    """The verdict on a lock file whose users are gone.

    ``alive``: ``kill(pid, 0)`` succeeded (True), failed with ESRCH (False) or EPERM (None, a
    process of another user). ``command``: the process's name in ``/proc``, ``None`` when
    ``/proc`` does not show it (``ProtectProc=invisible``). ``answers``: the server's socket
    accepts a connection.
    """
    if alive is not True:
        return LockVerdict.NONE
    if command is not None:
        return LockVerdict.ORPHAN if command == "postgres" else LockVerdict.STALE
    # Hidden from /proc but ours to signal: a process of the same uid from the service's
    # previous run. Only a listening socket on this data directory says it is the server; a
    # hidden process with none (a sidecar that got the pid, or a server shutting down) is
    # left alone.
    return LockVerdict.ORPHAN if answers else LockVerdict.NONE


@attrs.frozen(kw_only=True)
class LockFile:
    """What hubd reads of a ``postmaster.pid``: the server's pid, and its socket when the file
    names one."""

    pid: int
    socket: Path | None


def read_lock_file(data_dir: Path) -> LockFile | None:
    # postmaster.pid: pid, data directory, start time, port, socket directory, listen address,
    # shared memory key, status.
    try:
        lines = (data_dir / LOCK_FILE).read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    socket_path = None
    if len(lines) >= 5 and lines[3].strip() and lines[4].strip():
        socket_path = Path(lines[4].strip()) / f".s.PGSQL.{lines[3].strip()}"
    return LockFile(pid=pid, socket=socket_path)


def pid_state(pid: int) -> bool | None:
    """``kill(pid, 0)``'s answer: ``True`` a process runs, ``False`` none does, ``None`` one of
    another user does."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    return True


def process_name(pid: int) -> str | None:
    """The program ``pid`` runs, as ``/proc`` shows it; ``""`` for a zombie (it runs
    nothing, though ``kill(pid, 0)`` still finds it), ``None`` when ``/proc`` hides it."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": comm may itself hold spaces and parentheses.
    name, _, rest = text.partition("(")[2].rpartition(")")
    return "" if rest.split()[:1] == ["Z"] else name


def socket_answers(path: Path | None) -> bool:
    """Whether a server accepts a connection on the Unix socket ``path``."""
    if path is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs, a process of another user included: only a pid that is gone may
    be dropped from the server's users."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
