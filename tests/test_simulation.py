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
from tests.simkit import Coverage, Simulation, describe, expected_pairs, reset

CI_SEEDS = 40


def seeds() -> list[int]:
    one = os.environ.get("HUBD_SIM_SEED")
    if one is not None:
        return [int(one)]
    return list(range(int(os.environ.get("HUBD_SIM_SEEDS", CI_SEEDS))))


@pytest.mark.timeout(900)
async def test_seeded_faults_at_every_step_boundary(db: Database, database_url: str) -> None:
    """Whatever fault lands at whatever step boundary, the committed history has no write under
    a stale lease, no interleaved leases, no generation regression and no changed terminal row;
    no plugin effect happens after the database moved the lease on; and once faults stop every
    allocation ends ready (one live sidecar, of its current generation) or released (none), as
    asked. Across the seed set, every kind of boundary receives every kind of fault."""
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
        missing = expected_pairs() - coverage.pairs
        assert not missing, f"(boundary, fault) pairs never exercised: {sorted(missing)}"
    print(
        f"{len(chosen)} seeds, {len(coverage.pairs)} (boundary, fault) pairs, "
        f"boundaries reached: {coverage.boundaries}"
    )
