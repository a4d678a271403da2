"""A provisioner plugin for process tests: the built-in ``local`` provisioner whose ``ensure``
first waits ``ensure_delay`` seconds, so a test can stop a daemon while it holds claims."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hubd.plugins import local
from hubd.plugins.protocol import DestroyRequest, DestroyResult, EnsureRequest, EnsureResult


class SlowLocal:
    def __init__(self, inner: local.LocalProvisioner, delay: float) -> None:
        self._inner = inner
        self._delay = delay
        self.id = inner.id
        self.api_version = inner.api_version
        self.binding_fingerprint = inner.binding_fingerprint

    async def ensure(self, request: EnsureRequest) -> EnsureResult:
        await asyncio.sleep(self._delay)
        return await self._inner.ensure(request)

    async def destroy(self, request: DestroyRequest) -> DestroyResult:
        return await self._inner.destroy(request)


def create(*, id: str, options: Mapping[str, Any], state_dir: Path) -> SlowLocal:
    rest = {k: v for k, v in options.items() if k != "ensure_delay"}
    inner = local.create(id=id, options=rest, state_dir=state_dir)
    return SlowLocal(inner, float(options.get("ensure_delay", 2.0)))
