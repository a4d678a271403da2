"""hubd as a systemd service, under a real systemd: what an operator does to it, it survives.

The session boots systemd as PID 1 in a privileged Podman container made of the host's own
``/usr`` (read-only), a copy of its ``/etc`` and an empty ``/var``, with no network but
loopback. The checkout is ``/opt/hubd``; its ``.venv`` is a venv of the host's
``/usr/bin/python3`` that finds the test environment's installed packages (the container cannot
reach a package index). ``deploy/hubd.service``, ``deploy/hubd.env.example`` and
``config/hubd.toml`` are installed as README's "Running it as a service" says, and the CLI is
run through ``deploy/hubctl``, on the default embedded database. Needs root and ``podman``;
skipped with the reason otherwise (``.ci/install-podman`` installs it in CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import attrs
import pytest

from hubd.redaction import scrub

_REPO = Path(__file__).resolve().parents[1]
_CONTAINERS_CONF = """\
[containers]
# The VM's hard limits are below Podman's defaults, which the runtime would fail to set.
default_ulimits = ["nofile=1024:20000", "nproc=4096:4096"]
[engine]
# crun refuses the hybrid cgroup layout of these machines.
runtime = "runc"
"""
_HUBD_SCRIPT = (
    "#!/opt/hubd/.venv/bin/python\nimport sys\nfrom hubd.cli import main\nsys.exit(main())\n"
)
# README's install steps, but the venv (mounted) and hubctl's place (/usr is read-only here).
_INSTALL = """\
set -e
install -d -m 0755 /etc/hubd && install -m 0644 /opt/hubd/config/hubd.toml /etc/hubd/hubd.toml
install -m 0600 /opt/hubd/deploy/hubd.env.example /etc/hubd/hubd.env
install -m 0644 /opt/hubd/deploy/hubd.service /etc/systemd/system/hubd.service
install -d /etc/systemd/system/hubd.service.d
printf '[Service]\\nWatchdogSec=3\\n' > /etc/systemd/system/hubd.service.d/watchdog.conf
systemctl daemon-reload && systemctl enable --now hubd
"""
_HUBCTL = "/opt/hubd/deploy/hubctl"
_PG = "/usr/lib/postgresql/15/bin"
_EXTERNAL_PASSWORD = "pw-canary-7f3a"
_EXTERNAL_URL = f"postgresql://hubd:{_EXTERNAL_PASSWORD}@127.0.0.1:5433/hubd"
# An external server for the service: the host's Debian PostgreSQL, as a unit of its own.
_EXTERNAL_SERVER = f"""\
set -e
install -d -o postgres -g postgres -m 0700 /var/lib/pgext
runuser -u postgres -- {_PG}/initdb -D /var/lib/pgext -A trust -U postgres >/dev/null
systemd-run --unit=pgext -p User=postgres {_PG}/postgres -D /var/lib/pgext -k '' \\
    -c listen_addresses=127.0.0.1 -p 5433
