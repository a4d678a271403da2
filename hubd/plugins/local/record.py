"""What the ``local`` provisioner knows of a sidecar it started: the record on disk, the leader of
its process group, and the group itself.

A record names a process by its pid *and* its start time *and* the boot id; the group is ours
only while one of its members says so by its ``HUBD_SIDECAR_ID`` (see :mod:`hubd.plugins.local`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import json
import os
import re
from pathlib import Path
from typing import Final

import attrs

from hubd.plugins.procfs import group_members, names_sidecar, read_stat

__all__ = [
    "CorruptRecord",
    "Leader",
    "Record",
    "discard_record",
    "group_alive",
    "group_is_ours",
    "leader_of",
    "load_record",
    "save_record",
    "transient",
    "wait_gone",
]

POLL_MIN: Final = 0.005
POLL_MAX: Final = 0.1
_EXTERNAL_REF: Final = re.compile(r"local:([0-9]{1,10}):([0-9]{1,20})")
# Out of descriptors, memory or processes, or an I/O error: the machine's trouble, not the
# sidecar's. Retried with backoff, never a verdict such as destroy_failed.
_TRANSIENT_ERRNOS: Final = frozenset(
    {errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE, errno.EIO, errno.EINTR, errno.ENOBUFS}
)


def transient(exc: OSError) -> bool:
    return exc.errno in _TRANSIENT_ERRNOS


class CorruptRecord(Exception):
    pass


@attrs.frozen(kw_only=True)
class Record:
    sidecar_id: str
    pid: int
    start_time: int
    boot_id: str | None = None
    """``None`` for a record rebuilt from an external_ref: identity then also needs the
    process's environment to name the sidecar."""
    allocation_id: str | None = None
    generation: int | None = None
    command: tuple[str, ...] = ()
    started_at: float | None = None
    kill_at: float | None = None
    """Wall-clock time after which SIGKILL is due; set with the first SIGTERM, so escalation
    survives a destroy that was cancelled (or a daemon that restarted) during the grace period."""

    @property
    def pgid(self) -> int:
        # start_new_session makes the child the leader of a group whose id is its pid.
        return self.pid

    @property
    def external_ref(self) -> str:
        return f"local:{self.pid}:{self.start_time}"

    def to_json(self) -> bytes:
        document = attrs.asdict(self)
        document["pgid"] = self.pgid
        document["command"] = list(self.command)
        return json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, sidecar_id: str) -> Record:
        try:
            document = json.loads(data)
            record = cls(
                sidecar_id=document["sidecar_id"],
                pid=document["pid"],
                start_time=document["start_time"],
                boot_id=document.get("boot_id"),
                allocation_id=document.get("allocation_id"),
                generation=document.get("generation"),
                command=tuple(document.get("command", ())),
                started_at=document.get("started_at"),
                kill_at=document.get("kill_at"),
            )
            pgid = document.get("pgid", record.pid)
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptRecord(f"{type(exc).__name__}: {exc}") from None
        sane = (
            record.sidecar_id == sidecar_id
            and is_int(record.pid)
            and record.pid > 1
            and pgid == record.pid
            and is_int(record.start_time)
            and (record.kill_at is None or isinstance(record.kill_at, int | float))
        )
        if not sane:
            raise CorruptRecord("fields do not describe a process this provisioner started")
        return record

    @classmethod
    def from_external_ref(cls, sidecar_id: str, ref: str | None) -> Record | None:
        match = _EXTERNAL_REF.fullmatch(ref or "")
        if match is None or int(match[1]) <= 1:
            return None
        return cls(sidecar_id=sidecar_id, pid=int(match[1]), start_time=int(match[2]))


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Leader(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"
    """A zombie not reaped yet: its group id is still reserved."""
    ABSENT = "absent"
    """No such pid: members of its group may live on (and keep the group id reserved)."""
    FOREIGN = "foreign"
    """The pid belongs to another process, or another boot: the pid was free at some point,
    which it cannot be while any member of our group lives, so our group is gone."""


def load_record(directory: Path, sidecar_id: str) -> Record | None:
    path = directory / f"{sidecar_id}.json"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if transient(exc):
            raise
        raise CorruptRecord(f"cannot read {path}: {exc.strerror}") from None
    try:
        return Record.from_json(data, sidecar_id)
    except CorruptRecord as exc:
        raise CorruptRecord(f"unreadable record {path}: {exc}") from None


def save_record(directory: Path, record: Record) -> None:
    """Write the record atomically: readers see the old file or the new one, never half."""
    path = directory / f"{record.sidecar_id}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, record.to_json())
    finally:
        os.close(fd)
    # No fsync: a crash that loses the file also ends every process it could describe.
    os.replace(tmp, path)


def discard_record(directory: Path, sidecar_id: str, *, log_too: bool) -> None:
    (directory / f"{sidecar_id}.json").unlink(missing_ok=True)
    if log_too:
        (directory / f"{sidecar_id}.log").unlink(missing_ok=True)


def leader_of(record: Record, boot_id: str | None) -> Leader:
    if record.pgid in {os.getpgrp(), os.getpid()}:
        return Leader.FOREIGN  # never, whatever a record says, signal hubd's own group
    if record.boot_id is not None and record.boot_id != boot_id:
        return Leader.FOREIGN
    stat = read_stat(record.pid)
    if stat is None:
        return Leader.ABSENT
    if stat.start_time != record.start_time:
        return Leader.FOREIGN
    # A record rebuilt from an external_ref has no boot id to rule out a process of an
    # earlier boot that happens to match pid and start time; its environment can.
    if record.boot_id is None and names_sidecar(record.pid, record.sidecar_id) is False:
        return Leader.FOREIGN
    return Leader.EXITED if stat.dead else Leader.RUNNING


def group_is_ours(record: Record) -> bool:
    return any(
        not stat.dead and names_sidecar(pid, record.sidecar_id)
        for pid, stat in group_members(record.pgid)
    )


def group_alive(pgid: int) -> bool:
    """Whether any member of the group still runs. Zombies do not count: they keep the
    group non-empty until someone reaps them, which an init that reaps lazily may not do
    for a while."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a member we may not signal still counts as alive
    alive = False
    for pid, stat in group_members(pgid):
        if not stat.dead:
            alive = True
        elif stat.ppid == os.getpid() and pid != pgid:
            # Reparented to us (hubd is PID 1 in a container, or a subreaper). Leaders are
            # left alone: ours are reaped by asyncio's child watcher, and stealing one from
            # it would lose its exit status.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    return alive


async def wait_gone(pgid: int, within: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    delay = POLL_MIN
    # Polled: there is no event for "a process group became empty".
    while group_alive(pgid):
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(delay, remaining))
        delay = min(delay * 2, POLL_MAX)
    return True
