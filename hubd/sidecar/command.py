"""What ``hubd sidecar`` runs and tells: its options, the context file, and the command it runs.

``hubd sidecar [--publish-endpoint URL] [--publish KEY=VALUE]... [--context-file PATH]
[--ready-check CHECK [--ready-interval S] [--ready-timeout S] [--not-ready-after S]]
[-- COMMAND ARG...]``. With a command, the sidecar runs it once it is first welcomed, with its
own environment less ``HUBD_TOKEN`` (the token opens the sidecar's first connection and nothing
the command needs) plus ``HUBD_CONTEXT_FILE``: a JSON file (mode 0600) holding what the welcome
said the sidecar serves (``allocation_id``, ``sidecar_id``, ``generation``, ``spec``,
``tenant``, ``session``, ``ready_when``; never the reconnect secret), and ``HUBD_PUBLISH_FD``:
a descriptor on which the command publishes at run time and, with ``--ready-check command``,
says whether it can serve (:mod:`hubd.sidecar.channel`). The sidecar ends when the command does
(with its exit status) and stops the command (SIGTERM, SIGKILL 10 s later) when the hub stops
the sidecar. Without a command, ``--context-file`` still writes the file. The readiness check
is :mod:`hubd.sidecar.readiness`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from hubd.published import check_endpoint, check_metadata
from hubd.sidecar.channel import PUBLISH_FD_VARIABLE, PublishChannel, Said
from hubd.sidecar.readiness import ReadyCheck, check_from
from hubd.sidecar.readiness import add_arguments as add_readiness_arguments

__all__ = ["CommandRunner", "SidecarOptions", "add_arguments", "options_from"]

CONTEXT_VARIABLE: Final = "HUBD_CONTEXT_FILE"
STOP_GRACE: Final = 10.0
"""Seconds between the command's SIGTERM and its SIGKILL."""


@attrs.frozen(kw_only=True)
class SidecarOptions:
    """What ``hubd sidecar`` was asked to publish and run."""

    endpoint: str | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    """``--publish`` pairs, published with the sidecar's own ``pid`` (and ``command_pid``)."""
    context_file: str | None = None
    command: tuple[str, ...] = ()
    ready_check: ReadyCheck | None = None
    """``None``: the sidecar can serve once its command started (at once without one)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hubd sidecar``."""
    parser.add_argument(
        "--publish-endpoint",
        metavar="URL",
        help="publish this endpoint (where the sidecar serves) on every connection",
    )
    parser.add_argument(
        "--publish",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="publish a metadata key (a string value); repeatable. The sidecar always "
        "publishes its pid, and command_pid when it runs a command",
    )
    parser.add_argument(
        "--context-file",
        metavar="PATH",
        help="write the welcome's context (spec, tenant, session...) to PATH as JSON "
        "(default with a command: a private temporary file, named by HUBD_CONTEXT_FILE)",
    )
    add_readiness_arguments(parser)
    parser.add_argument(
        "sidecar_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="a command to run once connected; the sidecar ends when it does",
    )


def options_from(args: argparse.Namespace) -> SidecarOptions:
    """The options of a parsed command line; :class:`ValueError` naming the bad one."""
    endpoint = args.publish_endpoint
    if endpoint is not None:
        check_endpoint(endpoint)
    metadata: dict[str, Any] = {}
    for pair in args.publish:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--publish {pair!r:.60}: expected KEY=VALUE")
        metadata[key] = value
    check_metadata(metadata)
    command = list(args.sidecar_command)
    if command and command[0] == "--":
        command = command[1:]
    return SidecarOptions(
        endpoint=endpoint,
        metadata=metadata,
        context_file=args.context_file,
        command=tuple(command),
        ready_check=check_from(args),
    )


class CommandRunner:
    """The context file and the command of one ``hubd sidecar``."""

    def __init__(
        self,
        options: SidecarOptions,
        env: Mapping[str, str],
        *,
        on_said: Callable[[Said], None] | None = None,
    ) -> None:
        """``on_said`` hears what the command says on its publish descriptor."""
        self._options = options
        self._env = env
        self._on_said = on_said
        self._channel: PublishChannel | None = None
        self._lines: asyncio.Task[None] | None = None
        self._private: str | None = None
        self._path: Path | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.exited = asyncio.Event()
        """Set when the command has ended (never, without one)."""
        self._waiter: asyncio.Task[None] | None = None
        self.failure: str | None = None
        """Why the command could not be started (``exited`` is then set)."""

    async def welcomed(self, context: Mapping[str, Any]) -> dict[str, Any]:
        """A welcome arrived: write its context and, the first time, start the command. What
        to publish besides the sidecar's options (the command's pid)."""
        self._write_context(context)
        if self._options.command and self.process is None:
            env = {k: v for k, v in self._env.items() if k != "HUBD_TOKEN"}
            if self._path is not None:
                env[CONTEXT_VARIABLE] = str(self._path)
            self._channel = channel = PublishChannel()
            env[PUBLISH_FD_VARIABLE] = str(channel.write_fd)
            try:
                self.process = await asyncio.create_subprocess_exec(
                    *self._options.command, env=env, pass_fds=(channel.write_fd,)
                )
            except OSError as exc:
                self.failure = f"cannot run {self._options.command[0]!r}: {exc.strerror or exc}"
                self.exited.set()
                return {}
            finally:
                channel.handed_over()
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_task(self._wait(self.process), name="sidecar-command")
            self._lines = loop.create_task(
                channel.read(self._said), name="sidecar-command-publishes"
            )
        if self.process is not None:
            return {"command_pid": self.process.pid}
        return {}

    async def handed_over(self, context: Mapping[str, Any]) -> None:
        """A hand-over arrived (a pool member taken): the context file says the new tenant and
        session before the hub hears that the sidecar holds them."""
        self._write_context(context)

    def _write_context(self, context: Mapping[str, Any]) -> None:
        if self._path is None:
            if self._options.context_file is not None:
                self._path = Path(self._options.context_file)
            elif self._options.command:
                self._private = tempfile.mkdtemp(prefix="hubd-sidecar-")
                self._path = Path(self._private) / "context.json"
            else:
                return
        # Replaced whole (a reader never sees half a file), readable by this user only.
        partial = self._path.with_name(self._path.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(dict(context), file, ensure_ascii=False)
        partial.replace(self._path)

    def _said(self, said: Said) -> None:
        if self._on_said is not None:
            self._on_said(said)

    async def _wait(self, process: asyncio.subprocess.Process) -> None:
        await process.wait()
        self.exited.set()

    @property
    def exit_status(self) -> int:
        """The command's status as a shell reports it (128 + the signal that ended it)."""
        code = 0 if self.process is None else self.process.returncode or 0
        return code if code >= 0 else 128 - code

    async def stop(self) -> None:
        """Stop the command (SIGTERM, then SIGKILL after the grace) and remove a private
        context file; idempotent."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(STOP_GRACE):
                    await self.exited.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await self.exited.wait()
        if self._lines is not None:
            # Not read to its end: a descendant of the command may hold the descriptor open,
            # and nothing said now would reach a hub any more.
            self._lines.cancel()
            # Waited for without taking its cancellation for this task's own.
            await asyncio.wait({self._lines})
            self._lines = None
        if self._channel is not None:
            self._channel.close()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None
