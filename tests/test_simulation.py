"""Seeded simulation: two replicas on the real database, a fault landed by the seed at any
boundary between a claim's durable steps or around a connection event, then convergence with no
faults, judged on committed data only (tests/simkit.py).

A failing seed is printed with its trace; replay it alone with
``HUBD_SIM_SEED=1234 pytest tests/test_simulation.py``. ``HUBD_SIM_SEEDS=2000`` runs that many
seeds (``python -m bench.simulation`` does the same outside pytest).
"""

from __future__ import annotations

import os

import pytest

from hubd.store import Database
from tests.faultkit import install_observer
from tests.simkit import Coverage, FakeSidecar, Simulation, describe, reset

CI_SEEDS = 150


def seeds() -> list[int]:
    one = os.environ.get("HUBD_SIM_SEED")
    if one is not None:
        return [int(one)]
    return list(range(int(os.environ.get("HUBD_SIM_SEEDS", CI_SEEDS))))


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_seeded_faults_at_every_step_boundary(db: Database, database_url: str) -> None:
    """Whatever fault lands at whatever step boundary, the committed history has no write under
    a stale lease, no interleaved leases, no generation regression and no changed terminal row;
    no plugin effect happens after the database moved the lease on; and once faults stop every
    allocation ends ready (one live sidecar, of its current generation) or released (none), as
    asked; and a replica stopped with its sockets open never has a healthy allocation given up
    within the window its peer's sweep gave. Across the seed set, every kind of boundary receives
    every kind of fault."""
    await install_observer(database_url)
    chosen = seeds()
    coverage = Coverage()
    for seed in chosen:
        await reset(db)
        sim = Simulation(seed=seed, db=db, dsn=database_url, coverage=coverage)
        try:
            found = describe(await sim.run())
        except BaseException:
            print(f"seed {seed} raised; replay with HUBD_SIM_SEED={seed}")
            print("\n".join(sim.trace))
            raise
        if found:
            print("\n".join(sim.trace))
            pytest.fail(f"seed {seed} broke {found}; replay with HUBD_SIM_SEED={seed}")
    if len(chosen) >= CI_SEEDS:
        missing = coverage.missing()
        assert not missing, f"(boundary, fault) pairs never exercised: {sorted(missing)}"
        # A stopped replica's healthy allocations, aged while it was stopped and judged at its
        # resumption: the window its peer's sweep gives is on trial in the seed set.
        assert coverage.stopped_judged > 0
    print(
        f"{len(chosen)} seeds, {len(coverage.pairs)} (boundary, fault) pairs, "
        f"{coverage.stopped_judged} stopped replicas' allocations judged after time passed, "
        f"boundaries reached: {coverage.boundaries}"
    )


async def test_the_oracle_catches_planted_sidecar_faults(db: Database, database_url: str) -> None:
    """The simulation's own judgements bite: a second live sidecar at the current generation,
    one of an old generation, one left running for a released allocation, a plugin effect
    made after the lease moved on, and an endpoint that is not the current sidecar's are each
    reported (the history checker has its own self-test
    in tests/test_faultcheck.py)."""
    await install_observer(database_url)
    sim = Simulation(seed=0, db=db, dsn=database_url, steps=0)
    kept = await sim.store.request(provisioner_id="fake")
    gone = await sim.store.request(provisioner_id="fake")
    sim.ids += [kept.id, gone.id]
    sim.released.add(gone.id)
    await sim.store.release(gone.id)
    assert describe(await sim.run()) == {}
    ready = await sim.store.get(kept.id)
    sim.world.sidecars["twin"] = FakeSidecar(kept.id, ready.generation, "twin")
    sim.world.sidecars["old"] = FakeSidecar(kept.id, ready.generation - 1, "old")
    sim.world.sidecars["left"] = FakeSidecar(gone.id, 1, "left")
    sim.world.late_effects.append(f"ensure {kept.id} gen 1")
    assert ready.endpoint == f"sim://{ready.sidecar_id}"
    async with db.connection("plant") as conn:
        await conn.execute(
            "UPDATE hubd_allocations SET endpoint = 'sim://twin' WHERE id = $1", kept.id
        )
    found = describe(await sim.judge())
    assert set(found) == {"sidecars", "late_plugin_effects", "published"}
    assert found["published"] == [
        f"{kept.id} allocated gen {ready.generation} bound {ready.sidecar_id} shows sim://twin "
        f"{{'generation': {ready.generation}}}"
    ]
    text = "\n".join(found["sidecars"])
    assert f"{kept.id} ready at gen {ready.generation} with" in text
    assert f"{kept.id} has live sidecars of old generations" in text
    assert f"{gone.id} released with 1 live sidecars" in text


async def test_a_seed_replays_the_same_history(db: Database, database_url: str) -> None:
    """Running a seed twice takes the same steps and lands the same faults at the same
    boundaries: a failing seed can be replayed."""
    await install_observer(database_url)
    traces = []
    for _ in range(2):
        await reset(db)
        sim = Simulation(seed=11, db=db, dsn=database_url)
        assert describe(await sim.run()) == {}
        traces.append(sim.trace)
    assert traces[0] == traces[1]
    assert any("fault" in line for line in traces[0])
