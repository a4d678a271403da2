"""The ``hubd sidecar`` program: its settings read from the environment, its connection held,
its command run, signals handled, and one exit status for them all."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Mapping

from hubd.sidecar.client import Publication, SidecarClient, SidecarExit
from hubd.sidecar.command import CommandRunner, SidecarOptions
from hubd.sidecar.policy import EXIT_OK, EXIT_USAGE
from hubd.sidecar.settings import SidecarConfigError, SidecarSettings

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
    runner = CommandRunner(options, env)
    client = SidecarClient(
        settings,
        publication=Publication(endpoint=options.endpoint, metadata=options.metadata),
        on_welcome=runner.welcomed,
    )
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, client.stop)
    try:
        running = loop.create_task(client.run(), name="sidecar")
        ended = loop.create_task(runner.exited.wait(), name="sidecar-command-exit")
        try:
            await asyncio.wait({running, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
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
        await runner.stop()
        for signum in signals:
            loop.remove_signal_handler(signum)
