"""The conformance kit (``hubd.plugins.testing``) run against the built-in provisioners: what a
third-party plugin author runs against theirs."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hubd.plugins import local
from hubd.plugins.protocol import DestroyRequest, Provisioner
from hubd.plugins.testing import CHECKS, ProvisionerConformance, Subject, run_checks
from tests import containerkit

pytestmark = pytest.mark.timeout(120)


class TestLocal(ProvisionerConformance):
    @pytest.fixture
    def subject(self, tmp_path: Path) -> Subject:
        sleep = shutil.which("sleep")
        assert sleep is not None

        def make() -> Provisioner:
            return local.create(
                id="local",
                options={"command": [sleep, "300"], "grace": "1s"},
                state_dir=tmp_path,
            )

        return Subject(make=make)


class TestContainer(ProvisionerConformance):
    """On each engine (``tests/containerkit.py``)."""

    @pytest.fixture(params=containerkit.ENGINES)
    def engine(self, request: pytest.FixtureRequest) -> containerkit.Engine:
        return containerkit.engine(request.param)

    @pytest.fixture
    async def subject(self, engine: containerkit.Engine, tmp_path: Path) -> AsyncIterator[Subject]:
        deployment = f"k{uuid.uuid4().hex[:10]}"
        from hubd.plugins import container

        def make() -> Provisioner:
            return container.create(
                id="container",
                options=containerkit.options(
                    engine,
                    deployment=deployment,
                    command=["sleep", "300"],
                    init=True,  # SIGTERM ends sleep, which as PID 1 would ignore it
                    stop_timeout=1,
                ),
                state_dir=tmp_path,
            )

        yield Subject(make=make)
        left = await containerkit.containers(engine, deployment)
        provisioner = make()
        for found in left:
            labels = found["Config"]["Labels"]
            await provisioner.destroy(
                DestroyRequest(
                    allocation_id=labels["io.hubd.allocation-id"],
                    generation=2,
                    sidecar_id=labels["io.hubd.sidecar-id"],
                    external_ref=None,
                )
            )
        assert left == [], "a check left containers behind"


async def test_run_checks_runs_every_check(tmp_path: Path) -> None:
    """run_checks, the runner-neutral entry point, runs the named checks against a subject."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    subject = Subject(
        make=lambda: local.create(
            id="local", options={"command": [sleep, "300"], "grace": "1s"}, state_dir=tmp_path
        )
    )
    await run_checks(subject, ["destroy_of_unknown_sidecar", "ensure_is_idempotent"])
    assert set(CHECKS) >= {"ensure_is_idempotent", "cancellation_mid_call", "inventory"}
