"""How each ``container`` option's value is read and checked, one function per kind of value.

Everything an engine would refuse at create or start is refused here instead: a value the
engine refuses fails every allocation with a retryable ``engine_error``, retried for ever,
while a value refused here stops ``hubd run`` and ``hubd check-config`` with one line naming
the option. The rules are the stricter of dockerd's and Podman's where they differ.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, Final

from hubd.errors import PluginLoadError
from hubd.units import parse_duration

__all__ = [
    "MIN_CPUS",
    "MIN_MEMORY",
    "RESERVED_LABEL_PREFIX",
    "SIDECAR_ENV",
    "absolute_path",
    "argv",
    "bad",
    "binds",
    "cpus",
    "duration",
    "env",
    "env_name",
    "hub_url",
    "image",
    "labels",
    "network",
    "nonempty",
    "port",
    "positive_int",
    "publish_host",
    "size",
    "string_table",
    "text",
    "ulimits",
]

SIDECAR_ENV: Final = (
    "HUBD_URL",
    "HUBD_TOKEN",
    "HUBD_ALLOCATION_ID",
    "HUBD_SIDECAR_ID",
    "HUBD_GENERATION",
)
"""Set by hubd for every sidecar; an option cannot override them."""
RESERVED_LABEL_PREFIX: Final = "io.hubd."
MIN_MEMORY: Final = 6 * 1024**2
"""dockerd refuses a smaller memory limit; under Podman the runtime fails to start in it."""
MIN_CPUS: Final = 0.01
"""Both engines refuse a CFS quota under 1 ms per 100 ms period."""

_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SIZE: Final = re.compile(r"([0-9]+)\s*([kmgt]?)i?b?", re.IGNORECASE)
_SIZE_UNITS: Final = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
# The limits both engines know by name (go-units' table, which both use).
_ULIMITS: Final = frozenset(
    ("core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile", "nproc",
     "rss", "rtprio", "rttime", "sigpending", "stack")
)  # fmt: skip
# A named volume or network, as both engines spell their names.
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# Bind options either engine takes (dockerd's, then Podman's own); "idmap" may carry a value.
_BIND_OPTIONS: Final = frozenset(
    ("ro", "rw", "z", "Z", "nocopy", "shared", "rshared", "slave", "rslave", "private",
     "rprivate", "consistent", "cached", "delegated",
     "O", "U", "copy", "unbindable", "runbindable", "suid", "nosuid", "dev", "nodev", "exec",
     "noexec", "bind", "rbind", "idmap")
)  # fmt: skip
# An image reference as the engines parse it (the grammar of distribution/reference): an
# optional registry host[:port], lower-case path components, then a tag and/or a digest.
_ALNUM: Final = r"[a-z0-9]+"
_PATH_COMPONENT: Final = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_COMPONENT: Final = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN: Final = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
_IMAGE: Final = re.compile(
    rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)


def bad(option: str, problem: str) -> PluginLoadError:
    return PluginLoadError(f"container provisioner option {option!r}: {problem}")


def text(value: object, option: str, what: str = "it") -> str:
    if not isinstance(value, str):
        raise bad(option, f"{what} must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise bad(option, f"{what} must not contain NUL")
    return value


def nonempty(options: Mapping[str, Any], option: str) -> str | None:
    """The option's text, stripped; ``None`` when it is not set."""
    if option not in options:
        return None
    written = text(options[option], option).strip()
    if not written:
        raise bad(option, "must not be empty")
    return written


