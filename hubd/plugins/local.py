"""The built-in ``local`` provisioner: one child process per sidecar, in a process group of its own.

Options (``[provisioners.options]``)::

    command = ["hubd", "sidecar"]   # argv of the sidecar; looked up in PATH (env's PATH if set)
                                    # ("hubd" not in PATH: the one beside hubd's interpreter)
    env = { NAME = "value" }        # extra environment for the sidecar
    grace = "5s"                    # SIGTERM → SIGKILL escalation delay (duration or seconds)
    workdir = "/srv/sidecars"       # working directory; default: the daemon's

The child gets the daemon's environment without the daemon's own ``HUBD_*`` variables (they can
hold the database password) and without systemd's per-service variables (``NOTIFY_SOCKET`` …),
then ``env``, then ``HUBD_URL``, ``HUBD_TOKEN``, ``HUBD_ALLOCATION_ID``, ``HUBD_SIDECAR_ID`` and
``HUBD_GENERATION``. Nothing secret is put on its command line: ``/proc/<pid>/cmdline`` is
world-readable, ``/proc/<pid>/environ`` is not.

Files, under ``<state_dir>/local/`` (mode 0700)::

    <sidecar_id>.json   the record: pid, pgid, start time, boot id, command — never the token
    <sidecar_id>.log    the child's stdout and stderr, removed when the sidecar is destroyed

Identity. A pid is only a number the kernel hands out again, so a record names a process by its
pid *and* its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot) *and* the boot id:
a process whose start time differs is someone else's, and it is never signalled. The child is made
the leader of a new session and so of a process group whose id is its pid; that id stays reserved
while any member of the group lives, which is what makes signalling the whole group safe even
after the leader has gone, provided one surviving member proves (by its ``HUBD_SIDECAR_ID``) that
the group is ours. Everything needed to destroy a sidecar is on disk, so a daemon that restarted
destroys what an earlier run started.

A sidecar command must stay in the foreground: a child that exits within the settle window is a
failed start, whatever its exit status. Linux only (``/proc``).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import enum
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import structlog

from hubd.config import format_duration, parse_duration
from hubd.errors import PluginLoadError
from hubd.plugins.procfs import boot_id, group_members, names_sidecar, read_stat
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRejected,
    DestroyRequest,
    DestroyResult,
    EnsureRequest,
    EnsureResult,
    Rejected,
    RunningSidecar,
)
from hubd.redaction import scrub

__all__ = [
    "API_VERSION",
    "DEFAULT_COMMAND",
    "DEFAULT_GRACE",
    "SETTLE",
    "LocalOptions",
    "LocalProvisioner",
    "create",
    "parse_options",
]

log = structlog.get_logger(__name__)

API_VERSION: Final = "1"
DEFAULT_COMMAND: Final = ("hubd", "sidecar")
DEFAULT_GRACE: Final = 5.0
SETTLE: Final = 0.2
"""How long ``ensure`` watches a new child: an exit within it is a failed start."""

# After SIGKILL only a process stuck in the kernel (D state) can linger; past this, retry later.
_KILL_WAIT: Final = 5.0
_POLL_MIN: Final = 0.005
_POLL_MAX: Final = 0.1
_LAST_LINE_MAX: Final = 300

_OPTIONS: Final = ("command", "env", "grace", "workdir")
_SIDECAR_ENV: Final = (
    "HUBD_URL",
    "HUBD_TOKEN",
    "HUBD_ALLOCATION_ID",
    "HUBD_SIDECAR_ID",
    "HUBD_GENERATION",
)
# The only variables a sidecar inherits from the daemon. An allow-list, not a deny-list: the
# daemon's environment holds its own secrets (PGPASSWORD, a database URL, cloud credentials,
# systemd's NOTIFY_SOCKET) and a sidecar is code hubd merely runs. Anything else a sidecar needs
# is named in [provisioners.options].env.
_INHERITED: Final = ("PATH", "HOME", "LANG", "TZ")
# Sidecar ids become file names: nothing that could climb out of the state directory.
_SIDECAR_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_EXTERNAL_REF: Final = re.compile(r"local:([0-9]{1,10}):([0-9]{1,20})")
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
# Out of descriptors, memory or processes, or an I/O error: the machine's trouble, not the
# sidecar's. Retried with backoff, never a verdict such as destroy_failed.
_TRANSIENT_ERRNOS: Final = frozenset(
    {errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE, errno.EIO, errno.EINTR, errno.ENOBUFS}
)


def _transient(exc: OSError) -> bool:
    return exc.errno in _TRANSIENT_ERRNOS


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


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
        """SHA-256 of the canonical JSON of the options that decide what runs and where.

        ``grace`` is left out: changing it alters no running sidecar, and a changed fingerprint
        fails every pending allocation bound to the old one.
        """
        binding = {
            "command": list(self.command),
            "env": dict(self.env),
            "workdir": None if self.workdir is None else str(self.workdir),
        }
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
        if name in _SIDECAR_ENV:
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


def create(*, id: str, options: Mapping[str, Any], state_dir: Path) -> LocalProvisioner:
    """The plugin factory (see :mod:`hubd.plugins.registry`)."""
    if not Path("/proc/self/stat").is_file():
        raise PluginLoadError("the local provisioner needs Linux /proc")
    return LocalProvisioner(id=id, options=parse_options(options), state_dir=state_dir)


def _last_line(path: Path, offset: int = 0) -> str:
    """The last non-blank line written to ``path`` after ``offset``, bounded and scrubbed."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - 4096))
            tail = f.read()
    except OSError:
        return ""
    lines = [line.strip() for line in tail.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return ""
    line = _CONTROL.sub(" ", lines[-1])
    if len(line) > _LAST_LINE_MAX:
        line = line[: _LAST_LINE_MAX - 1] + "…"
    return scrub(line)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# ---------------------------------------------------------------------------------------------
# The record of one started sidecar
# ---------------------------------------------------------------------------------------------


class _CorruptRecord(Exception):
    pass


@attrs.frozen(kw_only=True)
class _Record:
    sidecar_id: str
    pid: int
    start_time: int
    boot_id: str | None = None
    """``None`` for a record rebuilt from an external_ref: identity then also needs the
    process's environment to name the sidecar."""
    allocation_id: str | None = None
    generation: int | None = None
    command: tuple[str, ...] = ()
    started_at: float | None = None
    kill_at: float | None = None
    """Wall-clock time after which SIGKILL is due; set with the first SIGTERM, so escalation
    survives a destroy that was cancelled (or a daemon that restarted) during the grace period."""

    @property
    def pgid(self) -> int:
        # start_new_session makes the child the leader of a group whose id is its pid.
        return self.pid

    @property
    def external_ref(self) -> str:
        return f"local:{self.pid}:{self.start_time}"

    def to_json(self) -> bytes:
        document = attrs.asdict(self)
        document["pgid"] = self.pgid
        document["command"] = list(self.command)
        return json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, sidecar_id: str) -> _Record:
        try:
            document = json.loads(data)
            record = cls(
                sidecar_id=document["sidecar_id"],
                pid=document["pid"],
                start_time=document["start_time"],
                boot_id=document.get("boot_id"),
                allocation_id=document.get("allocation_id"),
                generation=document.get("generation"),
                command=tuple(document.get("command", ())),
                started_at=document.get("started_at"),
                kill_at=document.get("kill_at"),
            )
            pgid = document.get("pgid", record.pid)
        except (ValueError, TypeError, KeyError) as exc:
            raise _CorruptRecord(f"{type(exc).__name__}: {exc}") from None
        sane = (
            record.sidecar_id == sidecar_id
            and _is_int(record.pid)
            and record.pid > 1
            and pgid == record.pid
            and _is_int(record.start_time)
            and (record.kill_at is None or isinstance(record.kill_at, int | float))
        )
        if not sane:
            raise _CorruptRecord("fields do not describe a process this provisioner started")
        return record

    @classmethod
    def from_external_ref(cls, sidecar_id: str, ref: str | None) -> _Record | None:
        match = _EXTERNAL_REF.fullmatch(ref or "")
        if match is None or int(match[1]) <= 1:
            return None
        return cls(sidecar_id=sidecar_id, pid=int(match[1]), start_time=int(match[2]))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Leader(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"
    """A zombie not reaped yet: its group id is still reserved."""
    ABSENT = "absent"
    """No such pid: members of its group may live on (and keep the group id reserved)."""
    FOREIGN = "foreign"
    """The pid belongs to another process, or another boot: the pid was free at some point,
    which it cannot be while any member of our group lives, so our group is gone."""


# ---------------------------------------------------------------------------------------------
# The provisioner
# ---------------------------------------------------------------------------------------------


class LocalProvisioner:
    """Runs each sidecar as a child process; see the module docstring for the guarantees."""

    def __init__(
        self, *, id: str, options: LocalOptions, state_dir: Path, settle: float = SETTLE
    ) -> None:
        self.id = id
        self.api_version = API_VERSION
        self.binding_fingerprint = options.binding_fingerprint
        self.options = options
        self.directory = state_dir / "local"
        self._settle = settle
        self._boot_id = boot_id()
        # Children this instance started, with the task that awaits (and so reaps) each one.
        self._children: dict[str, tuple[asyncio.subprocess.Process, asyncio.Task[int]]] = {}
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def __repr__(self) -> str:
        return f"<LocalProvisioner id={self.id!r} command={list(self.options.command)!r}>"

    # -- the protocol ----------------------------------------------------------------------------

    async def ensure(self, request: EnsureRequest) -> EnsureResult:
        """Start the sidecar's process unless a live one, verifiably ours, already runs."""
        try:
            return await self._ensure(request)
        except OSError as exc:
            # Reading /proc or the state directory while the machine is out of descriptors:
            # nothing was decided, so it is retried.
            if not _transient(exc):
                raise
            return Rejected(code="resources_exhausted", message=_os_error(exc), retryable=True)

    async def _ensure(self, request: EnsureRequest) -> EnsureResult:
        sidecar_id = request.sidecar_id
        if not _SIDECAR_ID.fullmatch(sidecar_id):
            return Rejected(
                code="invalid_sidecar_id",
                message="sidecar id is not usable as a file name",
                retryable=False,
            )
        async with self._exclusive(sidecar_id):
            try:
                record = self._load(sidecar_id)
            except _CorruptRecord as exc:
                # Retryable: the replacement destroys this sidecar first, and that destroy is
                # where an unreadable record becomes an operator's problem (destroy_failed).
                return Rejected(code="state_corrupt", message=str(exc), retryable=True)
            if record is not None:
                if self._leader(record) is _Leader.RUNNING:
                    return Accepted(record.external_ref)
                # The earlier process died; what it left in its group goes before a new start.
                swept = await self._terminate(record)
                if isinstance(swept, DestroyRejected):
                    return Rejected(code=swept.code, message=swept.message, retryable=True)
                self._discard(sidecar_id, log_too=False)
            return await self._start(request)

    async def destroy(self, request: DestroyRequest) -> DestroyResult:
        """Terminate the sidecar's process group (SIGTERM, then SIGKILL after ``grace``)."""
        try:
            return await self._destroy(request)
        except OSError as exc:
            # Out of descriptors or an I/O error says nothing about the sidecar: retried with
            # backoff, never destroy_failed.
            if not _transient(exc):
                raise
            return DestroyRejected(
                code="resources_exhausted", message=_os_error(exc), retryable=True
            )

    async def _destroy(self, request: DestroyRequest) -> DestroyResult:
        sidecar_id = request.sidecar_id
        if not _SIDECAR_ID.fullmatch(sidecar_id):
            return DestroyRejected(
                code="invalid_sidecar_id",
                message="sidecar id is not usable as a file name",
                retryable=False,
            )
        async with self._exclusive(sidecar_id):
            fallback = _Record.from_external_ref(sidecar_id, request.external_ref)
            try:
                record = self._load(sidecar_id) or fallback
            except _CorruptRecord as exc:
                if fallback is None:
                    return DestroyRejected(
                        code="state_corrupt",
                        message=f"{exc}; the process it describes may still run",
                        retryable=False,
                    )
                record = fallback
            if record is None:
                # Never started, or destroyed before: both are "gone".
                return Destroyed()
            if not request.ownership.still_owned():
                return DestroyRejected(
                    code="claim_lost",
                    message="the claim no longer owns the allocation; nothing was signalled",
                    retryable=True,
                )
            result = await self._terminate(record)
            if isinstance(result, Destroyed):
                self._discard(sidecar_id, log_too=True)
            return result

    async def list_sidecars(self) -> list[RunningSidecar]:
        """Every sidecar this provisioner has a record for, read from its state directory.

        A record is written before a start is reported and removed only once its process group
        is gone, so the records cover every process this provisioner started; one whose
        process already exited is listed too, and destroying it just removes its files.
        Unreadable records are skipped (destroy reports them when their allocation asks).
        """
        found: list[RunningSidecar] = []
        try:
            names = sorted(p.name for p in self.directory.glob("*.json"))
        except OSError:
            return found
        for name in names:
            sidecar_id = name.removesuffix(".json")
            if not _SIDECAR_ID.fullmatch(sidecar_id):
                continue
            try:
                record = self._load(sidecar_id)
            except _CorruptRecord:
                continue
            if record is None:
                continue
            found.append(
                RunningSidecar(
                    sidecar_id=record.sidecar_id,
                    allocation_id=record.allocation_id,
                    generation=record.generation,
                    external_ref=record.external_ref,
                )
            )
        return found

    # -- starting --------------------------------------------------------------------------------

    def _environment(self, request: EnsureRequest) -> dict[str, str]:
        env = {name: os.environ[name] for name in _INHERITED if name in os.environ}
        env.update(self.options.env)
        env.update(
            HUBD_URL=request.hub_ws_url,
            HUBD_TOKEN=request.token,
            HUBD_ALLOCATION_ID=request.allocation_id,
            HUBD_SIDECAR_ID=request.sidecar_id,
            HUBD_GENERATION=str(request.generation),
        )
        return env

    async def _start(self, request: EnsureRequest) -> EnsureResult:
        sidecar_id = request.sidecar_id
        command = self.options.command
        log_path = self.directory / f"{sidecar_id}.log"
        if not request.ownership.still_owned():
            return _not_owned()
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            return Rejected(
                code="state_unwritable",
                message=f"cannot write the sidecar log under {self.directory}: {exc.strerror}",
                retryable=True,
            )
        try:
            log_offset = os.fstat(log_fd).st_size
            workdir = self.options.workdir
            if workdir is not None and not workdir.is_dir():
                return Rejected(
                    code="command_failed",
                    message=f"workdir {str(workdir)!r} is not a directory",
                    retryable=False,
                )
            env = self._environment(request)
            command = _resolve_hubd(command, env)
            # The last check before the fork: nothing irreversible happened yet, and a log file
            # this call created is removed, so no file is left for a spawn that did not happen.
            if not request.ownership.still_owned():
                if log_offset == 0:
                    log_path.unlink(missing_ok=True)
                return _not_owned()
            try:
                process = await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_fd,
                    stderr=log_fd,
                    cwd=workdir,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                return _start_failure(command[0], exc)
        finally:
            os.close(log_fd)

        # No await from here until the record is on disk: a cancellation cannot land between
        # the start and the record, so there is never a child that no record describes.
        reaper = self._watch(sidecar_id, process)
        stat = read_stat(process.pid)
        record = _Record(
            sidecar_id=sidecar_id,
            pid=process.pid,
            # Gone and already reaped before we could look: the record only has to lead the
            # sweep below, and a start time of 0 matches no process.
            start_time=0 if stat is None else stat.start_time,
            boot_id=self._boot_id,
            allocation_id=request.allocation_id,
            generation=request.generation,
            command=command,
            started_at=time.time(),
        )
        try:
            self._save(record)
        except OSError as exc:
            await self._terminate(record)
            return Rejected(
                code="state_unwritable",
                message=f"cannot record the sidecar process under {self.directory}: {exc.strerror}",
                retryable=True,
            )

        # A cancellation during the settle window leaves a complete record behind; the
        # reconciler's next step for an aborted ensure is a destroy, which finds it.
        await asyncio.wait({reaper}, timeout=self._settle)
        if not reaper.done():
            log.info(
                "sidecar process started",
                provisioner=self.id,
                sidecar_id=sidecar_id,
                allocation_id=request.allocation_id,
                generation=request.generation,
                pid=process.pid,
            )
            return Accepted(record.external_ref)

        code = reaper.result()
        await self._terminate(record)  # whatever it started before exiting
        self._discard(sidecar_id, log_too=False)
        last = _last_line(log_path, log_offset)
        return Rejected(
            code="sidecar_exited",
            message=(
                f"sidecar command {_describe_exit(code)} within "
                f"{format_duration(self._settle)} of starting"
                + (f": {last}" if last else " (no output)")
            ),
            retryable=True,
        )

    def _watch(self, sidecar_id: str, process: asyncio.subprocess.Process) -> asyncio.Task[int]:
        """Await the child in the background: that reaps it whenever it exits, even on its own."""

        async def reap() -> int:
            code = await process.wait()
            log.info(
                "sidecar process exited",
                provisioner=self.id,
                sidecar_id=sidecar_id,
                pid=process.pid,
                outcome=_describe_exit(code),
                last_output=_last_line(self.directory / f"{sidecar_id}.log"),
            )
            entry = self._children.get(sidecar_id)
            if entry is not None and entry[0] is process:
                del self._children[sidecar_id]
            return code

        task = asyncio.create_task(reap(), name=f"reap sidecar {sidecar_id} pid {process.pid}")
        self._children[sidecar_id] = (process, task)
        return task

    # -- identity and termination ----------------------------------------------------------------

    def _leader(self, record: _Record) -> _Leader:
        if record.pgid in {os.getpgrp(), os.getpid()}:
            return _Leader.FOREIGN  # never, whatever a record says, signal hubd's own group
        if record.boot_id is not None and record.boot_id != self._boot_id:
            return _Leader.FOREIGN
        stat = read_stat(record.pid)
        if stat is None:
            return _Leader.ABSENT
        if stat.start_time != record.start_time:
            return _Leader.FOREIGN
        # A record rebuilt from an external_ref has no boot id to rule out a process of an
        # earlier boot that happens to match pid and start time; its environment can.
        if record.boot_id is None and names_sidecar(record.pid, record.sidecar_id) is False:
            return _Leader.FOREIGN
        return _Leader.EXITED if stat.dead else _Leader.RUNNING

    def _group_is_ours(self, record: _Record) -> bool:
        return any(
            not stat.dead and names_sidecar(pid, record.sidecar_id)
            for pid, stat in group_members(record.pgid)
        )

    def _group_alive(self, pgid: int) -> bool:
        """Whether any member of the group still runs. Zombies do not count: they keep the
        group non-empty until someone reaps them, which an init that reaps lazily may not do
        for a while."""
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # a member we may not signal still counts as alive
        alive = False
        for pid, stat in group_members(pgid):
            if not stat.dead:
                alive = True
            elif stat.ppid == os.getpid() and pid != pgid:
                # Reparented to us (hubd is PID 1 in a container, or a subreaper). Leaders are
                # left alone: ours are reaped by asyncio's child watcher, and stealing one from
                # it would lose its exit status.
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        return alive

    async def _wait_gone(self, pgid: int, within: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        delay = _POLL_MIN
        # Polled: there is no event for "a process group became empty".
        while self._group_alive(pgid):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX)
        return True

    async def _terminate(self, record: _Record) -> DestroyResult:
        leader = self._leader(record)
        if leader is _Leader.FOREIGN:
            return Destroyed()
        if leader is _Leader.ABSENT and not self._group_is_ours(record):
            return Destroyed()
        pgid = record.pgid
        now = time.time()
        if record.kill_at is None:
            record = attrs.evolve(record, kill_at=now + self.options.grace)
            with contextlib.suppress(OSError):
                # Best effort: without it a retried destroy only waits the full grace again.
                self._save(record)
        assert record.kill_at is not None
        # Capped by grace, so a wall clock set back cannot stretch the wait.
        patience = min(max(record.kill_at - now, 0.0), self.options.grace)
        try:
            if patience > 0:
                log.info("terminating sidecar", provisioner=self.id, sidecar_id=record.sidecar_id)
                os.killpg(pgid, signal.SIGTERM)
                if await self._wait_gone(pgid, patience):
                    return await self._reaped(record)
            log.warning(
                "sidecar outlived its grace period; killing it",
                provisioner=self.id,
                sidecar_id=record.sidecar_id,
                grace=self.options.grace,
            )
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return await self._reaped(record)
        except PermissionError:
            return DestroyRejected(
                code="permission_denied",
                message=f"not allowed to signal process group {pgid}",
                retryable=False,
            )
        if not await self._wait_gone(pgid, _KILL_WAIT):
            return DestroyRejected(
                code="destroy_timeout",
                message=f"process group {pgid} survived SIGKILL for {_KILL_WAIT:g}s",
                retryable=True,
            )
        return await self._reaped(record)

    async def _reaped(self, record: _Record) -> Destroyed:
        """Destroyed, once a child of ours in that group has been reaped (no zombie left)."""
        entry = self._children.get(record.sidecar_id)
        if entry is not None and entry[0].pid == record.pid:
            # The group is empty or all zombies, so the exit status is there or imminent.
            await asyncio.wait({entry[1]}, timeout=1.0)
        return Destroyed()

    # -- the state directory ---------------------------------------------------------------------

    def _load(self, sidecar_id: str) -> _Record | None:
        path = self.directory / f"{sidecar_id}.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            if _transient(exc):
                raise
            raise _CorruptRecord(f"cannot read {path}: {exc.strerror}") from None
        try:
            return _Record.from_json(data, sidecar_id)
        except _CorruptRecord as exc:
            raise _CorruptRecord(f"unreadable record {path}: {exc}") from None

    def _save(self, record: _Record) -> None:
        """Write the record atomically: readers see the old file or the new one, never half."""
        path = self.directory / f"{record.sidecar_id}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, record.to_json())
        finally:
            os.close(fd)
        # No fsync: a crash that loses the file also ends every process it could describe.
        os.replace(tmp, path)

    def _discard(self, sidecar_id: str, *, log_too: bool) -> None:
        (self.directory / f"{sidecar_id}.json").unlink(missing_ok=True)
        if log_too:
            (self.directory / f"{sidecar_id}.log").unlink(missing_ok=True)

    @contextlib.asynccontextmanager
    async def _exclusive(self, sidecar_id: str) -> AsyncIterator[None]:
        """One call at a time per sidecar; the lock is dropped when nobody holds or awaits it."""
        lock, users = self._locks.setdefault(sidecar_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[sidecar_id]


def _resolve_hubd(command: tuple[str, ...], env: Mapping[str, str]) -> tuple[str, ...]:
    """``command``, with a bare ``hubd`` that the child's PATH does not know replaced by the
    ``hubd`` script installed beside the running interpreter: the default command then works
    from a virtualenv that was never activated (``.venv/bin/hubd dev``)."""
    if command[0] != "hubd" or shutil.which("hubd", path=env.get("PATH", os.defpath)):
        return command
    beside = Path(sys.executable).parent / "hubd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return (str(beside), *command[1:])
    return command


def _not_owned() -> Rejected:
    return Rejected(
        code="claim_lost",
        message="the claim no longer owns the allocation; nothing was started",
        retryable=True,
    )


def _os_error(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name}: {exc.strerror or exc}; retried later"


def _start_failure(program: str, exc: OSError) -> Rejected:
    if isinstance(exc, FileNotFoundError):
        where = "" if "/" in program else " in PATH"
        return Rejected(
            code="command_not_found",
            message=f"sidecar command {program!r} not found{where}",
            retryable=False,
        )
    if isinstance(exc, PermissionError):
        return Rejected(
            code="command_failed",
            message=f"sidecar command {program!r} cannot be executed: permission denied",
            retryable=False,
        )
    return Rejected(
        code="command_failed",
        message=f"sidecar command {program!r} could not be started: {exc.strerror or exc}",
        # Out of processes, memory or file descriptors: another try may succeed.
        retryable=_transient(exc),
    )
