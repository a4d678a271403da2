"""``hubd check-config`` checks every provisioner's options through the plugin's own parser
(the factory's ``check_options`` hook), so a bad option stops the pre-flight exactly as it
stops ``hubd run``; ``--probe`` builds each provisioner and asks it whether it can make
sidecars here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from hubd.config import ProvisionerConfig
from hubd.errors import PluginLoadError
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRequest,
    EnsureRequest,
    checks_options,
)
from hubd.plugins.registry import check_options, load_provisioners
from hubd.tomlout import render_toml
from tests.clikit import Result, run_hubd

SOCKET = "/run/hubd-test/engine.sock"  # named, so never looked for: no engine is needed
IMAGE = "registry.example/team/sidecar:1.4"
HERE = "tests.test_check_config"

# The 22 bad options an operator met (issue 59), each with the option the message must name.
# Before the parser checked them, `hubd run` refused the first 17 and the last 5 reached the
# engine, failing every allocation with a retryable engine_error for ever.
BAD_CONTAINER_OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({"memroy": "512m"}, "memroy"),
    ({"cpus": -1}, "cpus"),
    ({"port": 70000}, "port"),
    ({"socket": "run/podman/podman.sock"}, "socket"),
    ({"env": {"HUBD_TOKEN": "mine"}}, "env"),
    ({"image": "  "}, "image"),
    ({"memory": "lots"}, "memory"),
    ({"pids": 0}, "pids"),
    ({"pull": "always"}, "pull"),
    ({"deployment": "my deployment"}, "deployment"),
    ({"inherit_env": ["HUBD_URL"]}, "inherit_env"),
    ({"binds": ["/srv/data"]}, "binds"),
    ({"ulimits": {"nofile": [4096, 1024]}}, "ulimits"),
    ({"labels": {"io.hubd.sidecar-id": "mine"}}, "labels"),
    ({"hub_url": "http://hub.example:8765"}, "hub_url"),
    ({"init": "yes"}, "init"),
    ({"stop_timeout": "soon"}, "stop_timeout"),
    # Reached the engine: Podman answered 500 "invalid IP address", runc "Cwd must be an
    # absolute path", "invalid ulimit type", "invalid container path", and runc could not set
    # a 1 KiB memory limit (dockerd refuses anything under 6 MiB).
    ({"port": 8080, "network": "bridge", "publish_host": "localhost"}, "publish_host"),
    ({"workdir": "srv"}, "workdir"),
    ({"ulimits": {"nofiles": 1024}}, "ulimits"),
    ({"binds": ["/srv/data:data"]}, "binds"),
    ({"memory": "1k"}, "memory"),
]


def container_config(tmp_path: Path, **options: Any) -> Path:
    values = {"socket": SOCKET, "image": IMAGE, **options}
    document = {"provisioners": [{"id": "box", "plugin": "container", "options": values}]}
    path = tmp_path / "hubd.toml"
    path.write_text(render_toml(document))
    return path


def check(path: Path, *args: str) -> Result:
    return run_hubd("check-config", "--config", str(path), *args)


@pytest.mark.parametrize(
    ("options", "option"),
    BAD_CONTAINER_OPTIONS,
    ids=[f"{i + 1:02}-{option}" for i, (_, option) in enumerate(BAD_CONTAINER_OPTIONS)],
)
def test_bad_container_option_exits_2_naming_it(
    tmp_path: Path, options: dict[str, Any], option: str
) -> None:
    """Each of the 22 exits 2 with one line naming the provisioner and the option, and prints
    no configuration."""
    result = check(container_config(tmp_path, **options))
    assert result.code == 2, result
    assert result.out == ""
    (line,) = result.err.splitlines()
    assert line.startswith("hubd: provisioner 'box': container provisioner option ")
    assert f"option {option!r}" in line


@pytest.mark.parametrize(("options", "option"), BAD_CONTAINER_OPTIONS)
def test_hubd_run_refuses_the_same(tmp_path: Path, options: dict[str, Any], option: str) -> None:
    """``hubd run`` builds its provisioners with the same parser: each is refused at start."""
    values = {"socket": SOCKET, "image": IMAGE, **options}
    with pytest.raises(PluginLoadError, match=f"option {option!r}"):
        load_provisioners(
            [ProvisionerConfig(id="box", plugin="container", options=values)], state_dir=tmp_path
        )


def test_good_container_options_are_checked(tmp_path: Path) -> None:
    """Valid options pass, and the output says which provisioners' options were checked."""
    path = container_config(
        tmp_path,
        cap_drop=["ALL"],
        read_only=True,
        tmpfs={"/scratch": "size=64m,mode=1777"},
        log_max_size="10m",
        log_max_files=3,
    )
    result = check(path)
    assert result.code == 0, result.err
    assert "# provisioner options checked by their plugin: box" in result.out


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"comand": ["hubd", "sidecar"]}, "comand"),
        ({"command": []}, "command"),
        ({"env": {"HUBD_TOKEN": "mine"}}, "env"),
        ({"grace": "soon"}, "grace"),
        ({"workdir": "/nonexistent/hubd-test"}, "workdir"),
    ],
)
def test_bad_local_option_exits_2_naming_it(
    tmp_path: Path, options: dict[str, Any], option: str
) -> None:
    document = {"provisioners": [{"id": "here", "plugin": "local", "options": options}]}
    path = tmp_path / "hubd.toml"
    path.write_text(render_toml(document))
    result = check(path)
    assert result.code == 2, result
    assert result.err.startswith(f"hubd: provisioner 'here': local provisioner option {option!r}")