def argv(value: object, option: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise bad(option, "must be a non-empty list of strings")
    return tuple(text(arg, option, "every argument") for arg in value)


def positive_int(value: object, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise bad(option, f"must be a positive integer, not {value!r}")
    return value


def size(value: object, option: str, minimum: int = 1) -> int:
    """Bytes, from an integer or a string such as ``"512m"`` or ``"2GiB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        found = positive_int(value, option)
    else:
        match = _SIZE.fullmatch(text(value, option).strip())
        if match is None or int(match[1]) <= 0:
            raise bad(option, f"must be a positive size such as 512m or 2g, not {value!r}")
        found = int(match[1]) * _SIZE_UNITS[match[2].lower()]
    if found < minimum:
        least = f"{minimum // 1024**2}m" if minimum % 1024**2 == 0 else f"{minimum} bytes"
        raise bad(option, f"{value!r} is less than the least the engines accept, {least}")
    return found


def cpus(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise bad("cpus", f"must be a positive number of CPUs, not {value!r}")
    if value < MIN_CPUS:
        raise bad("cpus", f"{value!r} is less than the least the engines accept, {MIN_CPUS}")
    return float(value)


def duration(options: Mapping[str, Any], option: str, default: float) -> float:
    try:
        return parse_duration(options.get(option, default))
    except (TypeError, ValueError) as exc:
        raise bad(option, str(exc)) from None


def env_name(name: object, option: str) -> str:
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise bad(option, f"{name!r} is not a valid environment variable name")
    if name in SIDECAR_ENV:
        raise bad(option, f"{name} is set by hubd for every sidecar and cannot be overridden")
    return name


def env(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise bad("env", f"must be a table of strings, not {type(value).__name__}")
    return tuple(
        sorted(
            (env_name(name, "env"), text(written, "env", f"the value of {name}"))
            for name, written in value.items()
        )
    )


def string_table(value: object, option: str) -> tuple[tuple[str, str], ...]:
    """A table of non-empty string keys to strings, as sorted pairs."""
    if not isinstance(value, Mapping):
        raise bad(option, f"must be a table of strings, not {type(value).__name__}")
    pairs: list[tuple[str, str]] = []
    for name, written in value.items():
        if not isinstance(name, str) or not name.strip() or "\x00" in name:
            raise bad(option, f"{name!r} is not a usable name")
        pairs.append((name, text(written, option, f"the value of {name}")))
    return tuple(sorted(pairs))


def labels(value: object) -> tuple[tuple[str, str], ...]:
    pairs = string_table(value, "labels")
    for name, _ in pairs:
        if name.startswith(RESERVED_LABEL_PREFIX):
            raise bad("labels", f"labels starting with {RESERVED_LABEL_PREFIX} are hubd's own")
    return pairs


def ulimits(value: object) -> tuple[tuple[str, int, int], ...]:
    if not isinstance(value, Mapping):
        raise bad("ulimits", "must be a table such as { nofile = [1024, 20000] }")
    limits: list[tuple[str, int, int]] = []
    for name, limit in value.items():
        if name not in _ULIMITS:
            known = ", ".join(sorted(_ULIMITS))
            raise bad("ulimits", f"{name!r} is not a limit the engines know: {known}")
        if isinstance(limit, list | tuple) and len(limit) == 2:
            soft, hard = (positive_int(part, "ulimits") for part in limit)
        else:
            soft = hard = positive_int(limit, "ulimits")
        if soft > hard:
            raise bad("ulimits", f"{name}: the soft limit {soft} exceeds the hard limit {hard}")
        limits.append((name, soft, hard))
    return tuple(sorted(limits))


def port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise bad("port", f"must be a TCP port number (1 to 65535), not {value!r}")
    return value


def publish_host(value: str) -> str:
    """An IP address (IPv6 with or without brackets), as the engine's ``HostIp`` takes it:
    both engines refuse a host name there."""
    address = value.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise bad("publish_host", f"{value!r} is not an IP address, such as 127.0.0.1") from None
    return address


def network(value: str) -> str:
    """``NetworkMode``: a network's name, or a mode such as ``host``, ``none``,
    ``container:NAME`` or Podman's ``ns:PATH``, ``slirp4netns`` and ``pasta``."""
    mode, _, argument = value.partition(":")
    if mode in ("container", "ns") and argument:
        return value
    if mode in ("slirp4netns", "pasta") or (not argument and _NAME.fullmatch(value)):
        return value
    raise bad("network", f"{value!r} is neither a network's name nor a network mode")


def absolute_path(value: str, option: str, what: str = "") -> str:
    if not value.startswith("/"):
        raise bad(option, f"{what}{' ' if what else ''}{value!r} must be an absolute path")
    return value


def binds(value: object) -> tuple[str, ...]:
    """``host:container[:options]`` strings, each part checked as the engines check it; kept
    as written (they are what the engine is handed)."""
    if not isinstance(value, list | tuple):
        raise bad("binds", "must be a list of 'host:container[:options]' strings")
    for bind in value:
        parts = text(bind, "binds", "every bind").split(":")
        if len(parts) not in (2, 3):
            raise bad("binds", f"{bind!r} is not 'host:container[:options]'")
        source, target = parts[0], parts[1]
        if not source.startswith("/") and not _NAME.fullmatch(source):
            raise bad(
                "binds",
                f"{bind!r}: the host side must be an absolute path or a volume's name",
            )
        absolute_path(target, "binds", f"{bind!r}: the container side")
        for flag in parts[2].split(",") if len(parts) == 3 else ():
            if flag.partition("=")[0] not in _BIND_OPTIONS:
                raise bad("binds", f"{bind!r}: {flag!r} is not a bind option the engines know")
    return tuple(value)


def image(value: str) -> str:
    if not _IMAGE.fullmatch(value):
        raise bad(
            "image",
            f"{value!r} is not an image reference such as registry.example/team/sidecar:1.4 "
            "(the repository part is lower-case)",
        )
    return value


def hub_url(value: str) -> str:
    """Comma-separated ``ws://`` or ``wss://`` URLs with a host: what the sidecar accepts in
    ``HUBD_URL`` (a sidecar refuses anything else, and would be replaced for ever)."""
    urls = [part.strip() for part in value.split(",") if part.strip()]
    for url in urls or [value]:
        try:
            parts = urllib.parse.urlsplit(url)
            usable = parts.scheme in ("ws", "wss") and bool(parts.hostname)
        except ValueError:  # a malformed port or IPv6 address
            usable = False
        if not usable:
            raise bad(
                "hub_url",
                f"{url!r} is not a ws:// or wss:// URL with a host (several are comma-separated)",
            )
    return value
