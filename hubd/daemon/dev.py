"""``hubd dev``: the daemon on its own embedded database with the local provisioner running the
reference sidecar, console logs, and a demo allocation that becomes ready in front of you.

``dev`` is for a laptop, never for a database real daemons share: its ``local`` provisioner runs
another command than a service's would (so the two would strand each other's allocations on a
binding mismatch), and Ctrl-C releases what it started. So it keeps a state dir of its own, refuses
a configured database URL unless told ``--allow-external-database``, and releases only the
allocations it requested itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs

from hubd.config import Config, LogConfig, ProvisionerConfig, StateConfig, default_state_dir
from hubd.daemon.service import Daemon
from hubd.logs import flush_logs
from hubd.redaction import redact_dsn
from hubd.store.embedded.address import application_dsn
from hubd.store.rows import Status

__all__ = ["DevSession", "dev_config", "external_database_refusal", "run_dev"]

DEMO_TIMEOUT: Final = 60.0
DEV_STATE_NAME: Final = "hubd-dev"
"""The default state dir's name: never the one ``hubd run`` uses, so ``dev`` never joins a
service's embedded database by accident."""
SHOWN_IDS: Final = 5


def dev_config(config: Config) -> Config:
    """``config`` with console logs, a ``local`` provisioner that runs ``hubd sidecar``, and
    (unless ``state.dir`` is set) a state dir of its own."""
    sidecar = [sys.executable, "-m", "hubd.cli", "sidecar"]
    local = ProvisionerConfig(id="local", plugin="local", options={"command": sidecar})
    others = tuple(p for p in config.provisioners if p.id != "local")
    state = (
        config.state
        if config.state.dir
        else StateConfig(dir=str(default_state_dir(DEV_STATE_NAME)))
    )
    return attrs.evolve(
        config,
        state=state,
        provisioners=(local, *others),
        log=LogConfig(format="console", level=config.log.level),
    )


def external_database_refusal(
    config: Config, *, config_path: str | None, env: Mapping[str, str]
) -> str | None:
    """Why ``dev`` will not run on ``config``'s database, or ``None`` when it is dev's own
    embedded one."""
    if config.database.embedded:
        return None
    if env.get("HUBD_DATABASE_URL"):
        source = "HUBD_DATABASE_URL"
    else:
        source = f"database.url in {config_path or env.get('HUBD_CONFIG') or 'the config'}"
    return (
        f"hubd dev runs on its own embedded PostgreSQL, but {source} names "
        f"{redact_dsn(config.database.url)}; on a database that real daemons share, dev's local "
        "provisioner would strand their allocations. Unset it, or pass "
        "--allow-external-database to use that database anyway (dev then still releases only "
        "what it requested)"
    )


def _command(config: Config, config_path: str | None) -> str:
    """How to call this hubd from a shell so that it reaches the same database: the script that
    started us, with the config file and state dir this session uses."""
    script = Path(sys.argv[0])
    command = "hubd"
    if script.name == "hubd" and shutil.which("hubd") != str(script.resolve()):
        command = os.path.relpath(script) if not script.is_absolute() else str(script)
    prefix = []
    if config_path or os.environ.get("HUBD_CONFIG"):
        prefix.append(f"HUBD_CONFIG={shlex.quote(config_path or os.environ['HUBD_CONFIG'])}")
    if config.database.embedded:
        prefix.append(f"HUBD_STATE_DIR={shlex.quote(str(config.state_path))}")
    return " ".join((*prefix, command))


def _shown(value: object) -> str:
    """A published value as one line a terminal shows as it is (JSON escapes what it must)."""
    if value is None:
        return "- (none published)"
    if isinstance(value, str) and value.isprintable():
        return value
    return json.dumps(value)


def _application_lines(config: Config) -> str:
    """An application's three lines against this session's database, with the Python client."""
    dsn = application_dsn(config.database.url, config.state_path)
    return (
        "An application gets a ready sidecar and its endpoint in three lines (hubd.client;\n"
        "the DSN is what `hubd db-url` prints):\n"
        f"  async with await Client.connect({dsn!r}) as hubd:\n"
        '      allocation = await hubd.request("local", session="my-session")\n'
        "      ready = await hubd.wait_ready(allocation.id, timeout=60)\n"
        "      print(ready.endpoint, ready.metadata)\n"
    )


