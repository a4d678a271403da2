"""The benchmark suite at its smallest size: every measure runs and lands in the JSON as a number.

Behaviour only: the numbers of a run this small mean nothing and are never compared with
anything; ``python -m bench`` at a real size is how throughput is measured.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from bench import deadlines, fairness, http, phases, pools, procs, scale, takes, waits
from bench.farm import SOURCES as A_SOURCES
from bench.report import profile_summary, render, round_ratios, storm_ratios
from hubd.claimrules import DEFAULT_CLAIMS
from hubd.config import load_config
from hubd.server.slots import prefix_of
from hubd.store import AllocationStore, Database
from hubd.store.queries import load_queries
from tests.clikit import hubd_env
from tests.conftest import PostgresServer
from tests.polling import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY_MEASURE = {
    "ready_rate_16",
    "lifecycle_rate_16",
    "ready_rate_one_source",
    "ready_rate_one_source_256",
    "lifecycle_rate_default",
    "lifecycle_vs_pgqueuer",
    "lifecycle_vs_pgqueuer_16",
    "ready_rate_64",
    "lifecycle_rate_64",
    "ready_rate_256",
    "lifecycle_rate_256",
    "commits_per_lifecycle_16",
    "commits_per_lifecycle_64",
    "commits_per_lifecycle_256",
    "wal_per_lifecycle_16",
    "wal_per_lifecycle_64",
    "wal_per_lifecycle_256",
    "idle_commits_16",
    "idle_commits_64",
    "idle_commits_256",
    "connect_ready_p50",
    "connect_ready_p99",
    "dial_ready_p50",
    "dial_ready_p99",
    "fairness_alone_p50",
    "fairness_alone_p99",
    "fairness_fair_p50",
    "fairness_fair_p99",
    "fairness_fifo_p99",
    "fairness_burst_rate",
    "deadline_expired_p50",
    "deadline_expired_p99",
    "deadline_expired_max",
    "deadline_idle_p99",
    "deadline_twice",
    "deadline_never",
    *(key for key, *_ in http.measures(None)),
    *(key for key, *_ in pools.measures(None)),
    "claim_cost",
    "renewal_cost",
    "status_count_cost",
    "status_estimate_cost",
    "repair_cost",
    "stale_sweep_cost",
    "socket_check_cost",
    "heartbeat_cost",
    "dead_instances_cost",
    "rss_per_socket_30",
    "reconnect_storm_30",
    "loss_rate_30",
    "storm_cpu_daemon_30",
    "storm_cpu_farm_30",
    "storm_cpu_postgres_30",
    "storm_cpu_bench_30",
}
WITH_BASELINE = EVERY_MEASURE - {
    "wal_per_lifecycle_16",
    "wal_per_lifecycle_64",
    "wal_per_lifecycle_256",
    "idle_commits_16",
    "idle_commits_64",
    "idle_commits_256",
    "connect_ready_p50",
    "connect_ready_p99",
    "dial_ready_p50",
    "dial_ready_p99",
    "fairness_alone_p50",
    "fairness_alone_p99",
    "deadline_expired_p50",
    "deadline_expired_p99",
    "deadline_expired_max",
    "deadline_idle_p99",
    "deadline_twice",
    "deadline_never",
    *(key for key, *_ in http.measures(None) if "_sse" in key or "_idle" in key),
    *(key for key, *_ in pools.measures(None)),
    "loss_rate_30",
    "storm_cpu_postgres_30",
    "storm_cpu_bench_30",
}


async def _tiny_run(
    postgres_server: PostgresServer, output: Path, *args: str, stdout: int
) -> asyncio.subprocess.Process:
    """``python -m bench`` at its smallest size on the tests' PostgreSQL, stderr piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench",
        "--size",
        "tiny",
        *args,
        "--database-url",
        postgres_server.maintenance_dsn,
        "--json",
        str(output),
        env=hubd_env(),
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_the_smallest_run_reports_every_measure_with_numbers(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """A tiny run of two rounds on the tests' PostgreSQL exits 0, prints the table, and writes
    JSON in which every measure has a numeric hubd value (and baseline where it has one), every
    part ran without error, the lifecycles of every round finished every allocation, and the
    rates reported are the medians of the rounds'."""
    output = tmp_path / "bench.json"
    process = await _tiny_run(
        postgres_server, output, "--rounds", "2", stdout=asyncio.subprocess.PIPE
    )
    stdout, stderr = await process.communicate()
    text = stdout.decode()
    assert process.returncode == 0, text + stderr.decode()[-4000:]
    assert "measure" in text
    assert "ratio" in text
    assert "the same ratios within each round" in text

    report = json.loads(output.read_text())
    errors = {name: r["error"] for name, r in report["results"].items() if "error" in r}
    assert errors == {}
    measures = report["measures"]
    assert set(measures) == EVERY_MEASURE
    for key, row in measures.items():
        assert isinstance(row["hubd"], float), key
        if key in WITH_BASELINE and not (
            key.startswith("lifecycle_vs_pgqueuer") and "skipped" in report["results"]["pgqueuer"]
        ):
            assert isinstance(row["baseline"], float), key
            assert isinstance(row["ratio"], float), key
    for claims in (16, 64, 256):
        result = report["results"][f"claims_{claims}"]
        cycle = result["lifecycle"]
        assert cycle["complete"], cycle
        assert cycle["ready"] == cycle["released"] == report["parameters"]["lifecycle"]
        rates = [each["lifecycle_rate"] for each in result["rounds"]]
        assert len(rates) == 2
        assert cycle["lifecycle_rate"] == statistics.median(rates)
        assert set(cycle["cpu_ms"]["ready"]) == {"daemon", "postgres", "farm", "bench"}
        # Every allocation's rows, ledger rows and records were written in the window.
        assert cycle["wal_bytes_per_lifecycle"] > 1000
        assert [step["step"] for step in cycle["ledger_steps"]][:2] == [
            "request:committed",
            "bind_sidecar:committed",
        ]
    # The burst again with every sidecar from one address, each round beside the spread one, at
    # the fewest and the most claims.
    for claims in (16, 256):
        one_source = report["results"][f"claims_{claims}"]["one_source"]
        assert one_source["complete"], one_source
        rounds = report["results"][f"claims_{claims}"]["rounds"]
        assert all(r["one_source_ready_rate"] > 0 for r in rounds)
    # Fair claiming: every request of tenant B in each scenario measured, and A's whole burst.
    fair = report["results"]["fairness"]
    for scenario in fairness.SCENARIOS:
        assert fair[scenario]["b_n"] == fair["load"]["requests"] * fair["load"]["rounds"]
        # Every sidecar of B's was dialled by its farm and admitted by a statement on record.
        assert fair[scenario]["b_parts_n"] == fair[scenario]["b_n"]
        assert list(fair[scenario]["b_parts_ms"]) == list(fairness.PARTS)
    for scenario in ("fair", "fifo"):
        assert fair[scenario]["a_n"] == fair["load"]["burst"] * fair["load"]["rounds"]
    # Deadlines: both rounds, every lifetime and idle timeout ended once, none missed.
    ends = report["results"]["deadlines"]
    assert list(ends["rounds"]) == list(deadlines.ROUNDS)
    for kind, share in (("expired", 1), ("idle", 4)):
        assert ends[kind]["n"] == ends["load"]["n"] // share * len(deadlines.ROUNDS)
        assert (ends[kind]["twice"], ends[kind]["never"]) == (0, 0)
    for each in ends["rounds"].values():
        assert sum(each["moved_by"].values()) == ends["load"]["n"] + ends["load"]["n"] // 4
    # The HTTP API: every sample each way, every stream event delivered, every idle stream
    # open and heartbeating at the end.
    api = report["results"]["http"]
    for way in ("http", "sql"):
        assert api["latency"][way]["ready"]["n"] == api["load"]["samples"]
        assert len(api["burst"][way]["rounds"]) == api["load"]["bursts"]
    for part in ("sse", "sse_beside_idle"):
        assert api[part]["events"] > 0
        assert api[part]["missed"] == 0
    assert api["idle"]["with_heartbeat"] == api["idle"]["n"]
    assert api["idle"]["lost"] == 0
    floor = report["results"]["floor"]
    assert floor["rate"] == statistics.median(each["rate"] for each in floor["rounds"])
    assert len(floor["rounds"]) == 2
    # The farm reports the loop it runs on: uvloop unless --farm-loop says otherwise.
    assert report["farm_loop"] == "uvloop"
    assert "sidecar farm on uvloop" in text
    machine = report["machine"]
    assert machine["nproc"] >= 1
    assert len(machine["load_average"]) == 3


def test_round_ratios_pair_each_round_with_its_own_baseline() -> None:
    """Each ratio is a round's hubd rate over the same round's baseline, in round order; a row
    whose baseline has no rounds (PgQueuer skipped) or another number of them is left out."""
    results = {
        "floor": {"rate": 600.0, "rounds": [{"rate": 600.0}, {"rate": 300.0}]},
        "pgqueuer": {"skipped": "not installed"},
        "claims_16": {
            "rounds": [
                {"lifecycle_rate": 200.0, "ready_rate": 400.0},
                {"lifecycle_rate": 150.0, "ready_rate": 300.0},
            ]
        },
        "claims_64": {
            "rounds": [
                {"lifecycle_rate": 300.0, "ready_rate": 200.0},
                {"lifecycle_rate": 150.0, "ready_rate": 600.0},
            ]
        },
        "claims_256": {"rounds": [{"lifecycle_rate": 100.0, "ready_rate": 100.0}]},
    }
    assert dict(round_ratios(results)) == {
        "lifecycle, 16 claims / hand floor": pytest.approx([1 / 3, 0.5]),
        "lifecycle, 64 claims (the default) / hand floor": pytest.approx([0.5, 0.5]),
        "lifecycle, 64 / 16 claims": pytest.approx([1.5, 1.0]),
        "pending→ready, 64 / 16 claims": pytest.approx([0.5, 2.0]),
    }


def _report(results: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A mid-size run's report around ``results``, for the table's text alone."""
    machine = {"nproc": 2, "cpu": "test", "memory": "1 MiB"}
    machine |= {"load_average_before": [0.0] * 3, "load_average": [0.0] * 3}
    return {
        "size": "mid",
        "parameters": {"rounds": 1},
        "machine": machine,
        "measures": {},
        "results": results,
        **extra,
    }


def test_storm_ratios_pair_each_storm_with_the_bare_storm_before_it() -> None:
    """Each ratio is one of hubd's storms over the bare server's storm run just before it, in
    order, by socket count; a count whose sides ran different numbers of storms, or whose part
    failed, is left out. The table's text lists them under the rounds when there are two or
    more."""
    results = {
        "sockets_5000": {
            "bare": {"storm_rates": [2000.0, 1000.0, 1600.0]},
            "hubd": {"n": 5000, "storm_rates": [1000.0, 900.0, 1200.0]},
        },
        "sockets_2000": {
            "bare": {"storm_rates": [2500.0, 2000.0]},
            "hubd": {"n": 2000, "storm_rates": [1500.0, 1300.0]},
        },
        "sockets_10000": {
            "bare": {"storm_rates": [1500.0]},
            "hubd": {"n": 10000, "storm_rates": [900.0, 800.0]},
        },
        "sockets_30": {"error": "RuntimeError: the farm did not start"},
        "claims_16": {"rounds": [{"lifecycle_rate": 200.0}]},
    }
    assert storm_ratios(results) == [
        (2000, pytest.approx([0.6, 0.65])),
        (5000, pytest.approx([0.5, 0.9, 0.75])),
    ]
    text = render(_report(results))
    assert "  2,000 sockets  0.60x / 0.65x" in text
    assert "  5,000 sockets  0.50x / 0.90x / 0.75x" in text
    assert "10,000 sockets" not in text


async def test_the_fifo_claim_is_installed_for_its_block_only(
    db: Database, store: AllocationStore
) -> None:
    """Inside ``fairness.fifo_claims`` the claim takes due rows oldest first whatever their
    tenant, as before fair claiming; after it, the claim and its settings are as the migrations
    made them and the bench's index is gone."""
    burst = [(await store.request(provisioner_id="p", tenant_id="a")).id for _ in range(3)]
    late = (await store.request(provisioner_id="p", tenant_id="b")).id
    due = "SELECT id FROM hubd_due_allocations('{}'::text[], 2)"
    async with db.pool.acquire() as conn:
        before = await conn.fetchval(fairness.CURRENT_CLAIM)
        async with conn.transaction():
            assert [r["id"] for r in await conn.fetch(due)] == [burst[0], late]
        async with fairness.fifo_claims(conn), conn.transaction():
            assert [r["id"] for r in await conn.fetch(due)] == burst[:2]
        async with conn.transaction():
            assert [r["id"] for r in await conn.fetch(due)] == [burst[0], late]
        assert await conn.fetchval(fairness.CURRENT_CLAIM) == before
        assert await conn.fetchval("SELECT to_regclass('hubd_bench_fifo_due_idx')") is None


def test_a_scenario_pools_tenant_b_over_its_rounds() -> None:
    """B's percentiles are taken over every round's requests together, each round's p99 kept
    beside them; A's rate is the median of the rounds'."""
    rounds = [
        {"b_ms": [10.0] * 98 + [500.0] * 2, "b_claim_ms": [1.0] * 100, "a_n": 10,
         "a_rate": 100.0, "a_ms": [1.0] * 10, "b_during_burst": 100},
        {"b_ms": [20.0] * 100, "b_claim_ms": [2.0] * 100, "a_n": 10, "a_rate": 300.0,
         "a_ms": [3.0] * 10, "b_during_burst": 50},
        {"b_ms": [30.0] * 100, "b_claim_ms": [3.0] * 100, "a_n": 10, "a_rate": 200.0,
         "a_ms": [2.0] * 10, "b_during_burst": 0},
    ]  # fmt: skip
    summary = fairness.summarize(rounds)
    assert summary["b_n"] == 300
    assert summary["b_p50_ms"] == 20.0
    assert summary["b_p99_ms"] == 30.0
    assert summary["b_max_ms"] == 500.0
    assert summary["b_p99_ms_rounds"] == [500.0, 20.0, 30.0]
    assert (summary["b_claim_p50_ms"], summary["b_claim_p99_ms"]) == (2.0, 3.0)
    assert summary["a_rate"] == 200.0
    assert summary["a_n"] == 30
    assert summary["b_during_burst"] == 150
    assert "a_rate" not in fairness.summarize([{"b_ms": [1.0], "b_claim_ms": [0.5]}])


def test_b_claim_to_ready_is_split_at_the_dial_and_the_admission() -> None:
    """Each of B's allocations with a dial and an admission on record gives its three parts;
    A's, and B's whose sidecar was never dialled or admitted, give none."""
    rows = [
        {"allocation_id": "b1", "tenant_id": fairness.TENANT_B, "claimed": 10.0,
         "admitted": 10.05, "ready": 10.06},
        {"allocation_id": "b2", "tenant_id": fairness.TENANT_B, "claimed": 20.0,
         "admitted": None, "ready": 20.1},
        {"allocation_id": "b3", "tenant_id": fairness.TENANT_B, "claimed": 30.0,
         "admitted": 30.1, "ready": 30.2},
        {"allocation_id": "a1", "tenant_id": fairness.TENANT_A, "claimed": 1.0,
         "admitted": 1.1, "ready": 1.2},
    ]  # fmt: skip
    dialed = {"b1": 10.01, "b2": 20.01, "b3": None, "a1": 1.05}
    parts = fairness._parts(rows, dialed)  # type: ignore[arg-type]
    assert [[round(ms, 3) for ms in triple] for triple in parts] == [[10.0, 40.0, 10.0]]
    rounds = [
        {"b_ms": [1.0], "b_claim_ms": [0.5], "b_parts_ms": [[1.0, 2.0, 3.0]]},
        {"b_ms": [1.0], "b_claim_ms": [0.5], "b_parts_ms": [[3.0, 4.0, 5.0]]},
    ]
    summary = fairness.summarize(rounds)
    assert summary["b_parts_n"] == 2
    assert summary["b_parts_ms"]["dial → admission"][1] == 4.0


def test_a_deadline_round_counts_ends_twice_never_and_in_the_fault() -> None:
    """Lateness per kind from each allocation's first end event; one with two ``expire``
    ledger rows counts twice, one with no end never, one ready twice ready again; those due
    within the fault apart."""
    rows = [
        {"id": "a", "idle_kind": False, "due_at": 10.0, "late": 0.2, "readies": 1},
        {"id": "b", "idle_kind": False, "due_at": 20.0, "late": 0.5, "readies": 1},
        {"id": "c", "idle_kind": False, "due_at": None, "late": None, "readies": None},
        {"id": "d", "idle_kind": True, "due_at": 12.0, "late": 0.1, "readies": 2},
    ]
    expires = [("a", "in_1"), ("b", "in_1"), ("b", "in_2"), ("d", "in_2")]
    figures = deadlines._figures(rows, expires, 15.0, 25.0)  # type: ignore[arg-type]
    assert figures["expired"] == {
        "n": 3,
        "late_ms": [200.0, 500.0],
        "fault_ms": [500.0],
        "never": 1,
        "twice": 1,
        "ready_again": 0,
    }
    summary = deadlines.summarize([figures, figures])
    assert (summary["expired"]["n"], summary["expired"]["twice"]) == (6, 2)
    assert (summary["expired"]["p99_ms"], summary["expired"]["fault_n"]) == (500.0, 2)
    assert (summary["idle"]["never"], summary["idle"]["max_ms"]) == (0, 100.0)
    assert summary["idle"]["ready_again"] == 2


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_a_terminated_run_stops_its_processes_and_drops_its_databases(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """SIGTERM in the middle of a run (the farm and a daemon up) ends it with 143, and
    leaves neither its child processes nor its databases behind."""
    process = await _tiny_run(
        postgres_server,
        tmp_path / "bench.json",
        "--only",
        "claims",
        stdout=asyncio.subprocess.DEVNULL,
    )
    children: set[int] = set()

    async def farm_and_daemon_up() -> bool:
        children.update(procs.children(process.pid, live=True))
        return len(children) >= 2

    await eventually(farm_and_daemon_up, within=120, what="the farm and a daemon")
    process.terminate()
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 143, stderr.decode()[-4000:]

    async def children_gone() -> bool:
        return not any(_alive(pid) for pid in children)

    await eventually(children_gone, within=30, what="the bench's children to exit")
    conn = await asyncpg.connect(postgres_server.maintenance_dsn)
    try:
        left = await conn.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE $1", f"hubd_bench_{process.pid}%"
        )
    finally:
        await conn.close()
    assert left == []


async def _compare(*args: str) -> tuple[int, str, str]:
    """``python -m bench.compare`` with ``args``: its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.compare",
        *args,
        env=hubd_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_compare_runs_each_tree_in_turn_and_reports_medians(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """bench.compare against a checkout (this one) runs a daemon of each tree per pair and
    writes every pair and the medians of both; a directory that is no checkout is refused."""
    root = Path(procs.__file__).parent.parent
    output = tmp_path / "compare.json"
    code, out, err = await _compare(
        str(root),
        "--pairs",
        "1",
        "--lifecycle",
        "20",
        "--database-url",
        postgres_server.maintenance_dsn,
        "--json",
        str(output),
    )
    assert code == 0, out + err[-4000:]
    report = json.loads(output.read_text())
    assert len(report["pairs"]) == 1
    for tree in ("other", "this"):
        assert report["medians"][tree]["lifecycle_rate"] > 0
        assert report["medians"][tree]["daemon_cpu_ready_ms"] > 0
    assert "this/other" in out

    code, out, err = await _compare(str(tmp_path))
    assert code != 0
    assert "is not a checkout of hubd" in out + err


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_the_farm_runs_on_the_loop_it_is_given(tmp_path: Path, loop: str) -> None:
    """The sidecar farm runs on the event loop the bench names (``--farm-loop``), as it says
    itself: the report records what ran, not what was asked for."""
    farm = procs.FarmClient(tmp_path / "farm.sock", loop=loop)
    await farm.start()
    try:
        assert farm.running_loop == loop
        assert (await farm.call("status"))["sidecars"] == 0
    finally:
        await farm.stop()


@pytest.mark.parametrize(
    ("filename", "name", "expected"),
    [
        ("claims.sql", "claim_due", "claim (claim_due)"),
        ("transitions.sql", "park", "park"),
        ("connections.sql", "record", "admission (record)"),
        ("transitions.sql", "mark_released", "mark_released"),
        ("transitions.sql", "mark_connection_ready", "mark_connection_ready"),
    ],
)
def test_the_wait_sampler_knows_each_lifecycle_statement_as_both_views_show_it(
    filename: str, name: str, expected: str
) -> None:
    """bench.waits names a statement from the text the daemon sends (pg_stat_activity: its
    description first) and from the text without the leading comment, its lines re-wrapped
    (pg_stat_statements); another statement of the same file is none of them."""
    sql = load_queries(filename)[name].sql
    assert waits.statement(sql) == expected
    body = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    assert waits.statement("  ".join(body.split())) == expected
    others = [n for n in load_queries(filename).names() if n not in {s for _, s in waits.LIFECYCLE}]
    for other in others:
        assert waits.statement(load_queries(filename)[other].sql) is None


@pytest.mark.parametrize("room", [0, 4])
def test_the_daemon_config_names_the_room_only_when_it_is_set(tmp_path: Path, room: int) -> None:
    # bench.compare runs trees from before max_claims_per_tenant existed with this config; they
    # refuse a key they do not know.
    path = phases.daemon_config(
        tmp_path / "hubd.toml",
        database_url="postgresql://bench@127.0.0.1/bench",
        state_dir=tmp_path / "state",
        farm=tmp_path / "farm.sock",
        claims=64,
        per_tenant=room,
    )
    assert ("max_claims_per_tenant" in path.read_text()) == bool(room)
    config = load_config(path, env={})
    assert config.reconciler.max_concurrent_claims == 64
    assert config.reconciler.max_claims_per_tenant == room


def test_b_own_range_is_counted_apart_from_a_by_the_listener() -> None:
    # --own-range is there to take the listener's per-range handshake shares out of the
    # comparison: B's addresses must fall in a range none of A's does.
    b_ranges = {prefix_of(source) for source in fairness.B_SOURCES}
    a_ranges = {prefix_of(source) for source in A_SOURCES}
    assert b_ranges == {"127.0.1.0/24"}
    assert not b_ranges & a_ranges
    assert len(fairness.B_SOURCES) == len(A_SOURCES)


def test_the_profile_is_summarized_and_titled_with_the_claim_count_it_ran_at(
    tmp_path: Path,
) -> None:
    # --profile attaches py-spy to the daemon at the default claim count; the title says so.
    raw = tmp_path / "lifecycle.raw"
    raw.write_text(
        "Runner.run (asyncio/runners.py:118);reconcile (hubd/reconciler/steps.py:40);"
        "Connection._do_execute (asyncpg/connection.py:2069) 3\n"
        "Runner.run (asyncio/runners.py:118) 1\n"
    )
    profile = profile_summary(raw)
    assert profile["samples"] == 4
    assert profile["nearest_hubd"][0] == ["reconcile (hubd/reconciler/steps.py)", 0.75]
    text = render(_report({}, profile=profile))
    assert f"daemon profile, {DEFAULT_CLAIMS}-claim lifecycle (4 samples):" in text


def test_each_size_of_the_periodic_statements_is_timed_first_in_every_other_round() -> None:
    # Whichever side was timed second read slower (a 10-40 us statement 2.0x with the large
    # table second, 0.37x with it first): the order must fall on both sizes alike.
    orders = [scale.in_turn(["small", "large"], index) for index in range(scale.ROUNDS)]
    firsts = [order[0] for order in orders]
    assert firsts.count("small") == firsts.count("large") == scale.ROUNDS // 2
    assert all(sorted(order) == ["large", "small"] for order in orders)


def test_fairness_refuses_an_own_range_for_sidecars_of_a_shared_farm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        fairness.main(["--shared-farm", "--own-range"])
    assert exited.value.code == 2
    assert "not allowed with argument --shared-farm" in capsys.readouterr().err


async def test_a_burst_of_takes_commits_them_all_with_no_event_written(
    database_url: str, tmp_path: Path
) -> None:
    """``bench.takes``: every request of every round took a member. With no daemon to announce
    them, each take either rang, and wrote its own events, or is still owed them (architecture
    §8, "A take's events")."""
    tiny = takes.LOADS["tiny"]
    result = await takes.measure(database_url, None, tmp_path, tiny)  # type: ignore[arg-type]
    assert result["warm"] == tiny.pool
    assert len(result["rounds"]) == tiny.rounds
    assert "request p99" in takes.render(result)
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT a.take_unannounced, array_agg(e.event ORDER BY e.position) "
            "FILTER (WHERE e.event IS NOT NULL) AS events FROM hubd_allocations AS a "
            "LEFT JOIN hubd_events AS e ON e.allocation_id = a.id "
            "WHERE a.taken_at IS NOT NULL GROUP BY a.id, a.take_unannounced"
        )
        assert len(rows) == tiny.pool * tiny.rounds + tiny.connections
        for row in rows:
            expected = None if row["take_unannounced"] else ["requested", "ready"]
            assert row["events"] == expected
    finally:
        await conn.close()
