"""Attacks on a real ``hubd run`` at CI size: every one leaves the daemon's memory, descriptors,
readiness and healthy allocations as they were, and its log short.

The full-size runs behind README's numbers: ``.venv/bin/python -m bench.hostile``.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hubd.store import AllocationStore, Status, connect_database
from tests.daemonkit import DaemonProcess, kill_sidecars, new_marker, write_config
from tests.hostilekit import measure, stolen_identity
from tests.polling import eventually
from tests.test_daemon import request_many

pytestmark = [pytest.mark.hostile, pytest.mark.slow, pytest.mark.timeout(240)]

# (attack, connections or workers, seconds)
SIZES = [
    ("header-flood", 300, 6.0),
    ("half-open", 500, 6.0),
    ("bad-tokens", 20, 8.0),
    ("ping-flood", 1, 8.0),
    ("reconnect-loop", 1, 8.0),
]


class Attacked:
    def __init__(self, daemon: DaemonProcess, env: dict[str, str], marker: str, dsn: str) -> None:
        self.daemon = daemon
        self.env = env
        self.marker = marker
        self.dsn = dsn


@pytest.fixture(scope="module")
async def attacked() -> AsyncIterator[Attacked]:
    marker = new_marker()
    with tempfile.TemporaryDirectory(prefix="hubd-h") as tmp:
        state_dir = Path(tmp)
        config = write_config(state_dir / "hubd.toml", state_dir=state_dir, marker=marker)
        # The production instance TTL: readiness reports a heartbeat older than the TTL, and
        # the test config's 5 s is shorter than the event-loop stalls a loaded 2-core machine
        # shows while this same process floods the daemon.
        config.write_text(config.read_text().replace('ttl = "5s"', 'ttl = "20s"'))
        env = {"HUBD_STATE_DIR": str(state_dir), "HUBD_CONFIG": str(config)}
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            yield Attacked(daemon, env, marker, f"postgresql://postgres@/hubd?host={tmp}/pgdata")
        finally:
            await daemon.kill()
            kill_sidecars(marker)


@pytest.mark.parametrize(("attack", "size", "seconds"), SIZES, ids=[s[0] for s in SIZES])
async def test_attack_is_contained(
    attacked: Attacked, attack: str, size: int, seconds: float
) -> None:
    """During the attack every /readyz probe answers 200, a legitimate request becomes ready,
    memory stays within +64 MiB; afterwards descriptors are back to baseline, memory within
    +32 MiB, the healthy allocation still allocated, and the log short.

    How fast /readyz and the legitimate request answer is measured by bench/hostile.py, not
    asserted here: this process is the attacker too, and shares the machine with the daemon."""
    # The attacker's tokens come from a victim's sidecar (any process of the daemon's uid can
    # read them); the healthy allocation is a bystander that must stay healthy.
    healthy, victim = await request_many(2, attacked.env, wait=True)
    identity = stolen_identity(attacked.marker, victim)
    result = await measure(
        attacked.daemon, attack, size=size, seconds=seconds, env=attacked.env, identity=identity
    )
    summary = repr(result)
    assert result.readyz_failures == 0, summary
    assert result.legit_failures == 0, summary
    assert result.legit
    assert result.rss_peak - result.rss_before < 64, summary
    assert result.rss_after - result.rss_before < 32, summary
    assert result.fds_after <= result.fds_before + 8, summary
    assert result.log_lines < 200, summary
    db = await connect_database(attacked.dsn)
    try:
        store = AllocationStore(db, instance_id="observer")

        async def healthy_allocated() -> bool:
            row = await store.get(healthy)
            return row.status is Status.ALLOCATED

        await eventually(healthy_allocated, within=10, what="healthy allocation allocated")
    finally:
        await db.close()
