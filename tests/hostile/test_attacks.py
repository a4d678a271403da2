"""Attacks on a real ``hubd run`` at CI size: every one leaves the daemon's memory, descriptors,
readiness and healthy allocations as they were, and its log short.

The full-size runs behind docs/security.md's numbers: ``.venv/bin/python -m bench.hostile``.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hubd.server.limits import ListenerLimits
from hubd.store import AllocationStore, Status, connect_database
from tests.clikit import run_hubd_async
from tests.daemonkit import DaemonProcess, kill_sidecars, new_marker
from tests.hostilekit import (
    HOLDER_ATTACKS,
    STOLEN_ATTACKS,
    UNAUTHORIZED,
    Attacker,
    Measured,
    hostile_config,
    ledger_rows,
    measure,
    sidecar_environment,
    unconnected_sidecar,
)
from tests.polling import eventually
from tests.test_daemon import request_many

STALE = "409 stale generation: this sidecar was replaced"
UNTIL_LEGIT_DONE = frozenset({"half-open-reconnecting"})
"""Attacks that go on until the legitimate request is done, which must be done first."""

pytestmark = [pytest.mark.hostile, pytest.mark.slow, pytest.mark.timeout(240)]

# (attack, connections or workers, seconds): the ping flood ends as soon as the hub drops it.
SIZES = [
    ("header-flood", 300, 6.0),
    ("half-open", 500, 6.0),
    # Until the legitimate request is done (60 s at most): it must get through the flood.
    ("half-open-reconnecting", 500, 60.0),
    ("bad-tokens", 20, 8.0),
    ("ping-flood", 1, 30.0),
    ("reconnect-loop", 1, 8.0),
    ("ping-flood-stolen", 1, 8.0),
    ("reconnect-loop-stolen", 1, 8.0),
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
        config = hostile_config(state_dir / "hubd.toml", state_dir=state_dir, marker=marker)
        env = {"HUBD_STATE_DIR": str(state_dir), "HUBD_CONFIG": str(config)}
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            yield Attacked(daemon, env, marker, f"postgresql://postgres@/hubd?host={tmp}/pgdata")
        finally:
            await daemon.kill()
            kill_sidecars(marker)


async def stays(dsn: str, allocation_id: str, *, ready: bool = False) -> None:
    """``allocation_id`` is (again) allocated, and ready when asked."""
    db = await connect_database(dsn)
    try:
        store = AllocationStore(db, instance_id="observer")

        async def healthy() -> bool:
            row = await store.get(allocation_id)
            return row.status is Status.ALLOCATED and (row.ready or not ready)

        await eventually(healthy, within=10, what=f"{allocation_id} allocated")
    finally:
        await db.close()


def assert_holder_contained(attack: str, result: Measured, ledger_growth: int) -> None:
    """The genuine sidecar's own attack: it was let in, and then stopped by the caps."""
    outcomes = result.outcomes
    summary = f"{result!r} ledger +{ledger_growth}"
    assert UNAUTHORIZED not in outcomes, summary
    if attack == "ping-flood":
        # Welcomed once, then dropped by the hub (the flood only ends early when its writes
        # fail: the hub closed the socket under it).
        assert outcomes.get("welcome") == 1, summary
        assert outcomes.get("dropped") == 1, summary
        assert "never dropped" not in outcomes, summary
        return
    limits = ListenerLimits()
    # Every accepted reconnect is a legitimate one, and the per-allocation bucket caps them.
    allowed = limits.reconnect_burst + limits.reconnect_rate * result.seconds + 1
    assert 2 <= outcomes.get("welcome", 0) <= allowed, summary
    assert outcomes.get("429 reconnecting too often", 0) >= 1, summary
    # At most a loss and a "ready on connect" per accepted reconnect: bounded by the bucket,
    # not by how fast the sidecar loops.
    assert ledger_growth <= 2 * allowed + 4, summary
    # Nothing but welcomes and the bucket's refusals: no other refusal, no failed dial (a
    # 409 would mean the hub gave the flapping sidecar's generation up).
    assert set(outcomes) == {"welcome", "429 reconnecting too often"}, summary


@pytest.mark.parametrize(("attack", "size", "seconds"), SIZES, ids=[s[0] for s in SIZES])
async def test_attack_is_contained(
    attacked: Attacked, attack: str, size: int, seconds: float
) -> None:
    """During the attack every /readyz probe answers 200, a legitimate request becomes ready,
    memory stays within +64 MiB; afterwards descriptors are back to baseline, memory within
    +32 MiB, the healthy allocation still allocated, and the log short. The reconnecting
    half-open flood goes on until the legitimate request is ready, which must come first.

    The ping flood and the reconnect loop are made twice: by the allocation's genuine sidecar
    (the attacker connects first with the environment a sidecar that never dials was given), which
    the caps must stop, and with a token copied from a sidecar that already connected, which
    only ever gets the one 401 and leaves that sidecar ready.

    How fast /readyz and the legitimate request answer is measured by bench/hostile.py, not
    asserted here: this process is the attacker too, and shares the machine with the daemon."""
    [healthy] = await request_many(1, attacked.env, wait=True)
    target = victim = ""
    if attack in HOLDER_ATTACKS:
        target, identity = await unconnected_sidecar(attacked.env, attacked.marker)
    else:
        # Any process of the daemon's uid can read a local sidecar's environment.
        [victim] = await request_many(1, attacked.env, wait=True)
        identity = sidecar_environment(attacked.marker, victim)
    ledger_before = await ledger_rows(attacked.dsn, target) if target else 0
    result = await measure(
        attacked.daemon,
        attack,
        size=size,
        seconds=seconds,
        env=attacked.env,
        attacker=Attacker(identity),
        until_legit_done=attack in UNTIL_LEGIT_DONE,
    )
    summary = repr(result)
    if attack in UNTIL_LEGIT_DONE:
        # Not locked out: the legitimate request became ready while the flood went on.
        assert result.legit_while_attacked, summary
    assert result.readyz_failures == 0, summary
    assert result.legit_failures == 0, summary
    assert result.legit
    assert result.rss_peak - result.rss_before < 64, summary
    assert result.rss_after - result.rss_before < 32, summary
    assert result.fds_after <= result.fds_before + 8, summary
    assert result.log_lines < 200, summary
    await stays(attacked.dsn, healthy)
    if attack in STOLEN_ATTACKS:
        # A copied token opens nothing, and the sidecar it was copied from keeps its socket.
        assert result.outcomes == {UNAUTHORIZED: 1}, summary
        await stays(attacked.dsn, victim, ready=True)
    if target:
        growth = await ledger_rows(attacked.dsn, target) - ledger_before
        # Released first: the next attack's daemon has no stray allocation of this one.
        released = await run_hubd_async("alloc", "release", target, env=attacked.env)
        assert released.code == 0, released.err
        assert_holder_contained(attack, result, growth)
