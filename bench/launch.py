"""``hubd`` as the benchmark runs it: the real command line, with the sidecar socket cap lifted.

    python -m bench.launch run --config hubd.toml

hubd caps its sidecar listener at ``ListenerLimits.max_connections`` (4,096) sockets, and no
setting changes that; the 5,000 and 10,000 sockets sizes need more. ``BENCH_MAX_SOCKETS`` (when
set) replaces the cap before the daemon builds its listener; everything else is ``hubd run``.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import sys

import hubd.daemon
from hubd.cli import main
from hubd.server.limits import ListenerLimits


def _lift_socket_cap(cap: int) -> None:
    """Every daemon module that builds ``ListenerLimits()`` gets one with ``cap`` sockets."""
    lifted = functools.partial(ListenerLimits, max_connections=cap)
    for module in pkgutil.iter_modules(hubd.daemon.__path__, "hubd.daemon."):
        loaded = importlib.import_module(module.name)
        if getattr(loaded, "ListenerLimits", None) is ListenerLimits:
            # setattr: a plain assignment of a partial to a class name needs a type ignore.
            setattr(loaded, "ListenerLimits", lifted)  # noqa: B010


if __name__ == "__main__":
    cap = int(os.environ.get("BENCH_MAX_SOCKETS", "0"))
    if cap:
        # The daemon still lowers the cap to fit its open-file limit (plan_descriptors).
        _lift_socket_cap(cap)
    sys.exit(main(sys.argv[1:]))
