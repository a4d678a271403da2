"""Reading processes from Linux ``/proc``: states, groups, start times and environments.

A pid alone does not name a process (the kernel hands pids out again); a start time
(``/proc/<pid>/stat`` field 22, clock ticks since boot) together with the boot id does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs

__all__ = ["Stat", "boot_id", "group_members", "names_sidecar", "read_stat"]


@attrs.frozen
class Stat:
    state: str
    ppid: int
    pgid: int
    start_time: int

    @property
    def dead(self) -> bool:
        return self.state in {"Z", "X", "x"}


def read_stat(pid: int) -> Stat | None:
    """``/proc/<pid>/stat``, or ``None`` when there is no such process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (comm) is free text in parentheses and may hold ") "; it ends at the last ")".
    fields = data[data.rindex(b")") + 2 :].split()
    # fields[0] is field 3 of proc(5): state, ppid, pgrp, …, starttime (field 22).
    return Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def names_sidecar(pid: int, sidecar_id: str) -> bool | None:
    """Whether the process's environment names ``sidecar_id``; ``None`` when it cannot be read
    (another user's process, or a zombie whose memory is gone)."""
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    if not data:
        return None
    return f"HUBD_SIDECAR_ID={sidecar_id}".encode() in data.split(b"\0")


def group_members(pgid: int) -> Iterator[tuple[int, Stat]]:
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                stat = read_stat(pid)
            except (OSError, ValueError, IndexError):
                continue
            if stat is not None and stat.pgid == pgid:
                yield pid, stat


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None
