"""The ``local`` provisioner's options (``[provisioners.options]``), validated once at load."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from hubd.errors import PluginLoadError
from hubd.units import parse_duration

__all__ = [
    "DEFAULT_COMMAND",
    "DEFAULT_GRACE",
    "SIDECAR_ENV",
    "LocalOptions",
    "check_options",
    "parse_options",
]

DEFAULT_COMMAND: Final = ("hubd", "sidecar")
DEFAULT_GRACE: Final = 5.0
_OPTIONS: Final = ("command", "env", "grace", "workdir")
SIDECAR_ENV: Final = (
    "HUBD_URL",
    "HUBD_TOKEN",
    "HUBD_ALLOCATION_ID",
    "HUBD_SIDECAR_ID",
    "HUBD_GENERATION",
)
"""Set by hubd for every sidecar; an option cannot override them."""
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@attrs.frozen(kw_only=True)
class LocalOptions:
    """The validated options of one ``local`` provisioner."""

    command: tuple[str, ...] = DEFAULT_COMMAND
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment, as sorted pairs so equal options compare and hash equal."""
    grace: float = DEFAULT_GRACE
    workdir: Path | None = None

    @property
    def binding_fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of what identifies where this provisioner's sidecars
        live: the plugin alone. Its sidecars are processes of this host, found again by the
        records in its state directory, whatever command started them.

        Nothing a sidecar is made of is in it (command, env, workdir, grace): a changed
        fingerprint leaves every allocation bound to the old one unservable, releases stuck
        in ``releasing``. With the command changed, new sidecars run the new command and the
        old processes live on and are destroyed by their records: a rolling upgrade.
        """
        return _digest({"plugin": "local"})

    @property
    def former_binding_fingerprints(self) -> tuple[str, ...]:
        """What earlier releases of this plugin computed for these very options (over the
        command, env and workdir): allocations bound before the fingerprint was narrowed stay
        servable across the upgrade of hubd itself."""
        return (
            _digest(
                {
                    "command": list(self.command),
                    "env": dict(self.env),
                    "workdir": None if self.workdir is None else str(self.workdir),
                }
            ),
        )


def _digest(binding: Mapping[str, Any]) -> str:
    canonical = json.dumps(binding, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _bad(option: str, problem: str) -> PluginLoadError:
    return PluginLoadError(f"local provisioner option {option!r}: {problem}")


def _text(value: object, option: str, what: str) -> str:
    if not isinstance(value, str):
        raise _bad(option, f"{what} must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise _bad(option, f"{what} must not contain NUL")
    return value


def parse_options(options: Mapping[str, Any]) -> LocalOptions:
    """Validate ``[provisioners.options]``; :class:`PluginLoadError` names the bad option."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _OPTIONS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _bad(
            unknown[0], f"unknown option; {hint}the local provisioner takes {', '.join(_OPTIONS)}"
        )

    command = options.get("command", list(DEFAULT_COMMAND))
    if not isinstance(command, list | tuple) or not command:
        raise _bad("command", "must be a non-empty list of strings")
    argv = tuple(_text(arg, "command", "every argument") for arg in command)
    if not argv[0]:
        raise _bad("command", "the program (first element) must not be empty")

    env = options.get("env", {})
    if not isinstance(env, Mapping):
        raise _bad("env", f"must be a table of strings, not {type(env).__name__}")
    pairs: list[tuple[str, str]] = []
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise _bad("env", f"{name!r} is not a valid environment variable name")
        if name in SIDECAR_ENV:
            raise _bad("env", f"{name} is set by hubd for every sidecar and cannot be overridden")
        pairs.append((name, _text(value, "env", f"the value of {name}")))

    grace_value = options.get("grace", DEFAULT_GRACE)
    try:
        grace = parse_duration(grace_value)
    except (TypeError, ValueError) as exc:
        raise _bad("grace", str(exc)) from None

    workdir: Path | None = None
    if "workdir" in options:
        text = _text(options["workdir"], "workdir", "it")
        if not text:
            raise _bad("workdir", "must not be empty")
        workdir = Path(text).expanduser().absolute()
        if not workdir.is_dir():
            raise _bad("workdir", f"{str(workdir)!r} is not a directory")

    return LocalOptions(command=argv, env=tuple(sorted(pairs)), grace=grace, workdir=workdir)


def check_options(*, id: str, options: Mapping[str, Any]) -> None:
    """The factory's ``check_options`` hook (``hubd check-config``): the options parsed as the
    factory parses them, nothing started."""
    del id
    parse_options(options)
