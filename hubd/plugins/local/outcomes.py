"""How the ``local`` provisioner tells what happened: the answers of a start that failed, and a
child's exit and last line of output for the log."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from hubd.plugins.local.record import transient
from hubd.plugins.protocol import Rejected
from hubd.redaction import scrub

__all__ = [
    "describe_exit",
    "last_line",
    "not_owned",
    "os_error",
    "resolve_hubd",
    "start_failure",
]

_LAST_LINE_MAX: Final = 300
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


def last_line(path: Path, offset: int = 0) -> str:
    """The last non-blank line written to ``path`` after ``offset``, bounded and scrubbed."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - 4096))
            tail = f.read()
    except OSError:
        return ""
    lines = [line.strip() for line in tail.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return ""
    line = _CONTROL.sub(" ", lines[-1])
    if len(line) > _LAST_LINE_MAX:
        line = line[: _LAST_LINE_MAX - 1] + "…"
    return scrub(line)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def resolve_hubd(command: tuple[str, ...], env: Mapping[str, str]) -> tuple[str, ...]:
    """``command``, with a bare ``hubd`` that the child's PATH does not know replaced by the
    ``hubd`` script installed beside the running interpreter: the default command then works
    from a virtualenv that was never activated (``.venv/bin/hubd dev``)."""
    if command[0] != "hubd" or shutil.which("hubd", path=env.get("PATH", os.defpath)):
        return command
    beside = Path(sys.executable).parent / "hubd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return (str(beside), *command[1:])
    return command


def not_owned() -> Rejected:
    return Rejected(
        code="claim_lost",
        message="the claim no longer owns the allocation; nothing was started",
        retryable=True,
    )


def os_error(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name}: {exc.strerror or exc}; retried later"


def start_failure(program: str, exc: OSError) -> Rejected:
    if isinstance(exc, FileNotFoundError):
        where = "" if "/" in program else " in PATH"
        return Rejected(
            code="command_not_found",
            message=f"sidecar command {program!r} not found{where}",
            retryable=False,
        )
    if isinstance(exc, PermissionError):
        return Rejected(
            code="command_failed",
            message=f"sidecar command {program!r} cannot be executed: permission denied",
            retryable=False,
        )
    return Rejected(
        code="command_failed",
        message=f"sidecar command {program!r} could not be started: {exc.strerror or exc}",
        # Out of processes, memory or file descriptors: another try may succeed.
        retryable=transient(exc),
    )
