"""An instant provisioner for the benchmark: ``ensure`` hands the credentials to the sidecar farm
(``bench.farm``) over its Unix socket and returns at once; ``destroy`` forgets nothing (the hub
closes the farm's socket itself when the generation ends).

    [[provisioners]]
    id = "bench"
    plugin = "bench.plugin:create"
    [provisioners.options]
    farm = "/path/to/farm.sock"

The cost it adds to a lifecycle is one line written to a local socket per ``ensure``.
"""

from __future__ import annotations

import asyncio
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
)

__all__ = ["FarmProvisioner", "create"]


class FarmProvisioner:
    api_version = "1"
    binding_fingerprint = "bench-farm"

    def __init__(self, *, id: str, farm: Path) -> None:
        self.id = id
        self._farm = farm
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def _send(self, message: Mapping[str, Any]) -> None:
        async with self._lock:
            if self._writer is None or self._writer.is_closing():
                _reader, self._writer = await asyncio.open_unix_connection(str(self._farm))
            self._writer.write(json.dumps(message).encode() + b"\n")
            await self._writer.drain()

    async def ensure(self, request: EnsureRequest) -> EnsureResult:
        if not request.ownership.still_owned():
            return Rejected(code="not_owned", message="claim lost", retryable=True)
        try:
            await self._send(
                {
                    "op": "open",
                    "allocation_id": request.allocation_id,
                    "sidecar_id": request.sidecar_id,
                    "generation": request.generation,
                    "token": request.token,
                    "url": request.hub_ws_url,
                }
            )
        except OSError as exc:
            self._writer = None
            return Rejected(code="farm_unreachable", message=str(exc), retryable=True)
        return Accepted(f"farm:{request.sidecar_id}")

    async def destroy(self, request: DestroyRequest) -> DestroyResult:
        del request
        return Destroyed()


def create(*, id: str, options: Mapping[str, Any], state_dir: Path) -> FarmProvisioner:
    del state_dir
    farm = options.get("farm")
    if not isinstance(farm, str) or not farm:
        raise PluginLoadError("bench option 'farm': the farm's Unix socket path")
    return FarmProvisioner(id=id, farm=Path(farm))
