"""The collector's pace in the daemon's process (see hubd.daemon.collector)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import ClassVar

import pytest

import hubd.cli
from hubd.config import Config
from hubd.daemon.collector import YOUNG_THRESHOLD


class DaemonSeeingTheCollector:
    """Stands in for the daemon the command starts: it only notes the collector's thresholds
    while it runs."""

    seen: ClassVar[list[tuple[int, int, int]]] = []

    def __init__(self, config: Config) -> None:
        self.config = config

    async def run(self) -> int:
        DaemonSeeingTheCollector.seen.append(gc.get_threshold())
        return 0


@pytest.mark.usefixtures("process_settings")
def test_hubd_run_collects_the_young_generation_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hubd run`` paces the young generation before the daemon starts; the older
    generations keep their thresholds."""
    monkeypatch.setattr("hubd.daemon.service.Daemon", DaemonSeeingTheCollector)
    DaemonSeeingTheCollector.seen.clear()
    config = tmp_path / "hubd.toml"
    config.write_text(
        f'[database]\nurl = "postgresql://localhost/hubd"\n[state]\ndir = "{tmp_path}"\n'
    )
    assert hubd.cli.main(["run", "--config", str(config)]) == 0
    assert DaemonSeeingTheCollector.seen == [(YOUNG_THRESHOLD, 10, 10)]


@pytest.mark.usefixtures("process_settings")
def test_other_commands_keep_the_default_pace(tmp_path: Path) -> None:
    config = tmp_path / "hubd.toml"
    config.write_text(
        f'[database]\nurl = "postgresql://localhost/hubd"\n[state]\ndir = "{tmp_path}"\n'
    )
    assert hubd.cli.main(["check-config", "--config", str(config)]) == 0
    assert gc.get_threshold() == (700, 10, 10)
