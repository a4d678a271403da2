"""The ``container`` provisioner's options (``[provisioners.options]``), validated once at load,
and the engine socket they name or that is found on this machine."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from hubd.errors import PluginLoadError
from hubd.units import parse_duration

__all__ = [
    "DEFAULT_COMMAND",
    "RESERVED_LABEL_PREFIX",
    "SIDECAR_ENV",
    "ContainerOptions",
    "EngineSocket",
    "find_socket",
    "parse_options",
]

DEFAULT_COMMAND: Final = ("hubd", "sidecar")
SIDECAR_ENV: Final = (
    "HUBD_URL",
    "HUBD_TOKEN",
    "HUBD_ALLOCATION_ID",
    "HUBD_SIDECAR_ID",
    "HUBD_GENERATION",
)
"""Set by hubd for every sidecar; an option cannot override them."""
RESERVED_LABEL_PREFIX: Final = "io.hubd."
_OPTIONS: Final = (
    "api_timeout",
    "binds",
    "command",
    "cpus",
    "deployment",
    "entrypoint",
    "env",
    "hub_url",
    "image",
    "inherit_env",
    "init",
    "labels",
    "memory",
    "network",
    "pids",
    "port",
    "publish_host",
    "pull",
    "runtime",
    "socket",
    "stop_timeout",
    "ulimits",
    "user",
    "workdir",
)
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SIZE: Final = re.compile(r"([0-9]+)\s*([kmgt]?)i?b?", re.IGNORECASE)
_SIZE_UNITS: Final = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_DEPLOYMENT: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# Where engines put their API socket, in the order they are tried when neither the option nor
# DOCKER_HOST names one: dockerd's, then rootful Podman's, then a user's (rootless) Podman.
_USUAL_SOCKETS: Final = ("/run/docker.sock", "/var/run/docker.sock", "/run/podman/podman.sock")


@attrs.frozen(kw_only=True)
class EngineSocket:
    """Where the engine's API is, and how it was found (said in the log at start)."""

    url: str
    found_by: str
    """``option socket``, ``DOCKER_HOST``, or ``the usual path``."""

    @property
    def display(self) -> str:
        return self.url.removeprefix("unix://")


