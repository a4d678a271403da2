"""The daemon's event loop is the one ``[runtime] event_loop`` names (see hubd.daemon.loops)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import ClassVar

import pytest

import hubd.cli
from hubd.config import Config

pytestmark = pytest.mark.usefixtures("process_settings")


class DaemonSeeingItsLoop:
    """Stands in for the daemon the command starts: it only notes the loop it runs on."""

    seen: ClassVar[list[str]] = []

    def __init__(self, config: Config) -> None:
        self.config = config

    async def run(self) -> int:
        DaemonSeeingItsLoop.seen.append(type(asyncio.get_running_loop()).__module__)
        return 0


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr("hubd.daemon.service.Daemon", DaemonSeeingItsLoop)
    DaemonSeeingItsLoop.seen.clear()
    return DaemonSeeingItsLoop.seen


def _config(tmp_path: Path, runtime: str) -> str:
    path = tmp_path / "hubd.toml"
    path.write_text(
        f'[database]\nurl = "postgresql://localhost/hubd"\n[state]\ndir = "{tmp_path}"\n' + runtime
    )
    return str(path)


@pytest.mark.parametrize(
    ("runtime", "module"),
    [
        ("", "uvloop"),
        ('[runtime]\nevent_loop = "uvloop"\n', "uvloop"),
        ('[runtime]\nevent_loop = "asyncio"\n', "asyncio"),
    ],
)
def test_hubd_run_runs_on_the_configured_loop(
    tmp_path: Path, stand_in: list[str], runtime: str, module: str
) -> None:
    assert hubd.cli.main(["run", "--config", _config(tmp_path, runtime)]) == 0
    assert [name.partition(".")[0] for name in stand_in] == [module]


def test_uvloop_missing_stops_hubd_run_with_a_config_error(
    tmp_path: Path,
    stand_in: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A host where uvloop cannot be imported gets exit 2 and the way out, not a traceback;
    nothing starts."""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what a failed import leaves
    assert hubd.cli.main(["run", "--config", _config(tmp_path, "")]) == 2
    error = capsys.readouterr().err
    assert "runtime.event_loop" in error
    assert 'event_loop = "asyncio"' in error
    assert stand_in == []