def _say(text: str) -> None:
    # In order with the log lines of this loop iteration, which are held back until its end.
    flush_logs()
    print(text, file=sys.stderr, flush=True)


def _ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


@attrs.define
class DevSession:
    """What one ``hubd dev`` run requested, and what of it is still not released."""

    config_path: str | None = None
    requested: list[str] = attrs.Factory(list)
    left: dict[str, str] = attrs.Factory(dict)
    """Allocations this session requested whose release has not finished: id → what holds it."""

    async def on_started(self, daemon: Daemon) -> None:
        store = daemon.running.store
        allocation = await store.request(provisioner_id="local", session_id="hubd-dev-demo")
        self.requested.append(allocation.id)
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
        hubd = _command(config, self.config_path)
        # What the row holds now: the provisioner's acceptance, and whatever the sidecar has
        # published by this moment.
        current = await store.get(allocation.id)
        _say(
            f"==> {allocation.id} is READY (sidecar {current.sidecar_id} connected)\n"
            f"    endpoint: {_shown(current.endpoint)}\n"
            f"    metadata: {_shown(current.metadata)}\n\n"
            f"{_application_lines(config)}\n"
            "Try, in another terminal:\n"
            f"  {hubd} alloc request --provisioner local --wait\n"
            f"  {hubd} alloc list\n"
            f"  {hubd} alloc show {allocation.id}\n"
            f"  {hubd} alloc release {allocation.id}\n"
            f"  {hubd} db-url\n"
            f"  curl -s http://{config.admin.host}:{daemon.running.admin.port}"
            "/metrics\n"
            f"Data: {config.state_path / 'pgdata'}   Stop with Ctrl-C (releases what this session "
            "requested; twice stops at once).\n"
        )
        assert current.status is Status.ALLOCATED

    async def on_stopping(self, daemon: Daemon) -> None:
        """Release what this session requested and wait for it: a dev session's sidecars live
        in their own sessions and would otherwise outlive it. Anything else in the database
        (requested from another shell, or by an application) is not dev's to end."""
        store, reconciler = daemon.running.store, daemon.running.reconciler
        # Until the database says otherwise, nothing is known to be released: a second Ctrl-C
        # that cuts this short reports these.
        self.left = dict.fromkeys(self.requested, "release not confirmed")
        others = [a.id for a in await store.list_active() if a.id not in self.requested]
        if others:
            _say(
                f"==> leaving {len(others)} allocation(s) this session did not request "
                f"active: {_ids(others)} (release with: hubd alloc release ID)"
            )
        for allocation_id in self.requested:
            current = await store.get(allocation_id)
            if current.active:
                self.left[allocation_id] = str(current.status)
            else:
                del self.left[allocation_id]
        if not self.left:
            return
        _say(f"==> releasing {len(self.left)} allocation(s) this session requested")
        for allocation_id in list(self.left):
            await store.release(allocation_id, reason="hubd dev stopped")
        while True:
            stuck = 0
            for allocation_id in list(self.left):
                current = await store.get(allocation_id)
                if current.status.terminal:
                    del self.left[allocation_id]
                elif (
                    current.status is Status.RELEASING
                    and current.failure_code == "provisioner_unavailable"
                ):
                    # Only a daemon bound as this allocation was can destroy its sidecar;
                    # waiting here would only repeat the same warning until the grace ends.
                    self.left[allocation_id] = f"{current.status}: {current.failure_message}"
                    stuck += 1
                else:
                    self.left[allocation_id] = str(current.status)
            if len(self.left) == stuck:
                return
            if not await reconciler.reconcile_until_idle():
                await asyncio.sleep(0.2)

    def report(self) -> bool:
        """Say what the release left behind; ``True`` when it finished."""
        if not self.left:
            return True
        _say(f"==> stopped before the release finished; {len(self.left)} allocation(s) left:")
        for allocation_id, state in self.left.items():
            _say(f"  {allocation_id} {state}")
        _say(
            "They are finished by the next hubd serving this database (hubd dev again, with the "
            "same state dir); see: hubd alloc show ID"
        )
        return False


async def run_dev(config: Config, *, config_path: str | None = None) -> int:
    """Run ``dev``; exit 1 when the release it promised did not finish."""
    session = DevSession(config_path=config_path)
    daemon = Daemon(
        dev_config(config), on_started=session.on_started, on_stopping=session.on_stopping
    )
    code = await daemon.run()
    if not session.report() and code == 0:
        return 1
    return code
