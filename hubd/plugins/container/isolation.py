"""The ``container`` options that confine a sidecar's container and bound its logs:
capabilities, security options, a read-only root filesystem, tmpfs mounts and log rotation,
checked once at load and turned into the create call's ``HostConfig``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import attrs

from hubd.plugins.container.values import (
    absolute_path,
    bad,
    positive_int,
    size,
    string_table,
    text,
)

__all__ = ["DEFAULT_SECURITY_OPT", "OPTIONS", "Confinement", "parse_confinement"]

OPTIONS: Final = (
    "cap_add",
    "cap_drop",
    "log_driver",
    "log_max_files",
    "log_max_size",
    "log_options",
    "read_only",
    "security_opt",
    "tmpfs",
)
NO_NEW_PRIVILEGES: Final = "no-new-privileges"
DEFAULT_SECURITY_OPT: Final = (NO_NEW_PRIVILEGES,)
"""What every container gets unless ``security_opt`` says ``no-new-privileges=false``: a
sidecar never needs to gain privileges through a setuid binary, and a compromised one could."""

# Linux's capabilities (capability(7)), as both engines name them without the CAP_ prefix.
_CAPABILITIES: Final = frozenset(
    ("AUDIT_CONTROL", "AUDIT_READ", "AUDIT_WRITE", "BLOCK_SUSPEND", "BPF", "CHECKPOINT_RESTORE",
     "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "IPC_LOCK", "IPC_OWNER",
     "KILL", "LEASE", "LINUX_IMMUTABLE", "MAC_ADMIN", "MAC_OVERRIDE", "MKNOD", "NET_ADMIN",
     "NET_BIND_SERVICE", "NET_BROADCAST", "NET_RAW", "PERFMON", "SETFCAP", "SETGID", "SETPCAP",
     "SETUID", "SYSLOG", "SYS_ADMIN", "SYS_BOOT", "SYS_CHROOT", "SYS_MODULE", "SYS_NICE",
     "SYS_PACCT", "SYS_PTRACE", "SYS_RAWIO", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG",
     "WAKE_ALARM")
)  # fmt: skip
# Security options either engine takes, by key (Podman's mask, unmask and proc-opts too).
_SECURITY_KEYS: Final = frozenset(
    ("no-new-privileges", "seccomp", "apparmor", "label", "systempaths", "writable-cgroups",
     "mask", "unmask", "proc-opts")
)  # fmt: skip
_SECURITY_OPT: Final = re.compile(r"(?P<key>[a-z-]+)(?:[=:](?P<value>.*))?", re.DOTALL)
# tmpfs mount options either engine takes; size, mode, uid, gid and nr_* carry a value.
_TMPFS_FLAGS: Final = frozenset(
    ("rw", "ro", "exec", "noexec", "suid", "nosuid", "dev", "nodev", "atime", "noatime",
     "relatime", "norelatime", "strictatime", "nostrictatime", "diratime", "nodiratime", "sync",
     "async", "dirsync", "tmpcopyup", "notmpcopyup", "U", "private", "rprivate", "shared",
     "rshared", "slave", "rslave", "unbindable", "runbindable")
)  # fmt: skip
_TMPFS_VALUES: Final = {
    "size": re.compile(r"[0-9]+[kmgKMG]?"),  # dockerd reads it as a size: no "50%"
    "mode": re.compile(r"[0-7]{3,4}"),
    "uid": re.compile(r"[0-9]+"),
    "gid": re.compile(r"[0-9]+"),
    "nr_inodes": re.compile(r"[0-9]+[kmgKMG]?"),
    "nr_blocks": re.compile(r"[0-9]+[kmgKMG]?"),
}
_LOG_DRIVER: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]*")
# The drivers whose files rotate by max-size and max-file: dockerd's json-file and local, and
# Podman's k8s-file (which its compatible API also reports as json-file).
_ROTATING_DRIVERS: Final = ("json-file", "local", "k8s-file")


@attrs.frozen(kw_only=True)
class Confinement:
    """The validated confinement and log options of one ``container`` provisioner."""

    cap_add: tuple[str, ...] = ()
    cap_drop: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = DEFAULT_SECURITY_OPT
    """As sent: the operator's entries, with ``no-new-privileges`` first unless they name it."""
    read_only: bool = False
    tmpfs: tuple[tuple[str, str], ...] = ()
    """Container path → mount options, sorted."""
    log_driver: str | None = None
    log_options: tuple[tuple[str, str], ...] = ()
    """The driver's options as sent (``max-size`` and ``max-file`` included), sorted."""

    def host_config(self) -> dict[str, Any]:
        """These options' part of the create call's ``HostConfig``."""
        host: dict[str, Any] = {
            "SecurityOpt": list(self.security_opt),
            "ReadonlyRootfs": self.read_only,
        }
        if self.cap_add:
            host["CapAdd"] = list(self.cap_add)
        if self.cap_drop:
            host["CapDrop"] = list(self.cap_drop)
        if self.tmpfs:
            host["Tmpfs"] = dict(self.tmpfs)
        if self.log_driver is not None or self.log_options:
            # Type "": the engine's default driver, which takes the options as its own.
            host["LogConfig"] = {"Type": self.log_driver or "", "Config": dict(self.log_options)}
        return host


