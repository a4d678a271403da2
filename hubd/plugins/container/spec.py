"""What a sidecar's container is, as plain values: its name, its labels, the body of the create
call, and what an inspected or listed container says about whose it is. No I/O here."""

from __future__ import annotations

import enum
import os
import re
import socket
from collections.abc import Mapping
from typing import Any, Final

from hubd.plugins.container.options import ContainerOptions
from hubd.plugins.protocol import EnsureRequest, RunningSidecar

__all__ = [
    "LABEL_ALLOCATION",
    "LABEL_DEPLOYMENT",
    "LABEL_GENERATION",
    "LABEL_PROVISIONER",
    "LABEL_SIDECAR",
    "SIDECAR_ID",
    "Kinship",
    "container_name",
    "create_body",
    "endpoint_of",
    "external_ref",
    "kinship",
    "running_sidecar",
    "token_of",
]

LABEL_ALLOCATION: Final = "io.hubd.allocation-id"
LABEL_GENERATION: Final = "io.hubd.generation"
LABEL_SIDECAR: Final = "io.hubd.sidecar-id"
LABEL_DEPLOYMENT: Final = "io.hubd.deployment"
LABEL_PROVISIONER: Final = "io.hubd.provisioner"
# Sidecar ids become container names: [a-zA-Z0-9][a-zA-Z0-9_.-]* is what both engines accept.
SIDECAR_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_PREFIX: Final = "hubd-"
_TOKEN_VARIABLE: Final = "HUBD_TOKEN"  # noqa: S105 -- its name, as create_body sets it
_ANY_ADDRESS: Final = ("0.0.0.0", "::", "[::]")  # noqa: S104 -- compared with, never bound


def container_name(sidecar_id: str) -> str:
    """The container's name: one per sidecar id, so a retried ``ensure`` (from any process)
    meets the container an earlier one created, and the engine refuses a second."""
    return f"{_PREFIX}{sidecar_id}"


def external_ref(container_id: str) -> str:
    # Twelve digits, as the engines' CLIs show them: a full id is 64 hex digits, which the
    # log scrubber takes for a secret.
    return f"container:{container_id[:12]}"


def labels_for(
    options: ContainerOptions, provisioner_id: str, request: EnsureRequest
) -> dict[str, str]:
    return {
        **dict(options.labels),
        LABEL_DEPLOYMENT: options.deployment,
        LABEL_PROVISIONER: provisioner_id,
        LABEL_ALLOCATION: request.allocation_id,
        LABEL_GENERATION: str(request.generation),
        LABEL_SIDECAR: request.sidecar_id,
    }


def create_body(
    options: ContainerOptions,
    provisioner_id: str,
    request: EnsureRequest,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, Any]:
    """The ``POST /containers/create`` body. It holds the token (in ``Env``): never log it."""
    env = {name: environ[name] for name in options.inherit_env if name in environ}
    env.update(options.env)
    env.update(
        HUBD_URL=options.hub_url or request.hub_ws_url,
        HUBD_TOKEN=request.token,
        HUBD_ALLOCATION_ID=request.allocation_id,
        HUBD_SIDECAR_ID=request.sidecar_id,
        HUBD_GENERATION=str(request.generation),
    )
    host: dict[str, Any] = {"Binds": list(options.binds), "Init": options.init}
    body: dict[str, Any] = {
        "Image": options.image,
        "Cmd": list(options.command),
        "Env": [f"{name}={value}" for name, value in env.items()],
        "Labels": labels_for(options, provisioner_id, request),
        # Ends the sidecar's stdin at once, so nothing waits on a terminal.
        "OpenStdin": False,
        "Tty": False,
        "HostConfig": host,
    }
    if options.entrypoint is not None:
        body["Entrypoint"] = list(options.entrypoint)
    if options.user is not None:
        body["User"] = options.user
    if options.workdir is not None:
        body["WorkingDir"] = options.workdir
    if options.network is not None:
        host["NetworkMode"] = options.network
    if options.port is not None and options.network != "host":
        key = f"{options.port}/tcp"
        body["ExposedPorts"] = {key: {}}
        bind_ip = "" if options.publish_host in _ANY_ADDRESS else options.publish_host
        # HostPort "": the engine picks a free port, which inspect then reports.
        host["PortBindings"] = {key: [{"HostIp": bind_ip, "HostPort": ""}]}
    if options.memory is not None:
        host["Memory"] = options.memory
    if options.cpus is not None:
        host["NanoCpus"] = round(options.cpus * 1e9)
    if options.pids is not None:
        host["PidsLimit"] = options.pids
    if options.ulimits:
        host["Ulimits"] = [
            {"Name": name, "Soft": soft, "Hard": hard} for name, soft, hard in options.ulimits
        ]
    if options.runtime is not None:
        host["Runtime"] = options.runtime
    host.update(options.confinement.host_config())
    return body


