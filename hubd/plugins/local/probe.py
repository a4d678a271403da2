"""``hubd check-config --probe`` for a ``local`` provisioner: its command can be executed as
``ensure`` would execute it, and its state directory can be written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hubd.errors import PluginError
from hubd.plugins.local.options import LocalOptions
from hubd.plugins.local.outcomes import resolve_hubd

__all__ = ["probe_command"]


def probe_command(options: LocalOptions, directory: Path) -> str:
    """One line on what was found; :class:`PluginError` naming the problem. Run as the user
    and with the ``PATH`` of the process that probes, which for a service may not be its own."""
    path = dict(options.env).get("PATH", os.environ.get("PATH", os.defpath))
    program = resolve_hubd(options.command, {"PATH": path})[0]
    if "/" in program:
        # A relative program is found from the child's working directory, as exec finds it.
        candidate = Path(options.workdir or Path.cwd()) / program
        found = str(candidate) if candidate.is_file() else None
        if found is not None and not os.access(found, os.X_OK):
            raise PluginError(f"option 'command': {program!r} is not executable")
    else:
        found = shutil.which(program, path=path)
    if found is None:
        where = "" if "/" in program else f" in PATH ({path})"
        raise PluginError(f"option 'command': {program!r} is not found{where}")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PluginError(f"the state directory {directory} cannot be made or written here")
    return f"command {found} is executable; sidecar records and logs go to {directory}"
