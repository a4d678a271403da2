"""hubd.plugins.local: real child processes in their own groups, started, found again and killed.

Every process a test starts carries a per-test marker in its environment; the ``mark`` fixture
kills whatever still carries it when the test ends, pass or fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import pytest

from hubd.errors import PluginLoadError
from hubd.plugins.local import (
    DEFAULT_COMMAND,
    SETTLE,
    LocalOptions,
    LocalProvisioner,
    parse_options,
)
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRejected,
    DestroyRequest,
    EnsureRequest,
    Ownership,
    Rejected,
    check_ensure_result,
)
from tests.reconcilerkit import poll_until

# The sidecar stand-in. argv[1] picks a behaviour; once running it reports what it saw in
# $OUT/<sidecar id>.json (written atomically, so a reader never sees half of it).
STUB = r"""
import json, os, signal, subprocess, sys, time
mode = sys.argv[1]
if mode == "exit3":
    print("starting up")
    print("fatal: cannot reach", os.environ["HUBD_URL"], "with", os.environ["HUBD_TOKEN"])
    sys.exit(3)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
report = {
    "pid": os.getpid(),
    "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("HUBD_", "EXTRA_"))},
}
if mode == "grandchild":
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    report["grandchild"] = subprocess.Popen(sleeper).pid
path = os.path.join(os.environ["OUT"], os.environ["HUBD_SIDECAR_ID"] + ".json")
with open(path + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(path + ".tmp", path)
time.sleep(600)
"""

MARK = "LOCALTEST_MARK"
HUB_URL = "ws://127.0.0.1:1/v1/sidecars/connect"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a process, or None if there is none."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def start_time(pid: int) -> int:
    found = proc_stat(pid)
    assert found is not None, f"no process {pid}"
    return found[1]


def alive(pid: int) -> bool:
    found = proc_stat(pid)
    return found is not None and found[0] not in {"Z", "X"}


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def environ_of(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def environ_has(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def living_with(entry: str) -> list[int]:
    """Every live (non-zombie) process whose environment holds ``entry`` ("NAME=value")."""
    return [
        int(name)
        for name in os.listdir("/proc")
        if name.isdigit() and alive(int(name)) and environ_has(int(name), entry)
    ]


async def until_dead(*pids: int) -> None:
    async def check() -> bool:
        return not any(alive(pid) for pid in pids)

    await poll_until(check, within=10.0)


async def kill_marked(mark: str) -> None:
    """SIGKILL the group of every live process carrying ``mark``, and wait until none runs."""
    leftovers = living_with(f"{MARK}={mark}")
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    await until_dead(*leftovers)


@pytest.fixture
async def mark() -> AsyncIterator[str]:
    value = secrets.token_hex(8)
    try:
        yield value
    finally:
        await kill_marked(value)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


Make = Callable[..., LocalProvisioner]


@pytest.fixture
async def make(tmp_path: Path, out: Path, mark: str) -> AsyncIterator[Make]:
    """A provisioner running the stub in ``mode``, on the test's state dir."""
    built: list[LocalProvisioner] = []

    def build(mode: str = "run", *, settle: float = SETTLE, **options: Any) -> LocalProvisioner:
        options.setdefault("command", [sys.executable, "-c", STUB, mode])
        options["env"] = {MARK: mark, "OUT": str(out), **options.get("env", {})}
        provisioner = LocalProvisioner(
            id="local", options=parse_options(options), state_dir=tmp_path / "state", settle=settle
        )
        built.append(provisioner)
        return provisioner

    try:
        yield build
    finally:
        await kill_marked(mark)
        # A child's exit reaches its provisioner through the event loop. Waiting for it here
        # keeps the last test of a session from closing the loop first, which would leave the
        # child's transport "running" and warn when it is collected.
        reapers = [task for p in built for _, task in p._children.values()]
        async with asyncio.timeout(10):
            await asyncio.gather(*reapers)


def ensure_request(sidecar_id: str = "sc_1", generation: int = 1) -> EnsureRequest:
    return EnsureRequest(
        allocation_id="al_1",
        generation=generation,
        tenant_id="t1",
        session_id=None,
        spec={},
        sidecar_id=sidecar_id,
        token="hubd_sc_" + secrets.token_hex(32),
        hub_ws_url=HUB_URL,
    )


def destroy_request(sidecar_id: str = "sc_1", external_ref: str | None = None) -> DestroyRequest:
    return DestroyRequest(
        allocation_id="al_1", generation=1, sidecar_id=sidecar_id, external_ref=external_ref
    )


async def report(out: Path, sidecar_id: str = "sc_1") -> dict[str, Any]:
    """What the stub reported once it was running."""
    path = out / f"{sidecar_id}.json"

    async def written() -> bool:
        return path.exists()

    await poll_until(written, within=10.0)
    found: dict[str, Any] = json.loads(path.read_text())
    return found


async def started(provisioner: LocalProvisioner, out: Path, sidecar_id: str = "sc_1") -> int:
    """Ensure the sidecar, wait for it to run, and return its pid."""
    result = await provisioner.ensure(ensure_request(sidecar_id))
    assert isinstance(result, Accepted)
    pid: int = (await report(out, sidecar_id))["pid"]
    assert result.external_ref == f"local:{pid}:{start_time(pid)}"
    return pid


def state_file(provisioner: LocalProvisioner, sidecar_id: str = "sc_1") -> Path:
    return provisioner.directory / f"{sidecar_id}.json"


class TestEnsure:
    """Starting sidecars."""

    async def test_environment(
        self, make: Make, out: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The child gets the HUBD_* variables, but not the daemon's own HUBD_* settings."""
        monkeypatch.setenv("HUBD_DATABASE_URL", "postgresql://hubd:pw@db/hubd")
        provisioner = make(env={"EXTRA_GREETING": "hi"})
        request = ensure_request(generation=4)
        result = await provisioner.ensure(request)
        assert isinstance(result, Accepted)
        seen = await report(out)
        assert seen["env"] == {
            "HUBD_URL": HUB_URL,
            "HUBD_TOKEN": request.token,
            "HUBD_ALLOCATION_ID": "al_1",
            "HUBD_SIDECAR_ID": "sc_1",
            "HUBD_GENERATION": "4",
            "EXTRA_GREETING": "hi",
        }

    async def test_environment_is_allow_listed(
        self, make: Make, out: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Only PATH, HOME, LANG, TZ, the HUBD_* it owns and the configured env reach the
        child: the daemon's PGPASSWORD, cloud credentials and the like do not."""
        monkeypatch.setenv("PGPASSWORD", "pg-canary")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-canary")
        monkeypatch.setenv("TZ", "UTC")
        provisioner = make(env={"EXTRA_GREETING": "hi"})
        assert isinstance(await provisioner.ensure(ensure_request()), Accepted)
        pid = (await report(out))["pid"]
        names = {item.split(b"=", 1)[0].decode() for item in environ_of(pid).split(b"\0") if item}
        allowed = {"PATH", "HOME", "LANG", "TZ", "EXTRA_GREETING", "OUT", MARK}
        assert names - allowed == {
            "HUBD_URL",
            "HUBD_TOKEN",
            "HUBD_ALLOCATION_ID",
            "HUBD_SIDECAR_ID",
            "HUBD_GENERATION",
        }
        assert "TZ" in names

    async def test_token_stays_off_disk_and_command_line(self, make: Make, out: Path) -> None:
        """The token is on no command line, in no record and in no log; the record is private."""
        provisioner = make()
        request = ensure_request()
        await provisioner.ensure(request)
        pid = (await report(out))["pid"]
        assert request.token.encode() not in cmdline(pid)
        record = state_file(provisioner)
        assert request.token not in record.read_text()
        assert request.token not in (provisioner.directory / "sc_1.log").read_text()
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
        assert stat.S_IMODE(provisioner.directory.stat().st_mode) == 0o700
        saved = json.loads(record.read_text())
        assert saved["pid"] == saved["pgid"] == pid
        assert saved["start_time"] == start_time(pid)
        assert saved["command"] == [sys.executable, "-c", STUB, "run"]

    async def test_own_process_group(self, make: Make, out: Path) -> None:
        """The child leads a new session and process group, apart from hubd's."""
        pid = await started(make(), out)
        assert os.getpgid(pid) == pid
        assert os.getsid(pid) == pid
        assert os.getpgid(pid) != os.getpgrp()

    async def test_workdir(self, make: Make, out: Path, tmp_path: Path) -> None:
        """The child runs in the configured working directory."""
        workdir = tmp_path / "work"
        workdir.mkdir()
        await make(workdir=str(workdir)).ensure(ensure_request())
        assert (await report(out))["cwd"] == str(workdir)

    async def test_hubd_beside_interpreter(
        self, make: Make, out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A bare "hubd" missing from PATH runs the hubd installed beside the interpreter."""
        bin_dir = tmp_path / "venv" / "bin"
        bin_dir.mkdir(parents=True)
        script = bin_dir / "hubd"
        script.write_text(
            f'#!/bin/sh\necho "$@" > "$OUT/args"\nexec {sys.executable} -c "$STUB" run\n'
        )
        script.chmod(0o700)
        monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
        provisioner = make(command=["hubd", "sidecar"], env={"PATH": "/nonexistent", "STUB": STUB})
        result = await provisioner.ensure(ensure_request())
        assert isinstance(result, Accepted)
        await report(out)
        assert (out / "args").read_text() == "sidecar\n"
        saved = json.loads(state_file(provisioner).read_text())
        assert saved["command"] == [str(script), "sidecar"]

    async def test_idempotent(self, make: Make, out: Path) -> None:
        """Ensuring one sidecar twice answers the same external_ref and runs one process."""
        provisioner = make()
        first = await provisioner.ensure(ensure_request())
        pid = (await report(out))["pid"]
        again = await provisioner.ensure(ensure_request())
        assert again == first
        assert living_with("HUBD_SIDECAR_ID=sc_1") == [pid]

    async def test_metadata(self, make: Make, out: Path) -> None:
        """The acceptance carries the process's pid, the host and the log file as metadata,
        and no endpoint (what the command serves is the command's own)."""
        provisioner = make()
        result = check_ensure_result(await provisioner.ensure(ensure_request()))
        pid = (await report(out))["pid"]
        assert isinstance(result, Accepted)
        assert result.endpoint is None
        assert result.metadata == {
            "pid": pid,
            "host": socket.gethostname(),
            "log": str(provisioner.directory / "sc_1.log"),
        }

    async def test_restarts_dead_sidecar(self, make: Make, out: Path) -> None:
        """Ensuring a sidecar whose process died starts a new one."""
        provisioner = make()
        pid = await started(provisioner, out)
        (out / "sc_1.json").unlink()
        os.kill(pid, signal.SIGKILL)
        await until_dead(pid)
        again = await provisioner.ensure(ensure_request())
        assert isinstance(again, Accepted)
        new_pid = (await report(out))["pid"]
        assert new_pid != pid
        assert again.external_ref is not None
        assert again.external_ref.startswith(f"local:{new_pid}:")

    async def test_command_not_found(self, make: Make) -> None:
        """A program that does not exist is a non-retryable rejection, with nothing recorded."""
        provisioner = make(command=["hubd-no-such-sidecar", "--flag"])
        result = await provisioner.ensure(ensure_request())
        assert result == Rejected(
            code="command_not_found",
            message="sidecar command 'hubd-no-such-sidecar' not found in PATH",
            retryable=False,
        )
        assert not state_file(provisioner).exists()

    async def test_command_not_executable(self, make: Make, tmp_path: Path) -> None:
        """A program that may not be executed is a non-retryable command_failed rejection."""
        program = tmp_path / "sidecar.sh"
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o600)
        result = await make(command=[str(program)]).ensure(ensure_request())
        assert isinstance(result, Rejected)
        assert (result.code, result.retryable) == ("command_failed", False)
        assert "permission denied" in result.message

    async def test_early_exit(self, make: Make) -> None:
        """A child that exits at once is a retryable rejection quoting its exit and last line."""
        provisioner = make("exit3", settle=30.0)
        request = ensure_request()
        result = await provisioner.ensure(request)
        assert isinstance(result, Rejected)
        assert (result.code, result.retryable) == ("sidecar_exited", True)
        assert result.message.startswith("sidecar command exited with code 3 within 30s")
        assert f"fatal: cannot reach {HUB_URL} with ***" in result.message
        assert request.token not in result.message
        assert not state_file(provisioner).exists()

    async def test_cancelled_ensure_leaves_a_whole_record(self, make: Make, out: Path) -> None:
        """An ensure cancelled after the start leaves a complete record that destroy acts on."""
        provisioner = make(settle=60.0)
        task = asyncio.create_task(provisioner.ensure(ensure_request()))
        pid = (await report(out))["pid"]
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert json.loads(state_file(provisioner).read_text())["pid"] == pid
        assert await provisioner.destroy(destroy_request()) == Destroyed()
        assert not alive(pid)


class TestOwnership:
    """A request whose claim no longer owns the allocation starts and signals nothing."""

    @staticmethod
    def lost() -> Ownership:
        return Ownership(
            still_owned=lambda: False,
            deadline=lambda: 0.0,
            deadline_utc=lambda: datetime.now(UTC),
        )

    async def test_ensure_not_owned_starts_nothing(self, make: Make, out: Path) -> None:
        """Ensure under a lost claim is a retryable rejection: no process, no record, no log."""
        provisioner = make()
        request = attrs.evolve(ensure_request(), ownership=self.lost())
        result = await provisioner.ensure(request)
        assert isinstance(result, Rejected)
        assert result.code == "claim_lost"
        assert result.retryable
        assert not state_file(provisioner).exists()
        assert not (provisioner.directory / "sc_1.log").exists()
        assert not (out / "sc_1.json").exists()  # the stub never ran

    async def test_ownership_lost_just_before_the_fork(self, make: Make, out: Path) -> None:
        """Ownership that ends after the first check, before the fork, still starts nothing
        and removes the log file the call had created."""
        provisioner = make()
        answers = iter([True, False])
        ownership = Ownership(
            still_owned=lambda: next(answers),
            deadline=lambda: 0.0,
            deadline_utc=lambda: datetime.now(UTC),
        )
        result = await provisioner.ensure(attrs.evolve(ensure_request(), ownership=ownership))
        assert isinstance(result, Rejected)
        assert result.code == "claim_lost"
        assert not (provisioner.directory / "sc_1.log").exists()
        assert not state_file(provisioner).exists()

    async def test_destroy_not_owned_signals_nothing(self, make: Make, out: Path) -> None:
        """Destroy under a lost claim leaves the process running and says so, retryably."""
        provisioner = make()
        pid = await started(provisioner, out)
        request = attrs.evolve(destroy_request(), ownership=self.lost())
        result = await provisioner.destroy(request)
        assert isinstance(result, DestroyRejected)
        assert result.code == "claim_lost"
        assert result.retryable
        assert alive(pid)
        assert await provisioner.destroy(destroy_request()) == Destroyed()


class TestDestroy:
    """Stopping sidecars: the whole group, escalating, after restarts, never someone else."""

    async def test_group_and_reap(self, make: Make, out: Path) -> None:
        """Destroy ends the child and a grandchild it spawned, reaps the child, drops its files."""
        provisioner = make("grandchild")
        await provisioner.ensure(ensure_request())
        seen = await report(out)
        pid, grandchild = seen["pid"], seen["grandchild"]
        assert alive(grandchild)
        assert await provisioner.destroy(destroy_request()) == Destroyed()
        assert proc_stat(pid) is None  # reaped, not a zombie
        assert not alive(grandchild)
        assert not state_file(provisioner).exists()
        assert not (provisioner.directory / "sc_1.log").exists()

    async def test_sigkill_after_grace(self, make: Make, out: Path) -> None:
        """A child that ignores SIGTERM is killed with SIGKILL once the grace period is over."""
        provisioner = make("ignore-term", grace="300ms")
        pid = await started(provisioner, out)
        began = time.monotonic()
        assert await provisioner.destroy(destroy_request()) == Destroyed()
        assert time.monotonic() - began >= 0.3
        assert proc_stat(pid) is None

    async def test_after_restart(self, make: Make, out: Path) -> None:
        """A new instance on the same state dir recognises and destroys what another started."""
        first = make()
        pid = await started(first, out)
        restarted = make()
        again = await restarted.ensure(ensure_request())
        assert isinstance(again, Accepted)
        assert again.external_ref == f"local:{pid}:{start_time(pid)}"
        assert await restarted.destroy(destroy_request()) == Destroyed()
        await until_dead(pid)
        assert not state_file(restarted).exists()

    async def test_already_dead(self, make: Make, out: Path) -> None:
        """Destroying a sidecar whose process is gone succeeds and clears its record."""
        provisioner = make()
        pid = await started(provisioner, out)
        os.kill(pid, signal.SIGKILL)
        await until_dead(pid)
        assert await provisioner.destroy(destroy_request()) == Destroyed()
        assert not state_file(provisioner).exists()

    async def test_never_started(self, make: Make) -> None:
        """Destroying a sidecar this provisioner knows nothing of succeeds."""
        assert await make().destroy(destroy_request("sc_unknown")) == Destroyed()

    async def test_by_external_ref(self, make: Make, out: Path) -> None:
        """With its record lost, a sidecar is still found by external_ref and destroyed."""
        provisioner = make()
        result = await provisioner.ensure(ensure_request())
        assert isinstance(result, Accepted)
        pid = (await report(out))["pid"]
        state_file(provisioner).unlink()
        destroyed = await provisioner.destroy(destroy_request(external_ref=result.external_ref))
        assert destroyed == Destroyed()
        assert not alive(pid)

    async def test_corrupt_record(self, make: Make) -> None:
        """An unreadable record with no external_ref to fall back on needs an operator."""
        provisioner = make()
        provisioner.directory.mkdir(parents=True)
        state_file(provisioner).write_text('{"pid": ')
        result = await provisioner.destroy(destroy_request())
        assert isinstance(result, DestroyRejected)
        assert (result.code, result.retryable) == ("state_corrupt", False)

    async def test_escalation_survives_cancellation(self, make: Make, out: Path) -> None:
        """A destroy cancelled during the grace period is resumed by the next one, which
        kills at once when the recorded deadline has passed, whatever its own grace."""
        impatient = make("ignore-term", grace="200ms")
        pid = await started(impatient, out)
        task = asyncio.create_task(impatient.destroy(destroy_request()))

        async def terminating() -> bool:
            saved: dict[str, Any] = json.loads(state_file(impatient).read_text())
            return saved.get("kill_at") is not None

        await poll_until(terminating)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert alive(pid)
        kill_at: float = json.loads(state_file(impatient).read_text())["kill_at"]

        async def overdue() -> bool:
            return time.time() > kill_at

        await poll_until(overdue)
        patient = make("ignore-term", grace="60s")
        async with asyncio.timeout(5):
            assert await patient.destroy(destroy_request()) == Destroyed()
        await until_dead(pid)


class TestIdentity:
    """A pid that now belongs to another process is never signalled."""

    @pytest.fixture
    async def stranger(self, mark: str) -> AsyncIterator[int]:
        """A process, in a group of its own, that no sidecar owns."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
            env={**os.environ, MARK: mark},
            start_new_session=True,
        )
        try:
            yield process.pid
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    def forge(self, provisioner: LocalProvisioner, pid: int, started_at: int) -> None:
        provisioner.directory.mkdir(parents=True, exist_ok=True)
        record = {"sidecar_id": "sc_1", "pid": pid, "pgid": pid, "start_time": started_at}
        state_file(provisioner).write_text(json.dumps(record))

    async def test_reused_pid_in_record(self, make: Make, stranger: int) -> None:
        """A record whose start time differs from the live process's is gone, not killed."""
        provisioner = make()
        started_at = start_time(stranger)
        self.forge(provisioner, stranger, started_at - 1)
        assert await provisioner.destroy(destroy_request()) == Destroyed()
        assert alive(stranger)
        assert not state_file(provisioner).exists()

    async def test_reused_pid_in_external_ref(self, make: Make, stranger: int) -> None:
        """An external_ref whose start time differs from the live process's is not killed."""
        started_at = start_time(stranger)
        ref = f"local:{stranger}:{started_at + 1}"
        assert await make().destroy(destroy_request(external_ref=ref)) == Destroyed()
        assert alive(stranger)

    async def test_external_ref_of_another_process(self, make: Make, stranger: int) -> None:
        """An external_ref matching pid and start time of a process that does not carry the
        sidecar's id in its environment is not killed."""
        started_at = start_time(stranger)
        ref = f"local:{stranger}:{started_at}"
        assert await make().destroy(destroy_request(external_ref=ref)) == Destroyed()
        assert alive(stranger)

    async def test_ensure_over_reused_pid(self, make: Make, out: Path, stranger: int) -> None:
        """Ensure over a stale record starts a new sidecar and leaves the pid's new owner be."""
        provisioner = make()
        self.forge(provisioner, stranger, start_time(stranger) + 1)
        pid = await started(provisioner, out)
        assert pid != stranger
        assert alive(stranger)
        assert await provisioner.destroy(destroy_request()) == Destroyed()


class TestOptions:
    """Parsing and validating the ``[provisioners.options]`` table."""

    def test_defaults(self) -> None:
        """With no options, the sidecar is `hubd sidecar` with a 5 s grace period."""
        assert parse_options({}) == LocalOptions(command=DEFAULT_COMMAND, grace=5.0)

    @pytest.mark.parametrize(("grace", "seconds"), [(2, 2.0), (0.5, 0.5), ("1m30s", 90.0)])
    def test_grace(self, grace: object, seconds: float) -> None:
        """grace takes a number of seconds or a duration string."""
        assert parse_options({"grace": grace}).grace == seconds

    @pytest.mark.parametrize(
        ("options", "fragment"),
        [
            ({"command": []}, "'command': must be a non-empty list"),
            ({"command": "hubd sidecar"}, "'command': must be a non-empty list"),
            ({"command": ["", "x"]}, "'command': the program"),
            ({"command": ["hubd", 3]}, "'command': every argument must be a string, not int"),
            ({"env": ["A=1"]}, "'env': must be a table of strings"),
            ({"env": {"A": 1}}, "'env': the value of A must be a string"),
            ({"env": {"1A": "x"}}, "'env': '1A' is not a valid environment variable name"),
            ({"env": {"HUBD_TOKEN": "x"}}, "'env': HUBD_TOKEN is set by hubd"),
            ({"grace": "soon"}, "'grace': invalid duration 'soon'"),
            ({"grace": 0}, "'grace': must be positive"),
            ({"grace": True}, "'grace': must be a duration"),
            ({"workdir": "/nonexistent/hubd"}, "'workdir': '/nonexistent/hubd' is not a directory"),
            ({"comand": ["x"]}, "'comand': unknown option; did you mean 'command'?"),
        ],
    )
    def test_invalid(self, options: dict[str, Any], fragment: str) -> None:
        """Each bad option is a PluginLoadError naming the option."""
        with pytest.raises(PluginLoadError) as caught:
            parse_options(options)
        assert str(caught.value).startswith("local provisioner option ")
        assert fragment in str(caught.value)

    def test_fingerprint(self, tmp_path: Path) -> None:
        """The binding fingerprint names the plugin only: changing the command, env, workdir
        or grace is a rolling upgrade, not a new place. The former fingerprint (what earlier
        releases computed) follows command, env and workdir, so rows bound under it stay
        servable by the same options."""
        base = parse_options({"command": ["a"]})
        assert len(base.binding_fingerprint) == 64
        for changed in (
            {"command": ["b"]},
            {"command": ["a"], "grace": 9},
            {"command": ["a"], "env": {"X": "1"}},
            {"command": ["a"], "workdir": str(tmp_path)},
        ):
            assert parse_options(changed).binding_fingerprint == base.binding_fingerprint
        # Pinned: the digest hubd computed before the fingerprint was narrowed.
        assert base.former_binding_fingerprints == (
            "68dc3bcd9633764f4d816a2dde1ad9d9ed9f1943c790901fee40f67d5f6bd968",
        )
        assert parse_options({"command": ["a"], "env": {}}).former_binding_fingerprints == (
            base.former_binding_fingerprints
        )
        others = {
            parse_options({"command": ["b"]}).former_binding_fingerprints,
            parse_options({"command": ["a"], "env": {"X": "1"}}).former_binding_fingerprints,
            parse_options({"command": ["a"], "workdir": str(tmp_path)}).former_binding_fingerprints,
        }
        assert base.former_binding_fingerprints not in others
        assert len(others) == 3


@contextlib.contextmanager
def descriptors_exhausted() -> Iterator[None]:
    """The process really out of descriptors: the soft limit lowered to just above what is
    open, and the rest taken, until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    taken: list[int] = []
    try:
        # The loop is what fills the table.
        with pytest.raises(OSError, match="Too many open files") as full:  # noqa: PT012
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        assert full.value.errno == errno.EMFILE
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class TestResourceExhaustion:
    async def test_emfile_is_retryable(self, make: Make, out: Path) -> None:
        """Out of descriptors, ensure and destroy are refused as retryable (never a verdict
        such as state_corrupt), and the sidecar is destroyed once descriptors are back."""
        provisioner = make()
        assert isinstance(await provisioner.ensure(ensure_request()), Accepted)
        pid = (await report(out))["pid"]
        with descriptors_exhausted():
            destroyed = await provisioner.destroy(destroy_request())
            ensured = await provisioner.ensure(ensure_request("sc_2"))
        assert isinstance(destroyed, DestroyRejected)
        assert (destroyed.code, destroyed.retryable) == ("resources_exhausted", True)
        assert "EMFILE" in destroyed.message
        assert isinstance(ensured, Rejected)
        assert ensured.retryable
        assert alive(pid)
        assert isinstance(await provisioner.destroy(destroy_request()), Destroyed)
        await until_dead(pid)
