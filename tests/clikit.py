"""Running the ``hubd`` command line as a real child process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

import attrs


@attrs.frozen
class Result:
    code: int
    out: str
    err: str


def hubd_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any hubd settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HUBD_")}
    env.update(extra or {})
    return env


def run_hubd(*args: str, env: Mapping[str, str] | None = None, timeout: float = 60) -> Result:
    done = subprocess.run(
        [sys.executable, "-m", "hubd.cli", *args],
        env=hubd_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Result(done.returncode, done.stdout, done.stderr)


async def run_hubd_async(
    *args: str, env: Mapping[str, str] | None = None, prefix: Sequence[str] = ()
) -> Result:
    """``hubd *args`` run behind ``prefix`` (a command that runs the rest, e.g. in a namespace)."""
    process = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-m",
        "hubd.cli",
        *args,
        env=hubd_env(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())
