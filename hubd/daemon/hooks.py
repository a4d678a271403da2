"""The on-ready hook ``hubd run`` takes from its configuration (``[reconciler] on_ready``).

The key names the hook as a provisioner's ``plugin`` names its factory
(:func:`hubd.plugins.registry.find_callable`): ``"package.module:attr"`` or an entry point in
the group ``hubd.on_ready``. The hook is what ``Daemon(on_ready=...)`` takes (architecture §1:
run under the claim's lease, after the sidecar connected and before the allocation is ready)::

    async def hook(allocation: Allocation, context: HookContext) -> None: ...

It is checked here, where it is found, so ``hubd check-config`` and the start of ``hubd run``
refuse one of the wrong shape (exit 2) rather than the first claim that calls it.
"""

from __future__ import annotations

import inspect
from typing import Final

from hubd.errors import PluginLoadError
from hubd.plugins.registry import find_callable
from hubd.reconciler.settings import Hook

__all__ = ["ON_READY_GROUP", "ON_READY_KEY", "load_on_ready"]

ON_READY_GROUP: Final = "hubd.on_ready"
ON_READY_KEY: Final = "reconciler.on_ready"


def load_on_ready(name: str) -> Hook | None:
    """The hook ``name`` names (``None`` for an empty name), imported and checked; a
    :class:`PluginLoadError` naming the key otherwise."""
    if not name.strip():
        return None
    where = f"{ON_READY_KEY} {name.strip()!r}"
    target = find_callable(ON_READY_KEY, name, group=ON_READY_GROUP)
    call = getattr(target, "__call__", None)  # noqa: B004 -- an object may make itself async
    if not (inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)):
        raise PluginLoadError(
            f"{where}: names {type(target).__name__} {target!r:.60}, not an async function; "
            "expected: async def hook(allocation, context) -> None"
        )
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        # Some callables have no signature to read (builtins); the call itself will tell.
        return target  # type: ignore[return-value]
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise PluginLoadError(
            f"{where}: cannot be called as hook(allocation, context): {exc}"
        ) from None
    return target  # type: ignore[return-value]