class Kinship(enum.Enum):
    """Whose a container by a sidecar's name is, judged from its labels."""

    OURS = "ours"
    """This deployment's container for this very sidecar (allocation, generation, id)."""
    STALE = "stale"
    """This deployment's, by this sidecar's name, but labelled for another allocation or
    generation: left by something that must not be adopted; replaced."""
    FOREIGN = "foreign"
    """Not this deployment's: never touched."""


def kinship(labels: Mapping[str, str] | None, deployment: str, request: EnsureRequest) -> Kinship:
    labels = labels or {}
    if labels.get(LABEL_DEPLOYMENT) != deployment or LABEL_SIDECAR not in labels:
        return Kinship.FOREIGN
    same = (
        labels.get(LABEL_SIDECAR) == request.sidecar_id
        and labels.get(LABEL_ALLOCATION) == request.allocation_id
        and labels.get(LABEL_GENERATION) == str(request.generation)
    )
    return Kinship.OURS if same else Kinship.STALE


def is_ours(labels: Mapping[str, str] | None, deployment: str, sidecar_id: str) -> bool:
    """Whether ``destroy`` may remove the container: this deployment's, for that sidecar."""
    labels = labels or {}
    return labels.get(LABEL_DEPLOYMENT) == deployment and labels.get(LABEL_SIDECAR) == sidecar_id


def running_sidecar(listed: Mapping[str, Any]) -> RunningSidecar | None:
    """A listed container (``GET /containers/json``) as the orphan sweep sees it, or ``None``
    when its labels do not name a sidecar."""
    labels = listed.get("Labels") or {}
    sidecar_id = labels.get(LABEL_SIDECAR)
    if not isinstance(sidecar_id, str) or not SIDECAR_ID.fullmatch(sidecar_id):
        return None
    generation_text = labels.get(LABEL_GENERATION, "")
    generation = int(generation_text) if str(generation_text).isdigit() else None
    container_id = listed.get("Id")
    return RunningSidecar(
        sidecar_id=sidecar_id,
        allocation_id=labels.get(LABEL_ALLOCATION) or None,
        generation=generation,
        external_ref=external_ref(container_id) if isinstance(container_id, str) else None,
    )


def token_of(inspected: Mapping[str, Any]) -> str | None:
    """The sidecar's token, from an inspected container's environment: what its output is
    scrubbed of. Never logged, never put in a message."""
    for item in (inspected.get("Config") or {}).get("Env") or ():
        if isinstance(item, str) and item.startswith(f"{_TOKEN_VARIABLE}="):
            return item.removeprefix(f"{_TOKEN_VARIABLE}=") or None
    return None


def endpoint_of(options: ContainerOptions, inspected: Mapping[str, Any]) -> str | None:
    """``host:port`` where the sidecar's published port is reached, or ``None`` (no port
    option, or the engine reported no binding)."""
    if options.port is None:
        return None
    host = options.publish_host
    if host in _ANY_ADDRESS:
        host = socket.gethostname()
    if options.network == "host":
        return f"{_bracketed(host)}:{options.port}"
    ports = (inspected.get("NetworkSettings") or {}).get("Ports") or {}
    for binding in ports.get(f"{options.port}/tcp") or ():
        host_port = str(binding.get("HostPort") or "")
        if host_port.isdigit():
            return f"{_bracketed(host)}:{host_port}"
    return None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