@attrs.frozen(kw_only=True)
class ContainerOptions:
    """The validated options of one ``container`` provisioner."""

    socket: EngineSocket
    image: str
    command: tuple[str, ...] = DEFAULT_COMMAND
    entrypoint: tuple[str, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()
    inherit_env: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    network: str | None = None
    port: int | None = None
    publish_host: str = "127.0.0.1"
    hub_url: str | None = None
    user: str | None = None
    workdir: str | None = None
    memory: int | None = None
    """Bytes."""
    cpus: float | None = None
    pids: int | None = None
    ulimits: tuple[tuple[str, int, int], ...] = ()
    runtime: str | None = None
    init: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    pull: str = "if-missing"
    deployment: str
    stop_timeout: float = 5.0
    api_timeout: float = 10.0

    @property
    def binding_fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of the options that decide what runs and where: the
        engine, the deployment its containers are labelled with, and what a container is made
        of. Limits, labels, the pull policy and the timeouts are left out: they alter no
        running container, and a changed fingerprint strands every allocation bound to the
        old one."""
        binding = {
            "socket": self.socket.url,
            "deployment": self.deployment,
            "image": self.image,
            "command": list(self.command),
            "entrypoint": None if self.entrypoint is None else list(self.entrypoint),
            "env": dict(self.env),
            "inherit_env": list(self.inherit_env),
            "binds": list(self.binds),
            "network": self.network,
            "port": self.port,
            "hub_url": self.hub_url,
            "user": self.user,
            "workdir": self.workdir,
            "runtime": self.runtime,
        }
        canonical = json.dumps(binding, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()


def _bad(option: str, problem: str) -> PluginLoadError:
    return PluginLoadError(f"container provisioner option {option!r}: {problem}")


def _text(value: object, option: str, what: str = "it") -> str:
    if not isinstance(value, str):
        raise _bad(option, f"{what} must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise _bad(option, f"{what} must not contain NUL")
    return value


def _nonempty(options: Mapping[str, Any], option: str) -> str | None:
    if option not in options:
        return None
    text = _text(options[option], option).strip()
    if not text:
        raise _bad(option, "must not be empty")
    return text


def _argv(value: object, option: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise _bad(option, "must be a non-empty list of strings")
    return tuple(_text(arg, option, "every argument") for arg in value)


def _positive_int(value: object, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad(option, f"must be a positive integer, not {value!r}")
    return value


def _size(value: object, option: str) -> int:
    """Bytes, from an integer or a string such as ``"512m"`` or ``"2GiB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _positive_int(value, option)
    match = _SIZE.fullmatch(_text(value, option).strip())
    if match is None or int(match[1]) <= 0:
        raise _bad(option, f"must be a positive size such as 512m or 2g, not {value!r}")
    return int(match[1]) * _SIZE_UNITS[match[2].lower()]


def _duration(options: Mapping[str, Any], option: str, default: float) -> float:
    try:
        return parse_duration(options.get(option, default))
    except (TypeError, ValueError) as exc:
        raise _bad(option, str(exc)) from None


def _env(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise _bad("env", f"must be a table of strings, not {type(value).__name__}")
    pairs: list[tuple[str, str]] = []
    for name, text in value.items():
        _env_name(name, "env")
        pairs.append((name, _text(text, "env", f"the value of {name}")))
    return tuple(sorted(pairs))


def _env_name(name: object, option: str) -> str:
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise _bad(option, f"{name!r} is not a valid environment variable name")
    if name in SIDECAR_ENV:
        raise _bad(option, f"{name} is set by hubd for every sidecar and cannot be overridden")
    return name


def _ulimits(value: object) -> tuple[tuple[str, int, int], ...]:
    if not isinstance(value, Mapping):
        raise _bad("ulimits", "must be a table such as { nofile = [1024, 20000] }")
    limits: list[tuple[str, int, int]] = []
    for name, limit in value.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z]+", name):
            raise _bad("ulimits", f"{name!r} is not a limit name such as nofile or nproc")
        if isinstance(limit, list | tuple) and len(limit) == 2:
            soft, hard = (_positive_int(part, "ulimits") for part in limit)
        else:
            soft = hard = _positive_int(limit, "ulimits")
        if soft > hard:
            raise _bad("ulimits", f"{name}: the soft limit {soft} exceeds the hard limit {hard}")
        limits.append((name, soft, hard))
    return tuple(sorted(limits))


def _labels(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise _bad("labels", f"must be a table of strings, not {type(value).__name__}")
    pairs: list[tuple[str, str]] = []
    for name, text in value.items():
        if not isinstance(name, str) or not name:
            raise _bad("labels", f"{name!r} is not a label name")
        if name.startswith(RESERVED_LABEL_PREFIX):
            raise _bad("labels", f"labels starting with {RESERVED_LABEL_PREFIX} are hubd's own")
        pairs.append((name, _text(text, "labels", f"the value of {name}")))
    return tuple(sorted(pairs))


def _port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise _bad("port", f"must be a TCP port number (1 to 65535), not {value!r}")
    return value


def find_socket(
    written: str | None, environ: Mapping[str, str] = os.environ
) -> EngineSocket | None:
    """The engine's API socket: the option, else ``DOCKER_HOST``, else the first of the usual
    paths (and the user's rootless Podman socket) that exists; ``None`` if none does."""
    if written is not None:
        return EngineSocket(url=_socket_url(written, "socket"), found_by="option socket")
    docker_host = environ.get("DOCKER_HOST", "").strip()
    if docker_host:
        return EngineSocket(url=_socket_url(docker_host, "DOCKER_HOST"), found_by="DOCKER_HOST")
    candidates = list(_USUAL_SOCKETS)
    runtime_dir = environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        candidates += [f"{runtime_dir}/podman/podman.sock", f"{runtime_dir}/docker.sock"]
    for path in candidates:
        if Path(path).is_socket():
            return EngineSocket(url=f"unix://{path}", found_by="the usual path")
    return None


def _socket_url(text: str, where: str) -> str:
    text = text.strip()
    if text.startswith("/"):
        return f"unix://{text}"
    if re.match(r"(unix|tcp|http|https)://.", text):
        return text
    raise _bad("socket", f"{where} {text!r} is neither a socket path nor a unix:// or tcp:// URL")


def parse_options(
    options: Mapping[str, Any], *, provisioner_id: str, environ: Mapping[str, str] = os.environ
) -> ContainerOptions:
    """Validate ``[provisioners.options]``; :class:`PluginLoadError` names the bad option."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _OPTIONS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _bad(
            unknown[0],
            f"unknown option; {hint}the container provisioner takes {', '.join(_OPTIONS)}",
        )
    image = _nonempty(options, "image")
    if image is None:
        raise _bad("image", "is required: the image each sidecar's container runs")
    socket = find_socket(_nonempty(options, "socket"), environ)
    if socket is None:
        raise _bad(
            "socket",
            "not set, DOCKER_HOST is not set, and no engine socket was found at "
            + ", ".join(_USUAL_SOCKETS),
        )
    pull = options.get("pull", "if-missing")
    if pull not in ("never", "if-missing"):
        raise _bad("pull", f"must be 'never' or 'if-missing', not {pull!r}")
    deployment = _nonempty(options, "deployment") or provisioner_id
    if not _DEPLOYMENT.fullmatch(deployment):
        raise _bad("deployment", f"{deployment!r} must be letters, digits, '_', '.' or '-'")
    inherit = options.get("inherit_env", [])
    if not isinstance(inherit, list | tuple):
        raise _bad("inherit_env", "must be a list of environment variable names")
    binds = options.get("binds", [])
    if not isinstance(binds, list | tuple):
        raise _bad("binds", "must be a list of 'host:container[:options]' strings")
    for bind in binds:
        if ":" not in _text(bind, "binds", "every bind"):
            raise _bad("binds", f"{bind!r} is not 'host:container[:options]'")
    cpus = options.get("cpus")
    if cpus is not None and (
        isinstance(cpus, bool) or not isinstance(cpus, int | float) or not cpus > 0
    ):
        raise _bad("cpus", f"must be a positive number of CPUs, not {cpus!r}")
    init = options.get("init", False)
    if not isinstance(init, bool):
        raise _bad("init", "must be true or false")
    hub_url = _nonempty(options, "hub_url")
    if hub_url is not None and not re.match(r"wss?://", hub_url):
        raise _bad("hub_url", "must be a ws:// or wss:// URL (or several, comma-separated)")
    return ContainerOptions(
        socket=socket,
        image=image,
        command=_argv(options.get("command", list(DEFAULT_COMMAND)), "command"),
        entrypoint=None
        if "entrypoint" not in options
        else _argv(options["entrypoint"], "entrypoint"),
        env=_env(options.get("env", {})),
        inherit_env=tuple(_env_name(name, "inherit_env") for name in inherit),
        binds=tuple(binds),
        network=_nonempty(options, "network"),
        port=None if "port" not in options else _port(options["port"]),
        publish_host=_nonempty(options, "publish_host") or "127.0.0.1",
        hub_url=hub_url,
        user=_nonempty(options, "user"),
        workdir=_nonempty(options, "workdir"),
        memory=None if "memory" not in options else _size(options["memory"], "memory"),
        cpus=None if cpus is None else float(cpus),
        pids=None if "pids" not in options else _positive_int(options["pids"], "pids"),
        ulimits=_ulimits(options.get("ulimits", {})),
        runtime=_nonempty(options, "runtime"),
        init=init,
        labels=_labels(options.get("labels", {})),
        pull=pull,
        deployment=deployment,
        stop_timeout=_duration(options, "stop_timeout", 5.0),
        api_timeout=_duration(options, "api_timeout", 10.0),
    )
