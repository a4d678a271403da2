"""The commands that work on the database: ``hubd migrate`` and ``hubd alloc``.

Exit codes: 0 success, 1 the operation failed (e.g. the allocation went ``failed``), 2 usage or
configuration error, 3 database unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Final

import attrs

from hubd.client import Client
from hubd.config import Config
from hubd.errors import InvalidRequest, PluginError
from hubd.plugins.protocol import SidecarOutput
from hubd.plugins.registry import load_provisioners
from hubd.presentation import allocation_json, next_step, print_table, rfc3339
from hubd.store import AllocationStore, Database, LedgerStore, Status
from hubd.store.connect import open_database
from hubd.store.instances import InstanceStore
from hubd.store.migrate import apply_migrations
from hubd.store.pools import pool_stats

__all__ = [
    "CLI_INSTANCE",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "add_alloc_commands",
    "cmd_alloc",
    "cmd_migrate",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3

CLI_INSTANCE: Final = "cli"


async def _with_database(config: Config, work: Callable[[Database], Awaitable[int]]) -> int:
    async with open_database(
        config.database.url, config.state_path, pool_size=config.database.pool_size
    ) as db:
        return await work(db)


async def cmd_migrate(config: Config, _args: argparse.Namespace) -> int:
    async def work(db: Database) -> int:
        async with db.connection("migrate") as conn:
            applied = await apply_migrations(conn)
        if applied:
            for migration in applied:
                print(f"applied {migration.version:04d}_{migration.name}")
        else:
            print("schema is up to date")
        return EXIT_OK

    return await _with_database(config, work)


def add_alloc_commands(
    alloc_commands: Any, common: argparse.ArgumentParser, *, seconds: Callable[[str], float]
) -> None:
    """``hubd alloc extend``, ``touch``, ``logs`` and ``pools``; ``seconds`` parses a duration."""
    extend = alloc_commands.add_parser(
        "extend",
        help="make a live allocation end later, within its provisioner's max_lifetime",
        parents=[common],
    )
    extend.add_argument("id", help="the allocation id (al_…)")
    extend.add_argument(
        "--lifetime", type=seconds, required=True, help="it ends this long from now, e.g. 1h"
    )
    touch = alloc_commands.add_parser(
        "touch",
        help="an allocation is still in use: its idle clock starts again",
        parents=[common],
    )
    touch.add_argument("id", help="the allocation id (al_…)")
    logs = alloc_commands.add_parser(
        "logs",
        help="what an allocation's sidecar wrote (the kept tail once it died)",
        parents=[common],
    )
    logs.add_argument("id", help="the allocation id (al_…)")
    logs.add_argument(
        "--tail", type=_positive_int, default=None, help="only the last N lines (default: all)"
    )
    logs.add_argument(
        "-f", "--follow", action="store_true", help="then follow what it writes until it stops"
    )
    pools = alloc_commands.add_parser(
        "pools",
        help="the warm pools: size, members ready and starting, takes and misses",
        parents=[common],
    )
    pools.add_argument("--json", action="store_true", help="a JSON array instead of a table")


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


async def cmd_alloc(config: Config, args: argparse.Namespace) -> int:
    if args.alloc_command == "forget" and not args.confirm:
        # Before the database: nothing is read or changed until the operator has read this.
        print(
            f"hubd: forgetting {args.id} ends it without destroying its sidecar: hubd makes no "
            "further attempt to destroy it, so whatever it left behind (a process, a container, "
            "files) is yours to clean up. To have hubd destroy it, use `hubd alloc release "
            f"{args.id}`; to forget it anyway, add --confirm",
            file=sys.stderr,
        )
        return EXIT_USAGE

    async def work(db: Database) -> int:
        store = AllocationStore(db, instance_id=CLI_INSTANCE)
        ledger = LedgerStore(db, instance_id=CLI_INSTANCE)
        command = args.alloc_command
        if command == "request":
            await _check_provisioner(db, config, args.provisioner)
            allocation = await store.request(
                provisioner_id=args.provisioner,
                tenant_id=args.tenant,
                session_id=args.session,
                spec=args.spec,
                idempotency_key=args.idempotency_key,
                ready_when=args.ready_when,
                lifetime=args.lifetime,
                idle_timeout=args.idle_timeout,
            )
            if not args.json:
                print(allocation.id, flush=True)
            elif not args.wait:
                print(json.dumps(allocation_json(allocation), indent=2), flush=True)
            if not args.wait:
                return EXIT_OK
            code = await _wait(db, allocation.id, args.timeout)
            if args.json:
                # What the wait came to (ready, ended, or still on its way when it ran out),
                # not the pending row a script would have to look up again.
                settled = await store.get(allocation.id)
                print(json.dumps(allocation_json(settled), indent=2), flush=True)
            return code
        if command == "release":
            released = await store.release(args.id, reason="released from the command line")
            print(f"{released.id} {released.status}")
            return EXIT_OK
        if command == "extend":
            return await _extend(store, args.id, args.lifetime)
        if command == "touch":
            return await _touch(store, args.id)
        if command == "forget":
            return await _forget(store, args.id, args.reason)
        if command == "pools":
            return await _pools(db, as_json=args.json)
        if command == "list":
            status = Status(args.status) if args.status else None
            rows = await store.list_allocations(status=status, limit=args.limit)
            if args.json:
                print(json.dumps([allocation_json(a) for a in rows], indent=2))
            else:
                _print_table(rows)
            return EXIT_OK
        if command == "logs":
            return await _logs(db, config, args.id, tail=args.tail, follow=args.follow)
        if command == "show":
            allocation = await store.get(args.id)
            history = await ledger.history(args.id)
            alive = any(i.alive for i in await InstanceStore(db).list(config.instance.ttl))
            step = next_step(allocation, datetime.now(UTC), daemon_alive=alive)
            if args.json:
                print(json.dumps({**allocation_json(allocation, history), "next": step}, indent=2))
            else:
                _print_show(allocation, history, step)
            return EXIT_OK
        raise AssertionError(command)

    return await _with_database(config, work)


async def _extend(store: AllocationStore, allocation_id: str, lifetime: float) -> int:
    extended = await store.extend(allocation_id, lifetime)
    ends = rfc3339(extended.expires_at) or "never"
    print(f"{extended.id} {extended.status} ends {ends}")
    return EXIT_OK


async def _touch(store: AllocationStore, allocation_id: str) -> int:
    touched = await store.touch(allocation_id)
    idle = rfc3339(touched.idle_at) if touched.status is Status.ALLOCATED else None
    print(f"{touched.id} {touched.status} idle at {idle or 'never'}")
    return EXIT_OK


async def _pools(db: Database, *, as_json: bool) -> int:
    found = await pool_stats(db)
    if as_json:
        print(json.dumps([attrs.asdict(p) for p in found], indent=2))
        return EXIT_OK
    print_table(
        ("POOL", "PROVISIONER", "SIZE", "READY", "STARTING", "TAKEN", "MISSED"),
        [
            (p.id, p.provisioner, *map(str, (p.size, p.ready, p.starting, p.taken, p.missed)))
            for p in found
        ],
    )
    return EXIT_OK


async def _forget(store: AllocationStore, allocation_id: str, reason: str) -> int:
    forgotten = await store.forget(allocation_id, reason=reason)
    if forgotten is None:
        ended = await store.get(allocation_id)  # an unknown id raises: exit 1, "no allocation"
        why = f" ({ended.failure_code}: {ended.failure_message})" if ended.failure_code else ""
        print(
            f"hubd: {allocation_id} has ended already ({ended.status}{why}): nothing to forget",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(f"{forgotten.id} {forgotten.status}")
    if forgotten.sidecar_id is None:
        left = "no sidecar was bound to it"
    else:
        where = f", external ref {forgotten.external_ref}" if forgotten.external_ref else ""
        left = (
            f"hubd makes no further attempt to destroy its sidecar {forgotten.sidecar_id}"
            f"{where}: whatever it left behind is yours to clean up"
        )
    print(f"hubd: forgot {allocation_id}; {left}", file=sys.stderr)
    return EXIT_OK


async def _logs(
    db: Database, config: Config, allocation_id: str, *, tail: int | None, follow: bool
) -> int:
    """What the allocation's sidecar wrote: from its provisioner while the sidecar is there
    (the last ``tail`` lines, then with ``follow`` what it writes), else the tail kept in the
    ledger when its provisioner reported it dead."""
    allocation = await AllocationStore(db, instance_id=CLI_INSTANCE).get(allocation_id)
    history = await LedgerStore(db, instance_id=CLI_INSTANCE).history(allocation_id)
    kept = [entry for entry in history if entry.kind == "sidecar_exited"]
    source = _output_source(config, allocation.provisioner_id)
    problem = (
        f"its provisioner {allocation.provisioner_id!r} does not keep sidecars' output"
        if source is None
        else None
    )
    if source is not None and allocation.sidecar_id is not None and allocation.active:
        try:
            async for chunk in source.sidecar_output(
                allocation.sidecar_id, allocation.external_ref, tail=tail, follow=follow
            ):
                sys.stdout.write(chunk)
                sys.stdout.flush()
            return EXIT_OK
        except LookupError:
            problem = f"its sidecar {allocation.sidecar_id} is gone"
        except PluginError as exc:
            problem = str(exc)
    elif allocation.sidecar_id is None:
        problem = "no sidecar was bound to it"
    elif not allocation.active:
        problem = f"it has ended ({allocation.status}) and its sidecar with it"
    if kept:
        print(f"hubd: {problem}; what its sidecars said as they died:", file=sys.stderr)
        for entry in kept:
            print(f"{rfc3339(entry.at)}  gen {entry.generation}  {entry.message}")
        return EXIT_OK
    print(f"hubd: no output of {allocation_id}: {problem}", file=sys.stderr)
    return EXIT_FAILED


def _output_source(config: Config, provisioner_id: str) -> SidecarOutput | None:
    """The configured provisioner ``provisioner_id``, built here, when it can show what its
    sidecars write."""
    configs = [p for p in config.provisioners if p.id == provisioner_id]
    if not configs:
        return None
    built = load_provisioners(configs, state_dir=config.state_path)[provisioner_id]
    return built if isinstance(built, SidecarOutput) else None


async def _check_provisioner(db: Database, config: Config, provisioner_id: str) -> None:
    """Refuse a provisioner id that no running daemon serves (the daemons' instance rows say
    which they serve); with no daemon to ask, accept it with a warning."""
    alive = [
        i
        for i in await InstanceStore(db).list(config.instance.ttl)
        if i.alive and i.provisioners is not None
    ]
    if not alive:
        print(
            f"hubd: warning: no running daemon says which provisioners it serves; "
            f"--provisioner {provisioner_id} is accepted unchecked (it fails as "
            "provisioner_unavailable if the daemon that claims it does not serve it)",
            file=sys.stderr,
        )
        return
    served = sorted({p for i in alive for p in i.provisioners or ()})
    if provisioner_id not in served:
        close = difflib.get_close_matches(provisioner_id, served, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InvalidRequest(
            f"--provisioner {provisioner_id!r}: no running daemon serves it (they serve: "
            f"{', '.join(served) or 'none'}){hint}"
        )


async def _wait(db: Database, allocation_id: str, limit: float) -> int:
    """Follow the allocation on the event feed (LISTEN, not polling) until it is ready or
    ends, printing each change of its state."""
    last: tuple[str, int, bool] | None = None
    states = Client(db.pool).watch(allocation_id)
    try:
        async with asyncio.timeout(limit), contextlib.aclosing(states):
            async for info in states:
                state = (info.status, info.generation, info.ready)
                if state != last:
                    last = state
                    label = "ready" if info.ready else info.status
                    print(
                        f"{allocation_id}: {label} (generation {info.generation})",
                        file=sys.stderr,
                        flush=True,
                    )
                if info.ready:
                    return EXIT_OK
                if info.terminal:
                    if info.failure_code:
                        print(
                            f"{allocation_id}: {info.failure_code}: {info.failure_message}",
                            file=sys.stderr,
                        )
                    return EXIT_FAILED
        raise AssertionError("a watch ends only when it is closed")
    except TimeoutError:
        status = last[0] if last is not None else "unknown"
        print(
            f"{allocation_id}: not ready after {limit:g}s (still {status}); the allocation "
            "stays requested and hubd keeps working on it. Watch it with "
            f"`hubd alloc show {allocation_id}`, or give it up with "
            f"`hubd alloc release {allocation_id}`",
            file=sys.stderr,
        )
        return EXIT_FAILED


def _printable(value: object) -> object:
    """A string a terminal shows as it is; one with control or formatting characters (what a
    sidecar published, say) quoted as JSON, which escapes them."""
    if isinstance(value, str) and not value.isprintable():
        return json.dumps(value)
    return value


def _print_table(rows: Sequence[Any]) -> None:
    headers = ("ID", "STATUS", "GEN", "READY", "PROVISIONER", "TENANT", "SESSION", "CREATED")
    table = [headers] + [
        (
            a.id,
            str(a.status),
            str(a.generation),
            "yes" if a.ready else "no",
            a.provisioner_id,
            a.tenant_id or "-",
            a.session_id or "-",
            rfc3339(a.created_at) or "-",
        )
        for a in rows
    ]
    print_table(table[0], table[1:])


def _print_show(allocation: Any, history: Sequence[Any], step: str) -> None:
    data = allocation_json(allocation)
    data.pop("spec")  # shown last, as JSON
    metadata = data.pop("metadata")  # likewise
    for key, value in data.items():
        shown = (
            "-"
            if value is None
            else ("yes" if value is True else "no" if value is False else _printable(value))
        )
        print(f"{key + ':':<18}{shown}")
    print(f"{'metadata:':<18}{'-' if metadata is None else json.dumps(metadata)}")
    print(f"{'spec:':<18}{json.dumps(dict(allocation.spec))}")
    print(f"{'next:':<18}{step}")
    print("history:")
    for entry in history:
        change = (
            entry.to_status
            if entry.from_status in (None, entry.to_status)
            else (f"{entry.from_status} -> {entry.to_status}")
        )
        detail = (
            f" {entry.error_code}: {entry.message}"
            if entry.error_code
            else (f" {entry.message}" if entry.message else "")
        )
        took = f" ({entry.duration_ms:.0f} ms)" if entry.duration_ms is not None else ""
        print(
            f"  {rfc3339(entry.at)}  gen {entry.generation}  {entry.kind:<28} {entry.phase:<9} "
            f"{change}{took}{detail}"
        )
