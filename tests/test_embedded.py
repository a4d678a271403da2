"""The embedded server survives its users: SIGKILL, stale lock files, other users' CLIs."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
from structlog.testing import capture_logs

from hubd.errors import EmbeddedPostgresError
from hubd.store.embedded import EmbeddedPostgres, embedded_available, log_excerpt, server_user
from hubd.store.embedded.postmaster import LockVerdict, judge_lock_file
from tests.clikit import run_hubd

pytestmark = pytest.mark.skipif(not embedded_available(), reason="needs hubd[embedded]")

_USER = """
import sys
from pathlib import Path
from hubd.logs import configure_logging
from hubd.store.embedded import EmbeddedPostgres
configure_logging()
EmbeddedPostgres(Path(sys.argv[1])).start()
print("started", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def state() -> Iterator[Path]:
    # Short, and below /tmp (world-searchable): the server's socket lives in its data directory,
    # and run as root the server runs as a system user that must reach it.
    with tempfile.TemporaryDirectory(prefix="hubd-o") as path:
        yield Path(path)


def _postmaster_pid(state: Path) -> int | None:
    try:
        return int((state / "pgdata" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until(check: Callable[[], bool], *, within: float = 30.0, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _killed_user(state: Path) -> int:
    """Start the server from a child process, SIGKILL that process; the server's pid."""
    with subprocess.Popen(
        [sys.executable, "-c", _USER, str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "started"
            pid = _postmaster_pid(state)
            assert pid is not None
            assert _alive(pid)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    return pid


def _stop_orphaned(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hubd.store.embedded", "stop-orphaned", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _query(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        value: int = await conn.fetchval("SELECT 1")
    finally:
        await conn.close()
    return value


class TestOrphanedServer:
    def test_start_after_sigkill_replaces_the_orphan(self, state: Path) -> None:
        """A server whose only user was killed with SIGKILL is stopped by the next start, which
        runs a fresh server of its own on the same data."""
        orphan = _killed_user(state)
        assert _alive(orphan)  # the server is a daemon: it outlived its user
        embedded = EmbeddedPostgres(state)
        dsn = embedded.start()
        try:
            # Stopped: its lock file went first, its process exits just after.
            _wait_until(lambda: not _alive(orphan), what="the orphan to exit")
            assert _postmaster_pid(state) not in (None, orphan)
            assert asyncio.run(_query(dsn)) == 1
        finally:
            embedded.stop()
        assert _postmaster_pid(state) is None

    def test_stop_orphaned_stops_a_server_nobody_uses(self, state: Path) -> None:
        """``python -m hubd.store.embedded stop-orphaned`` (the unit's ExecStopPost=) stops the
        server of a killed user and removes its lock file."""
        orphan = _killed_user(state)
        result = _stop_orphaned(state)
        assert result.returncode == 0, result.stderr
        assert "embedded_postgresql_outlived_its_users_stopping_it" in result.stderr
        _wait_until(lambda: not _alive(orphan), what="the orphan to exit")
        assert _postmaster_pid(state) is None

    def test_stop_orphaned_leaves_a_server_in_use(self, state: Path) -> None:
        """A server with a live user is left running, and a clean state dir is a no-op."""
        assert _stop_orphaned(state).returncode == 0  # nothing there yet
        embedded = EmbeddedPostgres(state)
        embedded.start()
        try:
            pid = _postmaster_pid(state)
            result = _stop_orphaned(state)
            assert result.returncode == 0, result.stderr
            assert pid is not None
            assert _alive(pid)
            assert _postmaster_pid(state) == pid
        finally:
            embedded.stop()

    def test_lock_file_of_a_reused_pid_is_not_fatal(self, state: Path) -> None:
        """A ``postmaster.pid`` left by a dead server whose pid now belongs to another program
        is removed, and the server starts."""
        embedded = EmbeddedPostgres(state)
        embedded.start()
        embedded.stop()
        lock = state / "pgdata" / "postmaster.pid"
        other = subprocess.Popen(["sleep", "600"])
        try:
            lock.write_text(f"{other.pid}\n{state / 'pgdata'}\n0\n5432\n{state / 'pgdata'}\n\n\n")
            dsn = EmbeddedPostgres(state).start()
            try:
                assert asyncio.run(_query(dsn)) == 1
                assert other.poll() is None  # never signalled
            finally:
                # A new handle in this process: the library keeps one per data directory.
                embedded.stop()
                EmbeddedPostgres(state).stop()
        finally:
            other.kill()
            other.wait()


class TestLockVerdict:
    def test_dead_or_foreign_pid_is_left_to_the_server(self) -> None:
        """A lock file whose pid is gone, or another user's, is no orphan to stop."""
        assert judge_lock_file(alive=False, command=None, answers=False) is LockVerdict.NONE
        assert judge_lock_file(alive=None, command="postgres", answers=True) is LockVerdict.NONE

    def test_visible_process_is_judged_by_its_name(self) -> None:
        """A live pid seen in /proc is an orphan server when it is postgres, else stale."""
        assert judge_lock_file(alive=True, command="postgres", answers=False) is LockVerdict.ORPHAN
        assert judge_lock_file(alive=True, command="python3", answers=True) is LockVerdict.STALE

    def test_hidden_process_is_judged_by_its_socket(self) -> None:
        """A live pid hidden from /proc (ProtectProc=invisible) is an orphan server only when
        the data directory's socket answers."""
        assert judge_lock_file(alive=True, command=None, answers=True) is LockVerdict.ORPHAN
        assert judge_lock_file(alive=True, command=None, answers=False) is LockVerdict.NONE


class TestFailedStart:
    def test_log_excerpt_is_bounded(self, tmp_path: Path) -> None:
        """A failed start quotes the last 20 lines of the server log, at most 4 KiB."""
        log = tmp_path / "log"
        log.write_text("".join(f"line {i} " + "x" * 50 + "\n" for i in range(5000)))
        excerpt = log_excerpt(log)
        assert len(excerpt.encode()) <= 4096 + 100
        assert excerpt.splitlines()[-1].startswith("line 4999 ")
        assert len(excerpt.splitlines()) == 21  # the heading and 20 lines
        assert log_excerpt(tmp_path / "missing") == ""

    def test_failed_start_reports_an_excerpt_only(self, state: Path) -> None:
        """A server that cannot start (a bad setting) fails the command with the end of its
        log; retries do not make the message grow."""
        embedded = EmbeddedPostgres(state)
        embedded.start()
        embedded.stop()
        with (state / "pgdata" / "postgresql.conf").open("a") as conf:
            conf.write("shared_buffers = 'not a size'\n")
        with (state / "pgdata" / "log").open("a") as log:
            log.write("".join(f"an older line {i}\n" for i in range(5000)))
        for _ in range(2):
            result = run_hubd("migrate", env={"HUBD_STATE_DIR": str(state)})
            assert result.code == 3, result.err
            assert 'invalid value for parameter "shared_buffers"' in result.err
            assert "an older line 4000" not in result.err
            assert len(result.err.encode()) < 8 * 1024


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's directories")
class TestAnotherUsersStateDir:
    NOBODY = 65534

    def _assert_refused(self, state: Path, *, naming: str) -> None:
        result = run_hubd("alloc", "list", env={"HUBD_STATE_DIR": str(state)})
        assert result.code == 2, result.err
        assert naming in result.err
        assert "hubctl alloc list" in result.err

    def test_state_dir_of_another_owner_is_refused_untouched(self, state: Path) -> None:
        """A state dir owned by another uid is refused, naming its owner and the command that
        runs hubd as the service's user; its owner and mode stay as they were."""
        service = state / "hubd"
        service.mkdir(mode=0o700)
        os.chown(service, self.NOBODY, self.NOBODY)
        self._assert_refused(service, naming=f"belongs to uid {self.NOBODY}")
        after = service.stat()
        assert (after.st_uid, stat.S_IMODE(after.st_mode)) == (self.NOBODY, 0o700)
        assert not (service / "pgdata").exists()

    def test_data_dir_of_another_owner_is_refused_untouched(self, state: Path) -> None:
        """A root-owned state dir whose pgdata belongs to another uid is refused as well."""
        pgdata = state / "pgdata"
        pgdata.mkdir(mode=0o700)
        (pgdata / "PG_VERSION").write_text("18\n")
        os.chown(pgdata, self.NOBODY, self.NOBODY)
        self._assert_refused(state, naming=f"belongs to uid {self.NOBODY}")
        assert pgdata.stat().st_uid == self.NOBODY
        assert stat.S_IMODE(pgdata.stat().st_mode) == 0o700

    def test_dynamic_user_layout_is_refused_untouched(self, state: Path) -> None:
        """The layout DynamicUser= makes (``hubd`` a symlink to ``private/hubd``, ``private``
        0700, the target the dynamic user's) is refused; ``private`` stays 0700."""
        private = state / "private"
        private.mkdir(mode=0o700)
        target = private / "hubd"
        target.mkdir(mode=0o755)
        os.chown(target, self.NOBODY, self.NOBODY)
        (state / "hubd").symlink_to("private/hubd")
        self._assert_refused(state / "hubd", naming=str(target))
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert target.stat().st_uid == self.NOBODY

    def test_private_parent_behind_a_symlink_is_refused(self, state: Path) -> None:
        """A root-owned state dir reached through a symlink into a private directory is refused
        naming that directory, which the library would otherwise have made world-readable."""
        private = state / "private"
        private.mkdir(mode=0o700)
        (private / "hubd").mkdir()
        (state / "hubd").symlink_to("private/hubd")
        result = run_hubd("migrate", env={"HUBD_STATE_DIR": str(state / "hubd")})
        assert result.code == 2, result.err
        assert f"{private} (0700)" in result.err
        assert stat.S_IMODE(private.stat().st_mode) == 0o700


class TestServerUser:
    """Making root's server user (hubd.store.embedded.server_user), with a scripted
    ``useradd`` first on ``PATH`` and a scripted look-up: no account of this machine is touched.
    The real races run in tests/test_cli.py (TestMigrate), as root on a private /etc."""

    @pytest.fixture
    def useradd(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
        """Install a ``useradd`` running ``script`` (sh); returns the file its calls go to."""
        calls = tmp_path / "calls"
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")

        def install(script: str) -> Path:
            wrapper = tmp_path / "useradd"
            wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n{script}\n')
            wrapper.chmod(0o755)
            return calls

        return install

    @staticmethod
    def _looks(monkeypatch: pytest.MonkeyPatch, *answers: bool) -> None:
        """The user's look-ups answer ``answers`` in turn."""
        remaining = list(answers)
        monkeypatch.setattr(server_user, "user_exists", lambda _name: remaining.pop(0))

    def test_an_existing_user_is_not_made_again(
        self, useradd: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A user that exists is used as it is: useradd is not run."""
        calls = useradd("exit 0")
        self._looks(monkeypatch, True)
        server_user.ensure_server_user("hubd_t_user")
        assert not calls.exists()

    def test_a_missing_user_is_made_as_the_library_would(
        self, useradd: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A missing user is made with the library's own useradd arguments."""
        calls = useradd("exit 0")
        self._looks(monkeypatch, False)
        server_user.ensure_server_user("hubd_t_user")
        assert calls.read_text().split() == [*server_user.USERADD[1:], "hubd_t_user"]

    def test_a_user_made_by_a_rival_meanwhile_is_no_error(
        self, useradd: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Missing at the look-up, made by another process before our useradd, which exits 9
        ("already in use"): the user is there, so it is done, and the log says who made it."""
        useradd("echo \"useradd: user 'hubd_t_user' already exists\" >&2; exit 9")
        self._looks(monkeypatch, False, True)
        with capture_logs() as logs:
            server_user.ensure_server_user("hubd_t_user")
        assert [entry["event"] for entry in logs] == [
            "embedded_postgresql_system_user_made_by_another_process"
        ]

    @pytest.mark.parametrize(
        ("script", "said"),
        [
            ("echo 'useradd: cannot lock /etc/passwd' >&2; exit 1", "exited 1: useradd: cannot"),
            (None, "did not run"),
        ],
    )
    def test_a_user_still_missing_after_useradd_is_an_error(
        self,
        useradd: Callable[[str], Path],
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        script: str | None,
        said: str,
    ) -> None:
        """A useradd that failed (or could not run) with the user still missing afterwards
        stops the start with what useradd said, naming the user."""
        if script is None:
            monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
        else:
            useradd(script)
        self._looks(monkeypatch, False, False)
        with pytest.raises(EmbeddedPostgresError, match=said) as raised:
            server_user.ensure_server_user("hubd_t_user")
        assert "hubd_t_user" in str(raised.value)