# -- the hook itself: factories referenced as "tests.test_check_config:<name>" ---------------


class Minimal:
    api_version = "1"
    binding_fingerprint = "fp"

    def __init__(self, id: str) -> None:
        self.id = id

    async def ensure(self, request: EnsureRequest) -> Accepted:
        return Accepted(None)

    async def destroy(self, request: DestroyRequest) -> Destroyed:
        return Destroyed()


def _refuse_colour(*, id: str, options: dict[str, Any]) -> None:
    if options.get("colour") != "blue":
        raise ValueError(f"option 'colour' must be blue, not {options.get('colour')!r}")


@checks_options(_refuse_colour)
def checked_factory(*, id: str, options: dict[str, Any], state_dir: Path) -> Minimal:
    raise AssertionError("check-config never calls the factory without --probe")


def unchecked_factory(*, id: str, options: dict[str, Any], state_dir: Path) -> Minimal:
    return Minimal(id)


class TestHook:
    def test_refusal_names_the_provisioner_and_plugin(self) -> None:
        """Whatever the hook raises is one PluginLoadError starting with the provisioner."""
        configs = [ProvisionerConfig(id="k", plugin=f"{HERE}:checked_factory", options={})]
        with pytest.raises(PluginLoadError) as caught:
            check_options(configs)
        assert str(caught.value).startswith(
            f"provisioner 'k': plugin '{HERE}:checked_factory' refused its options: ValueError: "
            "option 'colour' must be blue"
        )

    def test_says_which_options_were_checked(self, tmp_path: Path) -> None:
        """A plugin without the hook loads as before, and the output says its options were not
        checked; the factory is not called."""
        document = {
            "provisioners": [
                {"id": "a", "plugin": f"{HERE}:checked_factory", "options": {"colour": "blue"}},
                {"id": "b", "plugin": f"{HERE}:unchecked_factory"},
            ]
        }
        path = tmp_path / "hubd.toml"
        path.write_text(render_toml(document))
        result = check(path)
        assert result.code == 0, result.err
        assert "# provisioner options checked by their plugin: a\n" in result.out
        assert "# provisioner options not checked (their plugin has no check_options): b" in (
            result.out
        )


class TestProbe:
    def test_local_command_missing_exits_2(self, tmp_path: Path) -> None:
        """--probe builds the provisioner and asks it: a local command that is not there exits
        2 naming the option, where check-config alone passes."""
        document = {
            "state": {"dir": str(tmp_path / "state")},
            "provisioners": [
                {"id": "here", "plugin": "local", "options": {"command": ["hubd-absent-x"]}}
            ],
        }
        path = tmp_path / "hubd.toml"
        path.write_text(render_toml(document))
        assert check(path).code == 0
        result = check(path, "--probe")
        assert result.code == 2, result
        assert result.out == ""
        assert "hubd: provisioner 'here': probe: option 'command': 'hubd-absent-x'" in result.err

    def test_local_command_found(self, tmp_path: Path) -> None:
        document = {
            "state": {"dir": str(tmp_path / "state")},
            "provisioners": [
                {"id": "here", "plugin": "local", "options": {"command": [sys.executable]}},
                {"id": "other", "plugin": f"{HERE}:unchecked_factory"},
            ],
        }
        path = tmp_path / "hubd.toml"
        path.write_text(render_toml(document))
        result = check(path, "--probe")
        assert result.code == 0, result.err
        assert f"# probe here: command {sys.executable} is executable" in result.out
        assert "# probe other: not probed: its plugin has no probe" in result.out

    def test_engine_unreachable_exits_2_naming_the_socket(self, tmp_path: Path) -> None:
        result = check(container_config(tmp_path, socket=str(tmp_path / "gone.sock")), "--probe")
        assert result.code == 2, result
        assert "hubd: provisioner 'box': probe: container engine at " in result.err
        assert f"{tmp_path / 'gone.sock'} (option socket) is unreachable" in result.err
