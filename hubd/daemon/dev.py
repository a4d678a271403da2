"""``hubd dev``: the daemon on the embedded database with the local provisioner running the
reference sidecar, console logs, and a demo allocation that becomes ready in front of you."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import sys
from pathlib import Path

import attrs

from hubd.config import Config, LogConfig, ProvisionerConfig
from hubd.daemon.service import Daemon
from hubd.store.models import Status

__all__ = ["dev_config", "run_dev"]

DEMO_TIMEOUT = 60.0


def dev_config(config: Config) -> Config:
    """``config`` with console logs and a ``local`` provisioner that runs ``hubd sidecar``."""
    sidecar = [sys.executable, "-m", "hubd.cli", "sidecar"]
    local = ProvisionerConfig(id="local", plugin="local", options={"command": sidecar})
    others = tuple(p for p in config.provisioners if p.id != "local")
    return attrs.evolve(
        config,
        provisioners=(local, *others),
        log=LogConfig(format="console", level=config.log.level),
    )


def _command() -> str:
    """How to call this hubd from a shell: the script that started us, and our state dir."""
    script = Path(sys.argv[0])
    command = "hubd"
    if script.name == "hubd" and shutil.which("hubd") != str(script.resolve()):
        command = os.path.relpath(script) if not script.is_absolute() else str(script)
    state = os.environ.get("HUBD_STATE_DIR")
    return f"HUBD_STATE_DIR={shlex.quote(state)} {command}" if state else command


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _demo(daemon: Daemon) -> None:
    store = daemon.store
    assert store is not None
    allocation = await store.request(provisioner_id="local", session_id="hubd-dev-demo")
    _say(f"\n==> requested demo allocation {allocation.id}; waiting for its sidecar to connect")
    async with asyncio.timeout(DEMO_TIMEOUT):
        while True:
            current = await store.get(allocation.id)
            if current.ready:
                break
            if current.status.terminal:
                _say(f"==> demo allocation ended {current.status}: {current.failure_message}")
                return
            await asyncio.sleep(0.2)
    config = daemon.config
    hubd = _command()
    _say(
        f"==> {allocation.id} is READY (sidecar {current.sidecar_id} connected)\n\n"
        "Try, in another terminal:\n"
        f"  {hubd} alloc request --provisioner local --wait\n"
        f"  {hubd} alloc list\n"
        f"  {hubd} alloc show {allocation.id}\n"
        f"  {hubd} alloc release {allocation.id}\n"
        f"  curl -s http://{config.admin.host}:{daemon.admin.port if daemon.admin else 0}/metrics\n"
        f"Data: {config.state_path / 'pgdata'}   Stop with Ctrl-C (releases what is running).\n"
    )
    assert current.status is Status.ALLOCATED


async def _release_everything(daemon: Daemon) -> None:
    """Leave nothing running: a dev session's sidecars live in their own sessions and would
    otherwise outlive it."""
    store, reconciler = daemon.store, daemon.reconciler
    assert store is not None
    assert reconciler is not None
    active = await store.list_active()
    if not active:
        return
    _say(f"==> releasing {len(active)} allocation(s) before stopping")
    for allocation in active:
        await store.release(allocation.id, reason="hubd dev stopped")
    while await store.list_active():
        if not await reconciler.reconcile_until_idle():
            await asyncio.sleep(0.2)


async def run_dev(config: Config) -> int:
    daemon = Daemon(dev_config(config), on_started=_demo, on_stopping=_release_everything)
    return await daemon.run()
