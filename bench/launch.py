"""``hubd`` as the benchmark runs it: the real command line, with the sidecar socket cap raised.

    python -m bench.launch run --config hubd.toml

hubd caps its sidecar listener at ``server.max_connections`` (4,096 by default); the 5,000 and
10,000 sockets sizes need more, and so does a lifecycle of more than 4,096 allocations (every
sidecar stays connected until the release). ``BENCH_MAX_SOCKETS`` (when set) becomes that
setting through its environment override, ``HUBD_SERVER_MAX_CONNECTIONS``, which the config
file cannot contradict (the environment is laid over the file); everything else is ``hubd run``.
"""

from __future__ import annotations

import os
import sys

from hubd.cli import main

if __name__ == "__main__":
    cap = os.environ.get("BENCH_MAX_SOCKETS", "")
    if cap and cap != "0":
        # The daemon still lowers the cap to fit its open-file limit (open_file_limit_low).
        os.environ["HUBD_SERVER_MAX_CONNECTIONS"] = cap
    sys.exit(main(sys.argv[1:]))
