"""The built-in ``container`` provisioner: one container per sidecar, through the Docker Engine
API (dockerd, or Podman's compatible service). Needs the ``containers`` extra (aiodocker).

Options (``[provisioners.options]``; docs/plugins.md has the table)::

    image = "registry.example/sidecar:1"   # required
    socket = "/run/podman/podman.sock"     # default: DOCKER_HOST, then the usual paths
    command = ["hubd", "sidecar"]          # the container's Cmd
    env = { NAME = "value" }               # its environment, besides hubd's five HUBD_*
    binds = ["/opt/hubd:/opt/hubd:ro"]
    network = "host"
    port = 8080                            # published; its host address is the endpoint
    memory = "512m"   cpus = 1.5   pids = 256   runtime = "runsc"   user = "1000:1000"
    pull = "if-missing"                    # or "never": a missing image fails the allocation
    cap_drop = ["ALL"]   read_only = true   tmpfs = { "/tmp" = "size=64m" }
    security_opt = ["apparmor=sidecar"]    # no-new-privileges too, unless an entry names it
    log_max_size = "10m"   log_max_files = 3

Identity and fencing. A sidecar's container is named ``hubd-<sidecar_id>`` and labelled with
the deployment (``io.hubd.deployment``), the provisioner, the allocation, the generation and
the sidecar id. The engine refuses a second container of one name (409 from dockerd, 500 "already
in use" from Podman), so a retried or concurrent ``ensure`` — from this process or another —
meets the first container and adopts it; a container of that name labelled for another
allocation or generation is removed and replaced, and one without this deployment's label is
never touched. The labels are the whole state: a restarted hubd finds, adopts and destroys
what an earlier one created, and the orphan sweep lists containers by the deployment label.
``ownership.still_owned()`` is checked right before every create, start, stop and remove.
The binding fingerprint is the deployment (:attr:`ContainerOptions.binding_fingerprint` says
why): changing the image is a rolling upgrade, never a stranded allocation.

Besides ``ensure`` and ``destroy``: ``list_sidecars`` (the orphan sweep's listing),
``watch_sidecars`` (deaths, from the engine's events: :mod:`~hubd.plugins.container.watch`),
``sidecar_output`` (a container's logs: :mod:`~hubd.plugins.container.output`) and ``probe``
(``hubd check-config --probe``). A container that cannot run as configured is a final rejection
(:mod:`~hubd.plugins.container.failures`), with nothing left on the engine.

The token goes into the container's environment only: never into a label, its command line, a
log line, an error message or the ledger (engine messages and log tails are scrubbed of it).
"""

from __future__ import annotations

try:
    import aiodocker  # noqa: F401 -- only to say what is missing, in one clear line
except ImportError as exc:  # pragma: no cover - depends on the installation
    from hubd.errors import PluginLoadError

    raise PluginLoadError(
        "the container provisioner needs aiodocker: install hubd with the 'containers' extra "
        "(pip install 'hubd[containers]')"
    ) from exc

from hubd.plugins.container.options import ContainerOptions, EngineSocket, parse_options
from hubd.plugins.container.provisioner import API_VERSION, SETTLE, ContainerProvisioner, create

__all__ = [
    "API_VERSION",
    "SETTLE",
    "ContainerOptions",
    "ContainerProvisioner",
    "EngineSocket",
    "create",
    "parse_options",
]
