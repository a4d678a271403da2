"""On-ready hooks for ``[reconciler] on_ready`` in tests, named as ``tests.hookkit:<name>``.

``hold`` tells the test it started (a file named for the allocation, holding the claim's lease
id) and waits until the test lets it finish (another file): the test looks at the allocation
while its hook runs. The directory comes from ``HOOK_TEST_DIR`` (not ``HUBD_*``: those are the
daemon's configuration).
"""

from __future__ import annotations

import os
from pathlib import Path

from hubd.reconciler.settings import HookContext
from hubd.store.rows import Allocation
from tests.polling import eventually

HOLD_LIMIT = 30.0
"""How long ``hold`` waits to be let go before it fails (and the claim with it)."""


def started_file(directory: Path, allocation_id: str) -> Path:
    return directory / f"{allocation_id}.started"


def release_file(directory: Path, allocation_id: str) -> Path:
    return directory / f"{allocation_id}.go"


async def hold(allocation: Allocation, context: HookContext) -> None:
    directory = Path(os.environ["HOOK_TEST_DIR"])
    started_file(directory, allocation.id).write_text(context.lease_id)
    release = release_file(directory, allocation.id)
    # The test is another process: a file is what it can hand over.
    await eventually(release.exists, within=HOLD_LIMIT, every=0.02, what="the test's release")


def not_async(allocation: Allocation, context: HookContext) -> None:
    """The wrong shape: a plain function."""


async def one_argument(allocation: Allocation) -> None:
    """The wrong shape: no context parameter."""


class AsyncCallable:
    """An object whose call is async: a hook too."""

    async def __call__(self, allocation: Allocation, context: HookContext) -> None:
        return None


callable_object = AsyncCallable()
