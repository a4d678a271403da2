"""An example hubd provisioner plugin: it "runs" sidecars by remembering them.

Nothing is started, so no sidecar ever dials in and hubd replaces each one when its connect
deadline passes; the point is the shape of a plugin. See ``docs/plugins.md``.

Register it in ``hubd.toml`` by ``module:attr``, with this directory on ``PYTHONPATH``::

    [[provisioners]]
    id = "echo"
    plugin = "echo_provisioner:create"
    [provisioners.options]
    region = "eu-1"        # part of the binding: where sidecars "run"
    capacity = 10          # how many sidecars at once; more are refused (retryable)

or, in a distribution of its own, by entry point (then ``plugin = "echo"``)::

    [project.entry-points."hubd.provisioners"]
    echo = "echo_provisioner:create"
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hubd.errors import PluginLoadError
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRequest,
    DestroyResult,
    EnsureRequest,
    EnsureResult,
    Rejected,
    checks_options,
)

__all__ = ["EchoProvisioner", "create"]


class EchoProvisioner:
    """Keeps its "sidecars" in a dict: sidecar id → external_ref."""

    api_version = "1"

    def __init__(self, *, id: str, region: str, capacity: int) -> None:
        self.id = id
        self.region = region
        self.capacity = capacity
        # Only the options that decide *where* sidecars run: a different capacity still runs
        # them in the same place, a different region does not.
        binding = json.dumps({"region": region}, sort_keys=True, separators=(",", ":"))
        self.binding_fingerprint = hashlib.sha256(binding.encode()).hexdigest()
        self.sidecars: dict[str, str] = {}

    async def ensure(self, request: EnsureRequest) -> EnsureResult:
        # Idempotent per sidecar id: hubd retries a call whose outcome it could not record.
        existing = self.sidecars.get(request.sidecar_id)
        if existing is not None:
            return Accepted(existing)
        if len(self.sidecars) >= self.capacity:
            # Retryable: hubd replaces the sidecar later, by which time room may have freed up.
            return Rejected(
                code="at_capacity",
                message=f"{self.region} already runs {self.capacity} sidecars",
                retryable=True,
            )
        # A real plugin hands request.token to the sidecar through a private channel (its
        # environment, a secret store) and never logs it or puts it in external_ref.
        ref = f"echo:{self.region}:{request.sidecar_id}"
        self.sidecars[request.sidecar_id] = ref
        return Accepted(ref)

    async def destroy(self, request: DestroyRequest) -> DestroyResult:
        # Destroying what is already gone (or never existed) is a success, not an error.
        self.sidecars.pop(request.sidecar_id, None)
        return Destroyed()


def parse_options(options: Mapping[str, Any]) -> tuple[str, int]:
    """The region and capacity, or a PluginLoadError naming the bad option."""
    unknown = sorted(set(options) - {"region", "capacity"})
    if unknown:
        raise PluginLoadError(f"echo option {unknown[0]!r}: unknown option")
    region = options.get("region", "local")
    if not isinstance(region, str) or not region:
        raise PluginLoadError("echo option 'region': must be a non-empty string")
    capacity = options.get("capacity", 100)
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise PluginLoadError("echo option 'capacity': must be a positive integer")
    return region, capacity


def check_options(*, id: str, options: Mapping[str, Any]) -> None:
    """What ``hubd check-config`` runs: the factory's own parser, building nothing."""
    parse_options(options)


@checks_options(check_options)
def create(*, id: str, options: Mapping[str, Any], state_dir: Path) -> EchoProvisioner:
    """The factory hubd calls with the ``[provisioners.options]`` table of this provisioner."""
    del state_dir  # everything is in memory; a real plugin keeps its files under state_dir
    region, capacity = parse_options(options)
    return EchoProvisioner(id=id, region=region, capacity=capacity)
