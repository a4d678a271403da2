"""``hubd check-config --probe`` for a ``container`` provisioner: what the engine at its socket
says about the options, asked without creating anything."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from hubd.errors import PluginError
from hubd.plugins.container.engine import open_session
from hubd.plugins.container.options import ContainerOptions

__all__ = ["probe_engine"]

# Network modes that name no network object the engine could lack.
_BUILT_IN_NETWORKS: Final = frozenset({"host", "bridge", "none", "default", "private"})


def _engine_name(version: Mapping[str, Any]) -> str:
    for component in version.get("Components") or ():
        name = str(component.get("Name", ""))
        if name in ("Podman Engine", "Engine"):
            kind = "Podman" if name.startswith("Podman") else "Docker"
            return f"{kind} {component.get('Version')}"
    return f"an engine of version {version.get('Version', '?')}"


def _engine_specific(options: ContainerOptions, *, podman: bool) -> str | None:
    """What one engine takes and the other refuses at create, which only the engine's kind
    tells apart."""
    confinement = options.confinement
    if podman and confinement.log_driver == "local":
        return "log_driver 'local' is dockerd's: Podman has k8s-file (its json-file) and journald"
    for entry in confinement.security_opt:
        profile = entry.partition("=")[2] if entry.startswith("seccomp=") else ""
        if podman and profile.startswith("{"):
            return "security_opt seccomp: Podman takes the path of a profile, not its JSON"
        if not podman and profile.startswith("/"):
            return "security_opt seccomp: dockerd takes the profile's JSON, not its path"
    return None


async def probe_engine(options: ContainerOptions) -> str:
    """One line on what was found; :class:`PluginError` naming the first problem: the engine
    does not answer, the image is missing where ``pull = "never"``, the network does not exist,
    the ``runtime`` is unknown or ignored, an option this kind of engine refuses, more ``cpus``
    than the engine's host has."""
    where = options.socket.display
    async with open_session(options.socket, api_timeout=options.api_timeout) as engine:
        version = await engine.version()
        info = await engine.info()
        found = [f"{_engine_name(version)} answers at {where} ({options.socket.found_by})"]
        podman = "Podman" in found[0]
        if await engine.image_present(options.image):
            found.append(f"image {options.image} is there")
        elif options.pull == "never":
            raise PluginError(
                f'image {options.image!r} is not on the engine at {where} and pull = "never": '
                "every allocation would fail with image_not_found"
            )
        else:
            found.append(f"image {options.image} is not there yet: the first sidecar pulls it")
        network = options.network
        if (
            network is not None
            and network not in _BUILT_IN_NETWORKS
            and ":" not in network
            and not await engine.network_present(network)
        ):
            raise PluginError(f"network {network!r} does not exist on the engine at {where}")
        runtime = options.runtime
        if runtime is not None and podman:
            raise PluginError(
                f"runtime {runtime!r}: Podman's Docker-compatible API at {where} ignores a "
                "container's runtime; make it the service's default (containers.conf) and "
                "leave the option unset"
            )
        if runtime is not None and runtime not in (info.get("Runtimes") or {}):
            raise PluginError(f"runtime {runtime!r} is not one the engine at {where} knows")
        problem = _engine_specific(options, podman=podman)
        if problem is not None:
            raise PluginError(problem)
        host_cpus = info.get("NCPU")
        if options.cpus is not None and isinstance(host_cpus, int) and options.cpus > host_cpus:
            raise PluginError(
                f"cpus = {options.cpus:g} is more than the engine's host has ({host_cpus})"
            )
        return "; ".join(found)
