"""The ``hubd sidecar`` program: its settings read from the environment, its connection held,
its command run and its readiness checked, signals handled, and one exit status for them
all."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Mapping

import structlog

from hubd.sidecar.channel import Said
from hubd.sidecar.client import Publication, SidecarClient, SidecarExit
from hubd.sidecar.command import CommandRunner, SidecarOptions
from hubd.sidecar.policy import EXIT_OK, EXIT_USAGE
from hubd.sidecar.readiness import COMMAND, watch
from hubd.sidecar.settings import SidecarConfigError, SidecarSettings

log = structlog.get_logger(__name__)

__all__ = ["run_sidecar"]


def run_sidecar(env: Mapping[str, str], options: SidecarOptions | None = None) -> int:
    """``hubd sidecar``: run until SIGTERM/SIGINT (exit 0), until the hub says stop (exit 1),
    or, with a command, until the command ends (its exit status).

    A missing or malformed variable exits 2; every failure prints one line on stderr.
    """
    try:
        settings = SidecarSettings.from_env(env)
    except SidecarConfigError as exc:
        print(f"hubd sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE
    outcome = asyncio.run(_main(settings, options or SidecarOptions(), env))
    if outcome.code != EXIT_OK:
        print(f"hubd sidecar: {outcome.reason}", file=sys.stderr)
    return outcome.code


async def _main(
    settings: SidecarSettings, options: SidecarOptions, env: Mapping[str, str]
) -> SidecarExit:
    check = options.ready_check

    def said(what: Said) -> None:
        """What the command said on its publish descriptor (only ever after the client below
        welcomed the sidecar and started the command)."""
        if what.activity:
            client.report_activity()
        elif what.ready is None:
            try:
                client.publish(endpoint=what.endpoint, metadata=what.metadata)
            except ValueError as exc:
                log.warning("sidecar_command_publish_dropped", reason=str(exc)[:200])
        elif check is not None and check.target == COMMAND:
            client.set_ready(what.ready)
        else:
            log.warning("sidecar_command_readiness_ignored", why="not --ready-check command")

    runner = CommandRunner(options, env, on_said=said)
    # Without a check the sidecar can serve once its command started: the welcome handler
    # starts it, and the first ready goes out after the handler returned.
    client = SidecarClient(
        settings,
        publication=Publication(endpoint=options.endpoint, metadata=options.metadata),
        on_welcome=runner.welcomed,
        on_session=runner.handed_over,
        ready=check is None,
    )
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, client.stop)
    watching: asyncio.Task[None] | None = None
    try:
        running = loop.create_task(client.run(), name="sidecar")
        ended = loop.create_task(runner.exited.wait(), name="sidecar-command-exit")
        waited: set[asyncio.Task[object]] = {running, ended}
        if check is not None and check.target != COMMAND:
            watching = loop.create_task(
                watch(check, endpoint=lambda: client.endpoint, set_ready=client.set_ready),
                name="sidecar-ready-check",
            )
            waited.add(watching)
        try:
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if watching is not None and watching.done():
            # The check runs for good: ending is a bug, which ends the sidecar with it.
            client.stop()
            await running
            watching.result()
        if not running.done():
            # The command ended: so does the sidecar, with the command's status.
            client.stop()
            await running
            if runner.failure is not None:
                return SidecarExit(EXIT_USAGE, runner.failure)
            code = runner.exit_status
            return SidecarExit(code, f"the command exited with status {code}")
        return running.result()
    finally:
        if watching is not None:
            watching.cancel()
            await asyncio.wait({watching})
        await runner.stop()
        for signum in signals:
            loop.remove_signal_handler(signum)
