"""``python -m hubd.store.embedded stop-orphaned STATE_DIR``, the service unit's
``ExecStopPost=``."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from hubd.errors import ConfigError, EmbeddedPostgresError, HubdError
from hubd.store.embedded.server import EmbeddedPostgres

log = structlog.get_logger("hubd.store.embedded")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hubd.store.embedded stop-orphaned STATE_DIR``: stop the embedded server of
    ``STATE_DIR`` if every process that used it is gone (exit 0 either way; 1 when it would
    not stop, 2 on a usage or ownership error)."""
    from hubd.logs import configure_logging

    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) != 2 or arguments[0] != "stop-orphaned":
        print("usage: python -m hubd.store.embedded stop-orphaned STATE_DIR", file=sys.stderr)
        return 2
    configure_logging(level=os.environ.get("HUBD_LOG_LEVEL", "info"))
    try:
        EmbeddedPostgres(Path(arguments[1])).stop_orphaned()
    except (ConfigError, EmbeddedPostgresError) as exc:
        failure: HubdError = exc
    else:
        return 0
    log.error("embedded_postgresql_not_stopped", reason=str(failure))
    return 2 if isinstance(failure, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
