"""The ``container`` provisioner's options (``[provisioners.options]``), validated once at load,
and the engine socket they name or that is found on this machine. How each value is checked is
in :mod:`~hubd.plugins.container.values`; the confinement and log options are in
:mod:`~hubd.plugins.container.isolation`."""

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

import hubd.plugins.container.values as check
from hubd.plugins.container.isolation import OPTIONS as CONFINEMENT_OPTIONS
from hubd.plugins.container.isolation import Confinement, parse_confinement
from hubd.plugins.container.values import RESERVED_LABEL_PREFIX, SIDECAR_ENV, bad, nonempty

__all__ = [
    "DEFAULT_COMMAND",
    "OPTIONS",
    "RESERVED_LABEL_PREFIX",
    "SIDECAR_ENV",
    "ContainerOptions",
    "EngineSocket",
    "check_options",
    "find_socket",
    "parse_options",
]

DEFAULT_COMMAND: Final = ("hubd", "sidecar")
OPTIONS: Final = tuple(
    sorted(
        (
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
            *CONFINEMENT_OPTIONS,
        )
    )
)
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
    confinement: Confinement = attrs.field(factory=Confinement)
    """Capabilities, security options, read-only root, tmpfs mounts, log rotation."""

    @property
    def binding_fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of what identifies where this provisioner's sidecars
        live: the plugin and the deployment label, by which every container is found, adopted,
        listed and destroyed (the container's name comes from the sidecar id alone).

        Nothing a container is made of is in it (image, command, env, binds, limits,
        confinement): a changed fingerprint leaves every allocation bound to the old one
        unservable, releases stuck in ``releasing``, so changing the image must not change it.
        With the image changed, new sidecars get the new image and the old containers live on
        and are destroyed by name and label whatever image they run: a rolling upgrade.

        Nor is the engine's socket. The same engine is reached by several paths (a symlinked
        /var/run, DOCKER_HOST or the option, unix:// or not), and a socket fixed after a typo
        named an engine that made nothing: either way a fingerprint over it would strand rows
        whose containers the new path reaches perfectly well. The cost: pointing a deployment
        at another engine while its allocations live would leave their containers on the old
        one (the new engine has none of that name, so destroy finds nothing to remove). Moving
        engines is a deliberate act: release first, or give the new engine a new deployment.
        """
        return _digest({"plugin": "container", "deployment": self.deployment})

    @property
    def former_binding_fingerprints(self) -> tuple[str, ...]:
        """What earlier releases of this plugin computed for these very options: allocations
        bound before the fingerprint was narrowed to the deployment stay servable across the
        upgrade of hubd itself (as long as their options are unchanged until they end)."""
        return (
            _digest(
                {
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
            ),
        )


def _digest(binding: Mapping[str, Any]) -> str:
    canonical = json.dumps(binding, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


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
    raise bad("socket", f"{where} {text!r} is neither a socket path nor a unix:// or tcp:// URL")


def parse_options(
    options: Mapping[str, Any], *, provisioner_id: str, environ: Mapping[str, str] = os.environ
) -> ContainerOptions:
    """Validate ``[provisioners.options]``; :class:`PluginLoadError` names the bad option.

    Also the plugin's ``check_options`` hook (``hubd check-config``): it reads no more than
    the environment and whether a usual socket path exists."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTIONS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise bad(
            unknown[0],
            f"unknown option; {hint}the container provisioner takes {', '.join(OPTIONS)}",
        )
    image = nonempty(options, "image")
    if image is None:
        raise bad("image", "is required: the image each sidecar's container runs")
    socket = find_socket(nonempty(options, "socket"), environ)
    if socket is None:
        raise bad(
            "socket",
            "not set, DOCKER_HOST is not set, and no engine socket was found at "
            + ", ".join(_USUAL_SOCKETS),
        )
    pull = options.get("pull", "if-missing")
    if pull not in ("never", "if-missing"):
        raise bad("pull", f"must be 'never' or 'if-missing', not {pull!r}")
    deployment = nonempty(options, "deployment") or provisioner_id
    if not _DEPLOYMENT.fullmatch(deployment):
        raise bad("deployment", f"{deployment!r} must be letters, digits, '_', '.' or '-'")
    init = options.get("init", False)
    if not isinstance(init, bool):
        raise bad("init", "must be true or false")
    return ContainerOptions(
        socket=socket,
        image=check.image(image),
        pull=pull,
        deployment=deployment,
        init=init,
        **_process(options),
        **_placement(options),
        memory=None
        if "memory" not in options
        else check.size(options["memory"], "memory", check.MIN_MEMORY),
        cpus=None if options.get("cpus") is None else check.cpus(options["cpus"]),
        pids=None if "pids" not in options else check.positive_int(options["pids"], "pids"),
        ulimits=check.ulimits(options.get("ulimits", {})),
        runtime=nonempty(options, "runtime"),
        labels=check.labels(options.get("labels", {})),
        stop_timeout=check.duration(options, "stop_timeout", 5.0),
        api_timeout=check.duration(options, "api_timeout", 10.0),
        confinement=_confinement(options),
    )


def _process(options: Mapping[str, Any]) -> dict[str, Any]:
    """What the container runs, and as whom."""
    inherit = options.get("inherit_env", [])
    if not isinstance(inherit, list | tuple):
        raise bad("inherit_env", "must be a list of environment variable names")
    workdir = nonempty(options, "workdir")
    return {
        "command": check.argv(options.get("command", list(DEFAULT_COMMAND)), "command"),
        "entrypoint": None
        if "entrypoint" not in options
        else check.argv(options["entrypoint"], "entrypoint"),
        "env": check.env(options.get("env", {})),
        "inherit_env": tuple(check.env_name(name, "inherit_env") for name in inherit),
        "user": nonempty(options, "user"),
        "workdir": None
        if workdir is None
        else check.absolute_path(workdir, "workdir", "the working directory"),
    }


def _placement(options: Mapping[str, Any]) -> dict[str, Any]:
    """Where the container's sidecar reaches the hub and is reached."""
    hub_url = nonempty(options, "hub_url")
    publish_host = nonempty(options, "publish_host")
    network = nonempty(options, "network")
    return {
        "binds": check.binds(options.get("binds", [])),
        "network": None if network is None else check.network(network),
        "port": None if "port" not in options else check.port(options["port"]),
        "publish_host": "127.0.0.1" if publish_host is None else check.publish_host(publish_host),
        "hub_url": None if hub_url is None else check.hub_url(hub_url),
    }


def _confinement(options: Mapping[str, Any]) -> Confinement:
    confinement = parse_confinement(options)
    # Two mounts at one path: both engines refuse the create ("duplicate mount point").
    targets = {bind.split(":")[1] for bind in check.binds(options.get("binds", []))}
    for path, _ in confinement.tmpfs:
        if path.rstrip("/") in {target.rstrip("/") for target in targets}:
            raise bad("tmpfs", f"{path} is also a bind's container side")
    return confinement


def check_options(*, id: str, options: Mapping[str, Any]) -> None:
    """The factory's ``check_options`` hook (``hubd check-config``): the options parsed as
    :func:`~hubd.plugins.container.provisioner.create` parses them, nothing built."""
    parse_options(options, provisioner_id=id)
