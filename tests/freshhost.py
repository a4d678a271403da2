"""A fresh host for root's embedded server, without touching this one: commands run in a mount
namespace of their own where ``/etc`` is a private copy without the server's system user, so
they make it anew, and the machine's own user (and every server running as it) is left alone.

Every command run with one :class:`FreshHost`'s prefix sees the same copy, so a user one of them
makes is there for the others, as on a real host. ``useradd`` can be wrapped (a script first on
``PATH``) to widen or force the races between two makers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from hubd.store.embedded.state_dir import SERVER_USER

__all__ = ["FreshHost", "fresh_host"]

_ACCOUNT_FILES = ("passwd", "shadow", "group", "gshadow", "subuid", "subgid")


@attrs.frozen(kw_only=True)
class FreshHost:
    etc: Path
    """The private copy of ``/etc`` the commands see as ``/etc``."""
    bin: Path
    """A directory first on the commands' ``PATH``, for wrappers of system commands."""
    useradd: str
    """The real ``useradd``, for wrappers to call."""

    @property
    def prefix(self) -> list[str]:
        """What a command is run behind to see this host's ``/etc``."""
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            'mount --bind "$0" /etc && exec "$@"',
            str(self.etc),
        ]

    @property
    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def users(self, name: str = SERVER_USER) -> list[str]:
        """The lines of this host's ``passwd`` that name ``name``."""
        lines = (self.etc / "passwd").read_text().splitlines()
        return [line for line in lines if line.split(":", 1)[0] == name]

    def wrap_useradd(self, script: str) -> None:
        """Put ``useradd`` first on ``PATH`` as ``script`` (sh; ``$REAL`` is the real one)."""
        wrapper = self.bin / "useradd"
        wrapper.write_text(f'#!/bin/sh\nREAL="{self.useradd}"\n{script}\n')
        wrapper.chmod(0o755)


@contextlib.contextmanager
def fresh_host() -> Iterator[FreshHost]:
    """A fresh host's ``/etc`` for root's commands; skips the test where there is none to have
    (not root, no ``unshare``, no right to make a mount namespace, no ``useradd``)."""
    if os.geteuid() != 0:
        pytest.skip("making the embedded server's system user needs root")
    useradd = shutil.which("useradd")
    if useradd is None or shutil.which("unshare") is None:
        pytest.skip("needs useradd and unshare")
    tried = subprocess.run(
        ["unshare", "--mount", "--", "true"], capture_output=True, text=True, check=False
    )
    if tried.returncode != 0:
        pytest.skip(f"no mount namespace for a private /etc: {tried.stderr.strip()}")
    with tempfile.TemporaryDirectory(prefix="hubd-etc") as scratch:
        etc = Path(scratch) / "etc"
        shutil.copytree("/etc", etc, symlinks=True)
        # Read by everyone, as /etc is: the server's user looks itself up in it (initdb).
        etc.chmod(0o755)
        for name in _ACCOUNT_FILES:
            path = etc / name
            if path.exists():
                kept = [
                    line
                    for line in path.read_text().splitlines(keepends=True)
                    if line.split(":", 1)[0] != SERVER_USER
                ]
                path.write_text("".join(kept))
        bin_dir = Path(scratch) / "bin"
        bin_dir.mkdir()
        yield FreshHost(etc=etc, bin=bin_dir, useradd=useradd)