def _capabilities(options: Mapping[str, Any], option: str) -> tuple[str, ...]:
    value = options.get(option, [])
    if not isinstance(value, list | tuple):
        raise bad(option, 'must be a list of capabilities, such as ["ALL"] or ["NET_RAW"]')
    found: list[str] = []
    for written in value:
        name = text(written, option, "every capability").strip().upper().removeprefix("CAP_")
        if name != "ALL" and name not in _CAPABILITIES:
            raise bad(option, f"{written!r} is not a Linux capability (see capabilities(7))")
        if name not in found:
            found.append(name)
    return tuple(found)


def _security_opt(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise bad("security_opt", 'must be a list of strings, such as ["apparmor=my-profile"]')
    entries: list[str] = []
    for written in value:
        entry = text(written, "security_opt", "every entry").strip()
        match = _SECURITY_OPT.fullmatch(entry)
        key = None if match is None else match["key"]
        if match is None or key not in _SECURITY_KEYS:
            raise bad("security_opt", f"{entry!r} is not key=value with a key the engines know: "
                      f"{', '.join(sorted(_SECURITY_KEYS))}")  # fmt: skip
        setting = match["value"]
        if key == NO_NEW_PRIVILEGES:
            if setting not in (None, "true", "false"):
                raise bad("security_opt", f"{entry!r}: no-new-privileges is true or false")
        elif not setting:
            raise bad("security_opt", f"{entry!r} needs a value after '='")
        elif key == "seccomp" and not (setting == "unconfined" or setting.startswith(("{", "/"))):
            # dockerd's API takes the profile itself (JSON), Podman's a path on the engine's
            # host; a relative path is neither.
            raise bad("security_opt", f"{entry!r}: seccomp is 'unconfined', a profile's JSON "
                      "(dockerd) or an absolute path to one (Podman)")  # fmt: skip
        entries.append(entry)
    if not any(entry.startswith(NO_NEW_PRIVILEGES) for entry in entries):
        entries.insert(0, NO_NEW_PRIVILEGES)
    return tuple(entries)


def _tmpfs(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise bad("tmpfs", 'must be a table of path = "options", such as { "/tmp" = "size=64m" }')
    mounts = string_table(value, "tmpfs")
    for path, flags in mounts:
        absolute_path(path, "tmpfs", "the mount point")
        for flag in filter(None, (part.strip() for part in flags.split(","))):
            name, has_value, setting = flag.partition("=")
            pattern = _TMPFS_VALUES.get(name)
            if pattern is None and (has_value or name not in _TMPFS_FLAGS):
                raise bad("tmpfs", f"{path}: {flag!r} is not a tmpfs option the engines know")
            if pattern is not None and not pattern.fullmatch(setting):
                raise bad("tmpfs", f"{path}: {flag!r} has no valid value for {name}")
    return mounts


def _log_options(options: Mapping[str, Any]) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    driver = options.get("log_driver")
    if driver is not None and not _LOG_DRIVER.fullmatch(text(driver, "log_driver").strip()):
        raise bad("log_driver", f"{driver!r} is not a logging driver's name, such as json-file")
    driver = None if driver is None else driver.strip()
    extra = dict(string_table(options.get("log_options", {}), "log_options"))
    for key, instead in (("max-size", "log_max_size"), ("max-file", "log_max_files")):
        if key in extra:
            raise bad("log_options", f"set {key} with the option {instead}")
    rotation: dict[str, str] = {}
    if "log_max_size" in options:
        rotation["max-size"] = str(size(options["log_max_size"], "log_max_size"))
    if "log_max_files" in options:
        if not rotation:
            raise bad("log_max_files", "needs log_max_size: files are rotated by size")
        rotation["max-file"] = str(positive_int(options["log_max_files"], "log_max_files"))
    if rotation and driver not in (None, *_ROTATING_DRIVERS):
        raise bad("log_driver", f"{driver!r} does not rotate files; log_max_size and "
                  f"log_max_files work with {', '.join(_ROTATING_DRIVERS)}")  # fmt: skip
    return driver, tuple(sorted({**extra, **rotation}.items()))


def parse_confinement(options: Mapping[str, Any]) -> Confinement:
    """The confinement and log options out of ``[provisioners.options]``;
    :class:`~hubd.errors.PluginLoadError` names the bad option."""
    cap_add = _capabilities(options, "cap_add")
    cap_drop = _capabilities(options, "cap_drop")
    both = sorted(set(cap_add) & set(cap_drop))
    if both:
        raise bad("cap_add", f"{', '.join(both)} is in cap_drop too")
    read_only = options.get("read_only", False)
    if not isinstance(read_only, bool):
        raise bad("read_only", "must be true or false")
    driver, log_options = _log_options(options)
    return Confinement(
        cap_add=cap_add,
        cap_drop=cap_drop,
        security_opt=_security_opt(options.get("security_opt", [])),
        read_only=read_only,
        tmpfs=_tmpfs(options.get("tmpfs", {})),
        log_driver=driver,
        log_options=log_options,
    )
