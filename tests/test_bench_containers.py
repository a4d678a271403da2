"""``python -m bench.containers`` at its smallest size: it runs end to end and reports numbers.

Behaviour only: the figures of a run this small mean nothing and are compared with nothing;
docs/plugins.md has a measured run.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests import containerkit
from tests.clikit import hubd_env
from tests.conftest import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_smallest_run_prints_every_measure(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """One sample and two at once, on the tests' PostgreSQL: exit 0, the table printed, and
    JSON in which each of the six measures has a positive hubd figure, engine figure and
    ratio, every sample of both sides was taken, and no container of hubd's is left."""
    containerkit.engine()  # the bench starts its own; this one only says whether it can
    output = tmp_path / "containers.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.containers", "--samples", "1", "--concurrent", "2",
        "--database-url", postgres_server.maintenance_dsn, "--json", str(output),
        env=hubd_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await process.communicate()
    text = stdout.decode()
    assert process.returncode == 0, text + stderr.decode()[-4000:]
    assert "ensure → ready p50 (ms)" in text
    assert "2 at once: all destroyed (s)" in text

    report = json.loads(output.read_text())
    rows = report["measures"]
    assert len(rows) == 6
    for row in rows:
        for key in ("hubd", "engine", "ratio"):
            assert isinstance(row[key], float), (row["measure"], key)
            assert row[key] > 0, (row["measure"], key)
    samples = report["results"]["samples"]
    assert [len(samples["hubd"][k]) for k in ("ready", "down")] == [1, 1]
    assert [len(samples["engine"][k]) for k in ("create", "start", "dial", "down")] == [1] * 4
    assert len(report["results"]["at_once"]["hubd"]["each_ready"]) == 2
    assert report["results"]["containers_left"] == 0
