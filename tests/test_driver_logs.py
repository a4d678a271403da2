"""asyncpg's pool, restoring its connections through an outage, says each failure in one line:
the logging configuration installs that (hubd.logs.QuietReconnects), not an import of the
store."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import structlog

from hubd.logs import QuietReconnects, configure_logging, flush_logs


def _pool_logs(error: BaseException) -> dict[str, object]:
    out = io.StringIO()
    configure_logging(fmt="json", level="info", stream=out)
    try:
        logging.getLogger("asyncpg.pool").error(
            "failed to connect to the server", exc_info=(type(error), error, None)
        )
        flush_logs()
    finally:
        structlog.reset_defaults()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    entry: dict[str, object] = json.loads(lines[0])
    return entry


def test_importing_the_store_installs_nothing() -> None:
    # A fresh interpreter: this one configured its logging long ago.
    check = (
        "import logging, hubd.store.database, hubd.store.driver_errors; "
        "print(logging.getLogger('asyncpg.pool').filters)"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


def test_configuring_the_logging_installs_the_filter_once() -> None:
    configure_logging(fmt="json", level="info", stream=io.StringIO())
    configure_logging(fmt="json", level="info", stream=io.StringIO())
    structlog.reset_defaults()
    pool = logging.getLogger("asyncpg.pool")
    assert [type(f) for f in pool.filters if isinstance(f, QuietReconnects)] == [QuietReconnects]


def test_an_outage_is_one_warning_line_naming_the_error() -> None:
    entry = _pool_logs(ConnectionRefusedError(111, "Connect call failed"))
    assert entry["level"] == "warning"
    assert entry["event"] == (
        "failed to connect to the server: ConnectionRefusedError: [Errno 111] Connect call failed"
    )
    assert "exception" not in entry


def test_any_other_error_keeps_its_level_and_traceback() -> None:
    entry = _pool_logs(ValueError("a bug"))
    assert entry["level"] == "error"
    assert "ValueError: a bug" in str(entry["exception"])