until {_PG}/pg_isready -q -h 127.0.0.1 -p 5433; do sleep 0.1; done
{_PG}/psql -q -h 127.0.0.1 -p 5433 -U postgres -c "CREATE ROLE hubd LOGIN PASSWORD 'x'"
{_PG}/psql -q -h 127.0.0.1 -p 5433 -U postgres -c "CREATE DATABASE hubd OWNER hubd"
"""


def _skip_reason() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux to boot systemd in a privileged container"
    if shutil.which("podman") is None:
        return "needs podman (.ci/install-podman installs it)"
    if not Path("/usr/lib/systemd/systemd").exists():
        return "needs systemd in the host's /usr"
    host = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    )
    if host.stdout.strip() != str(sys.version_info[:2]):
        return "the host's /usr/bin/python3 is not the tests' Python version"
    return None


_SKIP = _skip_reason()


@attrs.frozen
class Host:
    """The container: commands run in it as root."""

    name: str
    env: dict[str, str]

    def run(
        self, *command: str, check: bool = True, timeout: float = 90
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["podman", "exec", self.name, *command],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{command} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def show(self, prop: str) -> str:
        return self.run("systemctl", "show", "-p", prop, "--value", "hubd").stdout.strip()

    def hubctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(_HUBCTL, *args, check=check)

    def allocation(self, allocation_id: str) -> dict[str, object]:
        shown = json.loads(self.hubctl("alloc", "show", allocation_id, "--json").stdout)
        assert isinstance(shown, dict)
        return shown


def _poll(check: Callable[[], bool], *, within: float = 60.0, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _rootfs(root: Path) -> None:
    for name in ("var/lib", "var/tmp", "var/log", "run", "tmp", "root", "opt/hubd", "opt/deps"):
        (root / name).mkdir(parents=True)
    for name in ("proc", "sys", "dev", "home", "usr"):
        (root / name).mkdir()
    for name in ("bin", "sbin", "lib", "lib64"):
        (root / name).symlink_to(f"usr/{name}")
    shutil.copytree("/etc", root / "etc", symlinks=True, ignore_dangling_symlinks=True)
    (root / "etc" / "machine-id").write_text("")
    # The host's own services stay off: only what the tests install runs.
    for wanted in (root / "etc/systemd/system").glob("*.wants/*"):
        if wanted.name != "hubd.service":
            wanted.unlink()


def _venv(venv: Path) -> None:
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    # The checkout first (the package as the tree has it), then the test venv's packages.
    (site / "hubd-src.pth").write_text("/opt/hubd\n")
    (site / "hubd-deps.pth").write_text("/opt/deps\n")
    script = venv / "bin" / "hubd"
    script.write_text(_HUBD_SCRIPT)
    script.chmod(0o755)


@pytest.fixture(scope="session")
def systemd_host() -> Iterator[Host]:
    with tempfile.TemporaryDirectory(prefix="hubd-sd") as tmp:
        work = Path(tmp)
        conf = work / "containers.conf"
        conf.write_text(_CONTAINERS_CONF)
        env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        _rootfs(work / "rootfs")
        _venv(work / "venv")
        host = Host(name=f"hubd-systemd-{os.getpid()}", env=env)
        deps = sysconfig.get_paths()["purelib"]
        subprocess.run(
            ["podman", "run", "-d", "--name", host.name, "--systemd=always", "--privileged",
             "--network=none",
             "-v", "/usr:/usr:ro", "-v", f"{_REPO}:/opt/hubd:ro",
             "-v", f"{work / 'venv'}:/opt/hubd/.venv:ro", "-v", f"{deps}:/opt/deps:ro",
             "--rootfs", str(work / "rootfs"), "/usr/lib/systemd/systemd"],
            env=env, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        try:
            _poll(
                lambda: (
                    host.run("systemctl", "is-system-running", check=False).stdout.strip()
                    in ("running", "degraded")
                ),
                what="systemd to boot",
            )
            host.run("sh", "-c", _INSTALL)
            yield host
        finally:
            subprocess.run(
                ["podman", "rm", "-f", "-t", "0", host.name],
                env=env, capture_output=True, check=False, timeout=60,
            )  # fmt: skip


@pytest.fixture(scope="session")
def allocation(systemd_host: Host) -> str:
    """A ready allocation of the local provisioner, requested through hubctl."""
    done = systemd_host.hubctl("alloc", "request", "--provisioner", "local", "--wait", "--json")
    allocation_id = json.loads(done.stdout)["id"]
    assert isinstance(allocation_id, str)
    return allocation_id


def _running(host: Host) -> None:
    host.run("systemctl", "start", "hubd")
    assert host.show("ActiveState") == "active"


def _ready_at(host: Host, allocation_id: str, generation: object) -> Callable[[], bool]:
    def check() -> bool:
        done = host.hubctl("alloc", "show", allocation_id, "--json", check=False)
        if done.returncode != 0:
            return False
        shown = json.loads(done.stdout)
        return bool(shown.get("ready")) and shown.get("generation") == generation

    return check


_EMIT = """
import structlog
from hubd.cli import _say_error
from hubd.logs import configure_logging
configure_logging()
log = structlog.get_logger("t")
log.info("routine")
log.warning("odd")
log.error("broken")
_say_error("hubd: failed\\nsecond line")
"""


class TestJournalStream:
    def _emit(self, tmp_path: Path, *, journal: bool) -> list[str]:
        err = tmp_path / "err"
        with err.open("w") as stream:
            status = os.fstat(stream.fileno())
            env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
            if journal:
                env["JOURNAL_STREAM"] = f"{status.st_dev}:{status.st_ino}"
            subprocess.run(
                [sys.executable, "-c", _EMIT], stderr=stream, env=env, check=True, timeout=60
            )
        return err.read_text().splitlines()

    def test_lines_carry_their_priority_on_the_journal(self, tmp_path: Path) -> None:
        """With standard error on the journal, every line starts with its syslog priority
        (info 6, warning 4, error 3), the CLI's own error message included."""
        lines = self._emit(tmp_path, journal=True)
        assert [line[:3] for line in lines] == ["<6>", "<4>", "<3>", "<3>", "<3>"]
        assert json.loads(lines[2][3:])["event"] == "broken"

    def test_no_prefix_elsewhere(self, tmp_path: Path) -> None:
        """Without JOURNAL_STREAM (a terminal, a pipe, a file), lines are plain JSON."""
        lines = self._emit(tmp_path, journal=False)
        assert json.loads(lines[0])["event"] == "routine"
        assert lines[-1] == "second line"


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
class TestService:
    def test_start_is_ready_and_the_watchdog_is_fed(self, systemd_host: Host) -> None:
        """The unit starts (READY=1 ends the start job) and stays up past twice its watchdog
        period, its watchdog fed, no restart."""
        _running(systemd_host)
        pid = systemd_host.show("MainPID")
        pings: set[str] = set()

        def fed_three_times() -> bool:
            # The time of the last WATCHDOG=1: three distinct ones span two periods (3 s each).
            pings.add(systemd_host.show("WatchdogTimestampMonotonic"))
            return len(pings - {"0"}) > 3

        _poll(fed_three_times, what="three watchdog pings")
        assert systemd_host.show("MainPID") == pid
        assert systemd_host.show("NRestarts") == "0"

    def test_restart_keeps_the_allocation(self, systemd_host: Host, allocation: str) -> None:
        """``systemctl restart``: the allocation reads ready again at the same generation."""
        _running(systemd_host)
        generation = systemd_host.allocation(allocation)["generation"]
        systemd_host.run("systemctl", "restart", "hubd")
        _poll(_ready_at(systemd_host, allocation, generation), what="ready after the restart")

    def test_sigkill_recovers_by_itself(self, systemd_host: Host, allocation: str) -> None:
        """kill -9 of the main process: ExecStopPost stops the orphaned embedded server, the
        unit restarts on its own, and the allocation is ready again at the same generation."""
        _running(systemd_host)
        generation = systemd_host.allocation(allocation)["generation"]
        pid = systemd_host.show("MainPID")
        restarts = int(systemd_host.show("NRestarts"))
        systemd_host.run("kill", "-9", pid)
        _poll(
            lambda: (
                systemd_host.show("ActiveState") == "active"
                and systemd_host.show("MainPID") not in ("0", pid)
            ),
            what="the unit to come back",
        )
        assert int(systemd_host.show("NRestarts")) == restarts + 1
        _poll(_ready_at(systemd_host, allocation, generation), what="ready after the kill")
        journal = systemd_host.run("journalctl", "-u", "hubd", "-o", "cat").stdout
        assert "embedded_postgresql_outlived_its_users_stopping_it" in journal
        assert "postmaster.pid" not in journal

    def test_root_cli_changes_nothing(self, systemd_host: Host, allocation: str) -> None:
        """README's plain CLI run as root is refused naming hubctl, and leaves every owner and
        mode as it was; the service stays healthy."""
        _running(systemd_host)
        paths = ["/var/lib/private", "/var/lib/private/hubd", "/var/lib/private/hubd/pgdata"]
        before = systemd_host.run("stat", "-c", "%a %u %g %n", *paths).stdout
        done = systemd_host.run(
            "sh", "-c",
            "set -a && . /etc/hubd/hubd.env && set +a && "
            "/opt/hubd/.venv/bin/hubd alloc list --config /etc/hubd/hubd.toml",
            check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "hubctl alloc list" in done.stderr
        assert systemd_host.run("stat", "-c", "%a %u %g %n", *paths).stdout == before
        assert allocation in systemd_host.hubctl("alloc", "list").stdout
        systemd_host.run("systemctl", "restart", "hubd")
        assert systemd_host.show("ActiveState") == "active"

    def test_upgrade_procedure(self, systemd_host: Host, allocation: str) -> None:
        """README's upgrade (stop, ``hubctl migrate``, start) keeps the service and its data."""
        _running(systemd_host)
        generation = systemd_host.allocation(allocation)["generation"]
        systemd_host.run("systemctl", "stop", "hubd")
        migrated = systemd_host.hubctl("migrate")
        assert "schema is up to date" in migrated.stdout
        systemd_host.run("systemctl", "start", "hubd")
        _poll(_ready_at(systemd_host, allocation, generation), what="ready after the upgrade")

    def test_a_stop_longer_than_connect_timeout_keeps_the_sidecar(
        self, systemd_host: Host, allocation: str
    ) -> None:
        """``systemctl stop`` for longer than ``connect_timeout`` (3 s here, by a drop-in) is not
        a failure: the next start takes the same sidecar process back at the same generation,
        with no connect failure in its history."""
        dropin = "/etc/systemd/system/hubd.service.d/connect-timeout.conf"
        systemd_host.run(
            "sh", "-c",
            f"printf '[Service]\\nEnvironment=HUBD_RECONCILER_CONNECT_TIMEOUT=3s\\n' > {dropin}"
            " && systemctl daemon-reload",
        )  # fmt: skip
        try:
            systemd_host.run("systemctl", "restart", "hubd")
            assert "HUBD_RECONCILER_CONNECT_TIMEOUT=3s" in systemd_host.show("Environment")
            generation = systemd_host.allocation(allocation)["generation"]
            _poll(_ready_at(systemd_host, allocation, generation), what="ready before the stop")
            sidecars = systemd_host.run("pgrep", "-f", "hubd sidecar").stdout.split()
            systemd_host.run("systemctl", "stop", "hubd")
            stopped = datetime.now(UTC)

            def outlasted() -> bool:
                # The scenario is the passage of time: the stop lasts past connect_timeout, and
                # past the deadline the stop wrote when it wrote one.
                deadline = systemd_host.allocation(allocation)["connect_deadline"]
                now = datetime.now(UTC)
                if isinstance(deadline, str) and datetime.fromisoformat(deadline) >= now:
                    return False
                return (now - stopped).total_seconds() > 5

            _poll(outlasted, within=120, what="the stop to outlast connect_timeout")
            systemd_host.run("systemctl", "start", "hubd")
            try:
                # The restart window (60 s) covers the sidecar's backoff (30 s at most).
                _poll(
                    _ready_at(systemd_host, allocation, generation),
                    within=120,
                    what="ready after the stop",
                )
            except AssertionError as exc:
                # What the row and the daemon said, for a failure on a machine nobody can see.
                shown = systemd_host.hubctl("alloc", "show", allocation, "--json").stdout
                said = systemd_host.run("journalctl", "-u", "hubd", "-o", "cat", "-n", "40").stdout
                raise AssertionError(f"{exc}\n{scrub(shown)}\n{scrub(said)}") from None
            assert systemd_host.run("pgrep", "-f", "hubd sidecar").stdout.split() == sidecars
            history = systemd_host.allocation(allocation).get("history") or []
            assert not [h for h in history if "deadline" in str(h)], history
        finally:
            systemd_host.run("sh", "-c", f"rm -f {dropin} && systemctl daemon-reload")
            systemd_host.run("systemctl", "restart", "hubd")

    def test_journal_priorities_and_no_secrets(self, systemd_host: Host, allocation: str) -> None:
        """Warnings reach the journal as warnings (``-p warning`` has no routine lines), and
        nothing token-shaped is in it."""
        _running(systemd_host)
        assert allocation
        warnings = systemd_host.run("journalctl", "-u", "hubd", "-p", "warning", "-o", "cat").stdout
        assert "embedded_postgresql_outlived_its_users_stopping_it" in warnings
        assert '"level": "info"' not in warnings
        journal = systemd_host.run("journalctl", "-u", "hubd", "-o", "cat").stdout
        assert '"level": "info"' in journal
        assert [line for line in journal.splitlines() if scrub(line) != line] == []

    def test_security_exposure(self, systemd_host: Host) -> None:
        """``systemd-analyze security`` rates the unit's exposure at most 2.0."""
        done = systemd_host.run("systemd-analyze", "security", "hubd", "--no-pager")
        found = re.search(r"Overall exposure level for hubd\.service: ([0-9.]+)", done.stdout)
        assert found is not None, done.stdout
        assert float(found.group(1)) <= 2.0

    def test_stop_is_clean(self, systemd_host: Host, allocation: str) -> None:
        """``systemctl stop`` ends the daemon and the embedded server with it, cleanly, and
        leaves the sidecars running; ``systemctl kill`` then ends them too."""
        _running(systemd_host)
        assert allocation
        systemd_host.run("systemctl", "stop", "hubd")
        assert systemd_host.show("ActiveState") == "inactive"
        assert systemd_host.show("Result") == "success"
        assert systemd_host.run("pgrep", "-x", "postgres", check=False).stdout.strip() == ""
        assert systemd_host.run("pgrep", "-f", "hubd sidecar", check=False).stdout.strip()
        systemd_host.run("systemctl", "kill", "hubd")
        _poll(
            lambda: systemd_host.run("pgrep", "-f", "hubd sidecar", check=False).returncode == 1,
            what="the sidecars to exit",
        )

    @pytest.mark.skipif(not Path(_PG).exists(), reason=f"needs PostgreSQL in {_PG}")
    def test_external_database(self, systemd_host: Host) -> None:
        """On an external database (its URL in the env file): the upgrade's migrate, a request
        made ready, kill -9 back by itself with the allocation kept, the password in no journal
        line; then back to the embedded default."""
        systemd_host.run("sh", "-c", _EXTERNAL_SERVER)
        systemd_host.run("systemctl", "stop", "hubd")
        env_file = "/etc/hubd/hubd.env"
        systemd_host.run("sh", "-c", f"echo HUBD_DATABASE_URL={_EXTERNAL_URL} >> {env_file}")
        try:
            assert "applied" in systemd_host.hubctl("migrate").stdout
            _running(systemd_host)
            done = systemd_host.hubctl(
                "alloc", "request", "--provisioner", "local", "--wait", "--json"
            )
            allocation_id = json.loads(done.stdout)["id"]
            generation = systemd_host.allocation(allocation_id)["generation"]
            pid = systemd_host.show("MainPID")
            systemd_host.run("kill", "-9", pid)
            _poll(
                lambda: (
                    systemd_host.show("ActiveState") == "active"
                    and systemd_host.show("MainPID") not in ("0", pid)
                ),
                what="the unit to come back",
            )
            _poll(_ready_at(systemd_host, allocation_id, generation), what="ready after the kill")
            journal = systemd_host.run("journalctl", "-u", "hubd", "-o", "cat").stdout
            assert _EXTERNAL_PASSWORD not in journal
        finally:
            systemd_host.run("sed", "-i", "/^HUBD_DATABASE_URL=/d", env_file)
            systemd_host.run("systemctl", "restart", "hubd")
