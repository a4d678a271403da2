"""``hubd`` as the benchmark runs it: the real command line, with the sidecar socket cap lifted.

    python -m bench.launch run --config hubd.toml

hubd caps its sidecar listener at ``ListenerLimits.max_connections`` (4,096) sockets, and no
setting changes that; the 5,000 and 10,000 sockets sizes need more. ``BENCH_MAX_SOCKETS`` (when
set) replaces the cap before the daemon builds its listener; everything else is ``hubd run``.
"""

from __future__ import annotations

import functools
import os
import sys

from hubd.cli import main
from hubd.daemon import service
from hubd.server.limits import ListenerLimits

if __name__ == "__main__":
    cap = int(os.environ.get("BENCH_MAX_SOCKETS", "0"))
    if cap:
        # The daemon still lowers the cap to fit its open-file limit (plan_descriptors).
        lifted = functools.partial(ListenerLimits, max_connections=cap)
        # setattr: a plain assignment of a partial to a class name would need a type ignore.
        setattr(service, "ListenerLimits", lifted)  # noqa: B010
    sys.exit(main(sys.argv[1:]))
