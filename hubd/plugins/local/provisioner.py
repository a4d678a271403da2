"""The ``local`` provisioner itself: start, find again and destroy child-process sidecars."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import structlog

from hubd.aio import KeyedFifo
from hubd.errors import PluginLoadError
from hubd.plugins.local.options import LocalOptions, check_options, parse_options
from hubd.plugins.local.outcomes import (
    describe_exit,
    last_line,
    not_owned,
    os_error,
    resolve_hubd,
    start_failure,
)
from hubd.plugins.local.probe import probe_command
from hubd.plugins.local.record import (
    CorruptRecord,
    Leader,
    Record,
    discard_record,
    group_is_ours,
    leader_of,
    load_record,
    save_record,
    transient,
    wait_gone,
)
from hubd.plugins.procfs import boot_id, read_stat
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
    checks_options,
)
from hubd.units import format_duration

__all__ = ["API_VERSION", "SETTLE", "LocalProvisioner", "create"]

log = structlog.get_logger(__name__)

API_VERSION: Final = "1"
SETTLE: Final = 0.2
"""How long ``ensure`` watches a new child: an exit within it is a failed start."""

# After SIGKILL only a process stuck in the kernel (D state) can linger; past this, retry later.
_KILL_WAIT: Final = 5.0
# The only variables a sidecar inherits from the daemon. An allow-list, not a deny-list: the
# daemon's environment holds its own secrets (PGPASSWORD, a database URL, cloud credentials,
# systemd's NOTIFY_SOCKET) and a sidecar is code hubd merely runs. Anything else a sidecar needs
# is named in [provisioners.options].env.
_INHERITED: Final = ("PATH", "HOME", "LANG", "TZ")
# Sidecar ids become file names: nothing that could climb out of the state directory.
_SIDECAR_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@checks_options(check_options)
def create(*, id: str, options: Mapping[str, Any], state_dir: Path) -> LocalProvisioner:
    """The plugin factory (see :mod:`hubd.plugins.registry`)."""
    if not Path("/proc/self/stat").is_file():
        raise PluginLoadError("the local provisioner needs Linux /proc")
    return LocalProvisioner(id=id, options=parse_options(options), state_dir=state_dir)


class LocalProvisioner:
    """Runs each sidecar as a child process; see the module docstring for the guarantees."""

    def __init__(
        self, *, id: str, options: LocalOptions, state_dir: Path, settle: float = SETTLE
    ) -> None:
        self.id = id
        self.api_version = API_VERSION
        self.binding_fingerprint = options.binding_fingerprint
        self.former_binding_fingerprints = options.former_binding_fingerprints
        self.options = options
        self.directory = state_dir / "local"
        self._settle = settle
        self._boot_id = boot_id()
        # Children this instance started, with the task that awaits (and so reaps) each one.
        self._children: dict[str, tuple[asyncio.subprocess.Process, asyncio.Task[int]]] = {}
        # One call at a time per sidecar: an ensure and a destroy of one sidecar would race
        # on its record and its process group.
        self._turns = KeyedFifo()

    def __repr__(self) -> str:
        return f"<LocalProvisioner id={self.id!r} command={list(self.options.command)!r}>"

    # -- the protocol ----------------------------------------------------------------------------

    async def probe(self) -> str:
        """``hubd check-config --probe``: the command is executable, the state writable."""
        return probe_command(self.options, self.directory)

    async def ensure(self, request: EnsureRequest) -> EnsureResult:
        """Start the sidecar's process unless a live one, verifiably ours, already runs."""
        try:
            return await self._ensure(request)
        except OSError as exc:
            # Reading /proc or the state directory while the machine is out of descriptors:
            # nothing was decided, so it is retried.
            if not transient(exc):
                raise
            return Rejected(code="resources_exhausted", message=os_error(exc), retryable=True)

    async def _ensure(self, request: EnsureRequest) -> EnsureResult:
        sidecar_id = request.sidecar_id
        if not _SIDECAR_ID.fullmatch(sidecar_id):
            return Rejected(
                code="invalid_sidecar_id",
                message="sidecar id is not usable as a file name",
                retryable=False,
            )
        async with self._turns.hold(sidecar_id):
            try:
                record = load_record(self.directory, sidecar_id)
            except CorruptRecord as exc:
                # Retryable: the replacement destroys this sidecar first, and that destroy is
                # where an unreadable record becomes an operator's problem (destroy_failed).
                return Rejected(code="state_corrupt", message=str(exc), retryable=True)
            if record is not None:
                if leader_of(record, self._boot_id) is Leader.RUNNING:
                    return self._accepted(record)
                # The earlier process died; what it left in its group goes before a new start.
                swept = await self._terminate(record)
                if isinstance(swept, DestroyRejected):
                    return Rejected(code=swept.code, message=swept.message, retryable=True)
                discard_record(self.directory, sidecar_id, log_too=False)
            return await self._start(request)

    def _accepted(self, record: Record) -> Accepted:
        # What this provisioner knows for certain: the process, where it runs and where its
        # output goes. No endpoint: what the command serves, and where, is the command's own.
        return Accepted(
            record.external_ref,
            metadata={
                "pid": record.pid,
                "host": socket.gethostname(),
                "log": str(self.directory / f"{record.sidecar_id}.log"),
            },
        )

    async def destroy(self, request: DestroyRequest) -> DestroyResult:
        """Terminate the sidecar's process group (SIGTERM, then SIGKILL after ``grace``)."""
        try:
            return await self._destroy(request)
        except OSError as exc:
            # Out of descriptors or an I/O error says nothing about the sidecar: retried with
            # backoff, never destroy_failed.
            if not transient(exc):
                raise
            return DestroyRejected(
                code="resources_exhausted", message=os_error(exc), retryable=True
            )

    async def _destroy(self, request: DestroyRequest) -> DestroyResult:
        sidecar_id = request.sidecar_id
        if not _SIDECAR_ID.fullmatch(sidecar_id):
            return DestroyRejected(
                code="invalid_sidecar_id",
                message="sidecar id is not usable as a file name",
                retryable=False,
            )
        async with self._turns.hold(sidecar_id):
            fallback = Record.from_external_ref(sidecar_id, request.external_ref)
            try:
                record = load_record(self.directory, sidecar_id) or fallback
            except CorruptRecord as exc:
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
                discard_record(self.directory, sidecar_id, log_too=True)
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
                record = load_record(self.directory, sidecar_id)
            except CorruptRecord:
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
            return not_owned()
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
            command = resolve_hubd(command, env)
            # The last check before the fork: nothing irreversible happened yet, and a log file
            # this call created is removed, so no file is left for a spawn that did not happen.
            if not request.ownership.still_owned():
                if log_offset == 0:
                    log_path.unlink(missing_ok=True)
                return not_owned()
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
                return start_failure(command[0], exc)
        finally:
            os.close(log_fd)

        # No await from here until the record is on disk: a cancellation cannot land between
        # the start and the record, so there is never a child that no record describes.
        reaper = self._watch(sidecar_id, process)
        stat = read_stat(process.pid)
        record = Record(
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
            save_record(self.directory, record)
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
                "sidecar_process_started",
                provisioner=self.id,
                sidecar_id=sidecar_id,
                allocation_id=request.allocation_id,
                generation=request.generation,
                pid=process.pid,
            )
            return self._accepted(record)

        code = reaper.result()
        await self._terminate(record)  # whatever it started before exiting
        discard_record(self.directory, sidecar_id, log_too=False)
        last = last_line(log_path, log_offset)
        return Rejected(
            code="sidecar_exited",
            message=(
                f"sidecar command {describe_exit(code)} within "
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
                "sidecar_process_exited",
                provisioner=self.id,
                sidecar_id=sidecar_id,
                pid=process.pid,
                outcome=describe_exit(code),
                last_output=last_line(self.directory / f"{sidecar_id}.log"),
            )
            entry = self._children.get(sidecar_id)
            if entry is not None and entry[0] is process:
                del self._children[sidecar_id]
            return code

        task = asyncio.create_task(reap(), name=f"reap sidecar {sidecar_id} pid {process.pid}")
        self._children[sidecar_id] = (process, task)
        return task

    # -- identity and termination ----------------------------------------------------------------

    async def _terminate(self, record: Record) -> DestroyResult:
        leader = leader_of(record, self._boot_id)
        if leader is Leader.FOREIGN:
            return Destroyed()
        if leader is Leader.ABSENT and not group_is_ours(record):
            return Destroyed()
        pgid = record.pgid
        now = time.time()
        if record.kill_at is None:
            record = attrs.evolve(record, kill_at=now + self.options.grace)
            with contextlib.suppress(OSError):
                # Best effort: without it a retried destroy only waits the full grace again.
                save_record(self.directory, record)
        assert record.kill_at is not None
        # Capped by grace, so a wall clock set back cannot stretch the wait.
        patience = min(max(record.kill_at - now, 0.0), self.options.grace)
        try:
            if patience > 0:
                log.info("sidecar_terminating", provisioner=self.id, sidecar_id=record.sidecar_id)
                os.killpg(pgid, signal.SIGTERM)
                if await wait_gone(pgid, patience):
                    return await self._reaped(record)
            log.warning(
                "sidecar_outlived_grace_killing",
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
        if not await wait_gone(pgid, _KILL_WAIT):
            return DestroyRejected(
                code="destroy_timeout",
                message=f"process group {pgid} survived SIGKILL for {_KILL_WAIT:g}s",
                retryable=True,
            )
        return await self._reaped(record)

    async def _reaped(self, record: Record) -> Destroyed:
        """Destroyed, once a child of ours in that group has been reaped (no zombie left)."""
        entry = self._children.get(record.sidecar_id)
        if entry is not None and entry[0].pid == record.pid:
            # The group is empty or all zombies, so the exit status is there or imminent.
            await asyncio.wait({entry[1]}, timeout=1.0)
        return Destroyed()
