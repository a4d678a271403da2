"""An external PostgreSQL as docs/operations.md sets one up: the distribution's server (not the
embedded wheel's), on loopback TCP, with hubd's database owned by a plain login role that is
no superuser. What an application role can reach through a hubd function is then that role's
rights, not a superuser's, and the server is the oldest major version hubd supports where the
distribution ships it (Debian 12: PostgreSQL 15).

Required where ``CI`` is set (``.ci/install-podman`` installs the ``postgresql`` package); skipped
with the reason elsewhere when no such server is installed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import pytest

__all__ = ["ExternalServer", "distribution_binaries", "external_server"]

OWNER = "hubd_owner"
"""The plain role that owns hubd's database, as in docs/operations.md's ``CREATE ROLE hubd``."""


def distribution_binaries() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` with initdb, or None."""
    root = Path("/usr/lib/postgresql")
    found = [p / "bin" for p in root.glob("*") if (p / "bin" / "initdb").exists()]
    found.sort(key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    return found[-1] if found else None


@attrs.frozen
class ExternalServer:
    port: int
    major: int

    def superuser(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def owner(self, database: str) -> str:
        return f"postgresql://{OWNER}@127.0.0.1:{self.port}/{database}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_as() -> str | None:
    """PostgreSQL refuses to run as root: the distribution's own user then."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "embedded_postgres"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    pytest.fail("running as root with no 'postgres' user to run a server as")


@contextmanager
def external_server() -> Iterator[ExternalServer]:
    binaries = distribution_binaries()
    if binaries is None:
        if os.environ.get("CI"):
            pytest.fail("CI has no distribution PostgreSQL: .ci/install-podman installs it")
        pytest.skip("no distribution PostgreSQL here (apt-get install postgresql)")
    user = _run_as()
    root = Path(tempfile.mkdtemp(prefix="hubd-ext"))
    data = root / "data"
    if user is not None:
        record = pwd.getpwnam(user)
        os.chown(root, record.pw_uid, record.pw_gid)
    port = _free_port()

    def run(*args: str) -> None:
        done = subprocess.run(
            [str(binaries / args[0]), *args[1:]],
            user=user,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=root,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")

    run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"\nport = {port}\nlisten_addresses = '127.0.0.1'\n"
            f"unix_socket_directories = '{root}'\nfsync = off\n"
        )
    run("pg_ctl", "-D", str(data), "-l", str(root / "log"), "-w", "start")
    try:
        yield ExternalServer(port=port, major=int(binaries.parent.name))
    finally:
        run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
