"""The ``hubd`` command line.

Exit codes: 0 success, 1 the operation failed (e.g. the allocation went ``failed``), 2 usage or
configuration error, 3 database unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from hubd.api_key_command import add_arguments as add_api_key_arguments
from hubd.api_key_command import cmd_api_key
from hubd.commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    add_alloc_commands,
    cmd_alloc,
    cmd_migrate,
)
from hubd.config import Config, load_config, render_toml
from hubd.errors import (
    AllocationNotFound,
    ConfigError,
    DatabaseUnavailable,
    EmbeddedPostgresError,
    HubdError,
    IdempotencyConflict,
    InvalidRequest,
    PluginLoadError,
)
from hubd.logs import configure_logging, flush_logs, journal_prefix, stderr_is_journal
from hubd.sidecar.command import add_arguments as add_sidecar_arguments
from hubd.sidecar.command import options_from as sidecar_options
from hubd.store import Status
from hubd.tenant_command import add_arguments as add_tenant_arguments
from hubd.tenant_command import cmd_tenant

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"hubd: error: {message}\n")


def _json_object(text: str) -> dict[str, Any]:
    from hubd.store.inputs import MAX_SPEC_BYTES, MAX_SPEC_DEPTH

    if len(text.encode()) > MAX_SPEC_BYTES:
        raise argparse.ArgumentTypeError(f"larger than {MAX_SPEC_BYTES} bytes")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not valid JSON: {exc.msg} at column {exc.colno}"
        ) from exc
    except RecursionError:
        # The parser recurses per nesting level; deep enough input exhausts the stack.
        raise argparse.ArgumentTypeError(f"nests deeper than {MAX_SPEC_DEPTH} levels") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"cpu\": 2}'")
    return value


def _positive_seconds(text: str) -> float:
    from hubd.units import parse_duration

    try:
        return parse_duration(text if not text.replace(".", "", 1).isdigit() else f"{text}s")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _reason(text: str) -> str:
    from hubd.store.inputs import MAX_MESSAGE_LENGTH

    # Refused rather than cut: the ledger keeps the operator's words as written, or not at all.
    if not text.strip():
        raise argparse.ArgumentTypeError("say why the allocation is forgotten")
    if len(text) > MAX_MESSAGE_LENGTH:
        raise argparse.ArgumentTypeError(f"longer than {MAX_MESSAGE_LENGTH} characters")
    return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hubd")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    # --config is accepted before or after the command; the later one wins.
    common = _Parser(add_help=False)
    common.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help="config file (default: $HUBD_CONFIG, else built-in defaults)",
    )
    parser = _Parser(
        prog="hubd", description="Control-plane daemon for sidecar allocations.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"hubd {_version()}")
    # No set_defaults(config=...) here: the --config action is shared by every subparser (the
    # parents= mechanism copies the action object), so a default set on it would make each
    # subparser overwrite a --config given before its command. ``main`` reads a missing one as
    # None.
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    commands.add_parser("run", help="run the daemon", parents=[common])
    dev = commands.add_parser(
        "dev",
        help="run the daemon on its own embedded database with the local provisioner and a demo",
        description="Run the daemon on its own embedded database (state dir hubd-dev) with the "
        "local provisioner and a demo allocation. Ctrl-C releases what this session requested; "
        "a second Ctrl-C stops at once.",
        parents=[common],
    )
    dev.add_argument(
        "--allow-external-database",
        action="store_true",
        help="run on the configured database.url instead of refusing (it may be shared)",
    )
    # No --config: the sidecar is configured by its HUBD_* variables only.
    sidecar = commands.add_parser(
        "sidecar",
        help="the reference sidecar (reads HUBD_URL, HUBD_TOKEN, HUBD_ALLOCATION_ID, "
        "HUBD_SIDECAR_ID, HUBD_GENERATION)",
    )
    add_sidecar_arguments(sidecar)
    commands.add_parser("migrate", help="apply schema migrations", parents=[common])
    check = commands.add_parser(
        "check-config", help="validate and print the effective config", parents=[common]
    )
    check.add_argument(
        "--probe",
        action="store_true",
        help="also build each provisioner and ask it whether it can make sidecars here "
        "(its engine answers, its image or command is there); creates nothing",
    )
    db_url = commands.add_parser(
        "db-url",
        help="print the DSN an application uses to reach this hubd's database",
        description="Print the DSN an application uses to reach this hubd's database: the "
        "configured database.url, its password hidden, or the embedded server's Unix-socket "
        "DSN (worked out from the config; nothing is started).",
        parents=[common],
    )
    db_url.add_argument(
        "--show-password", action="store_true", help="print database.url's password as it is"
    )

    alloc = commands.add_parser(
        "alloc", help="request, release and inspect allocations", parents=[common]
    )
    alloc_commands = alloc.add_subparsers(dest="alloc_command", required=True, parser_class=_Parser)

    request = alloc_commands.add_parser(
        "request", help="request an allocation; prints its id", parents=[common]
    )
    request.add_argument(
        "--provisioner", required=True, help="the provisioner id, as in [[provisioners]] id"
    )
    request.add_argument("--tenant", help="a label for the tenant the sidecar serves")
    request.add_argument("--session", help="a label for the session the sidecar serves")
    request.add_argument("--spec", type=_json_object, default={}, help="a JSON object")
    request.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="the same key (within a tenant) returns the same allocation, never a second one; "
        "a key already used for a different request is an error (exit 1)",
    )
    request.add_argument(
        "--ready-when",
        choices=["connected", "declared"],
        help="ready once the sidecar connects, or once it declares itself ready "
        "(default: the provisioner's setting)",
    )
    request.add_argument(
        "--lifetime",
        type=_positive_seconds,
        help="release it this long after the request, e.g. 30m (default: the provisioner's "
        "max_lifetime, if any; never longer)",
    )
    request.add_argument(
        "--idle-timeout",
        type=_positive_seconds,
        help="once ready, release it after this long unused, e.g. 15m (default: the "
        "provisioner's idle_timeout, if any; never longer)",
    )
    request.add_argument("--wait", action="store_true", help="wait until ready or terminal")
    request.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=300.0,
        help="how long --wait waits, e.g. 60s or 5m (default: 300s); the allocation outlives it",
    )
    request.add_argument(
        "--json",
        action="store_true",
        help="print the allocation as JSON instead of its id; with --wait, once the wait ends "
        "(ready, ended or timed out: the exit code says which)",
    )

    release = alloc_commands.add_parser("release", help="release an allocation", parents=[common])
    release.add_argument("id", help="the allocation id (al_…)")

    forget = alloc_commands.add_parser(
        "forget",
        help="end an allocation whose sidecar is gone for good, without destroying it",
        description="End an active allocation at once without destroying its sidecar, for one "
        "whose sidecar is gone for good (a release that can never finish, a provisioner that "
        "no longer exists). hubd makes no further attempt to destroy the sidecar: whatever it "
        "left behind is yours to clean up. A release in progress ends released, anything "
        "else failed; both with failure forgotten and your reason, which the ledger keeps.",
        parents=[common],
    )
    forget.add_argument("id", help="the allocation id (al_…)")
    forget.add_argument(
        "--reason",
        required=True,
        type=_reason,
        help="why, in at most 500 characters: kept in the ledger, and shown to the "
        "application as the allocation's failure_message",
    )
    forget.add_argument(
        "--confirm", action="store_true", help="forget it (without this nothing changes)"
    )

    listing = alloc_commands.add_parser(
        "list", help="list allocations, newest first", parents=[common]
    )
    listing.add_argument(
        "--status", choices=[str(s) for s in Status], help="only allocations in this status"
    )
    listing.add_argument("--json", action="store_true", help="a JSON array instead of a table")
    listing.add_argument(
        "--limit", type=int, default=1000, help="at most this many, newest first (1000)"
    )

    add_alloc_commands(alloc_commands, common, seconds=_positive_seconds)

    show = alloc_commands.add_parser(
        "show", help="an allocation, its history and next step", parents=[common]
    )
    show.add_argument("id", help="the allocation id (al_…)")
    show.add_argument("--json", action="store_true", help="one JSON object, history included")

    tenant = commands.add_parser(
        "tenant",
        help="wall the application API's database roles into tenants",
        description="Wall the database roles applications use into tenants: a walled role "
        "sees, requests and releases its tenant's allocations only (hubd_tenant_roles).",
        parents=[common],
    )
    add_tenant_arguments(tenant, common, _Parser)
    api_keys = commands.add_parser(
        "api-key", help="the HTTP API's keys (docs/http.md)", parents=[common]
    )
    add_api_key_arguments(api_keys, common)
    return parser


# -- commands --------------------------------------------------------------------------------


def cmd_check_config(config: Config, args: argparse.Namespace) -> int:
    from hubd.daemon.hooks import load_on_ready
    from hubd.plugins.preflight import preflight

    # The operator's pre-flight: a plugin that cannot be imported, or whose own parser refuses
    # its options, fails here (exit 2), not at start. Factories are called only under --probe:
    # building a provisioner may do I/O.
    notes = preflight(config.provisioners, state_dir=config.state_path, probe=args.probe)
    load_on_ready(config.reconciler.on_ready)
    print(render_toml(config.to_display_dict()), end="")
    print(f"# state dir: {config.state_path}")
    if config.database.embedded:
        print(f"# database: embedded PostgreSQL, data in {config.state_path / 'pgdata'}")
    if config.server.public_url or config.server.port:
        print(f"# sidecars dial: {config.server.effective_public_url}")
    else:
        print(
            f"# sidecars dial: {config.server.public_url_for(0).rsplit(':', 1)[0]}:<port> "
            "(server.listen uses port 0: the port is chosen at start; hubd run logs it)"
        )
    print(f"# provisioners: {', '.join(p.id for p in config.provisioners) or 'none'} (found)")
    print(*notes, sep="\n", end="\n" if notes else "")
    if config.reconciler.on_ready:
        print(f"# on_ready hook: {config.reconciler.on_ready} (found, async, takes 2 arguments)")
    return EXIT_OK


def cmd_db_url(config: Config, args: argparse.Namespace) -> int:
    from hubd.store.embedded.address import application_dsn

    print(application_dsn(config.database.url, config.state_path, show_password=args.show_password))
    return EXIT_OK


def _run_daemon(config: Config, args: argparse.Namespace) -> int:
    from hubd.daemon.collector import pace_collector
    from hubd.daemon.dev import run_dev
    from hubd.daemon.loops import loop_factory
    from hubd.daemon.service import Daemon

    pace_collector()
    factory = loop_factory(config.runtime.event_loop)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            if args.command == "dev":
                return runner.run(run_dev(config, config_path=getattr(args, "config", None)))
            return runner.run(Daemon(config).run())
    except ExceptionGroup:
        # A supervised background task died; the daemon logged which one and why.
        _say_error("hubd: stopped because a background task failed (see the log)")
        return EXIT_FAILED


def _say_error(text: str) -> None:
    # After the log lines the command wrote, which may still be held back.
    flush_logs()
    if stderr_is_journal():
        # Under systemd, an error at error priority, each line (a quoted server log has many).
        text = "\n".join(journal_prefix("error") + line for line in text.splitlines())
    print(text, file=sys.stderr)


# -- entry point -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        # Written out here, not at exit: a reader gone by then is a traceback nobody can catch.
        sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()
    return code


def _reader_gone() -> int:
    """Whoever read the output stopped reading (``hubd alloc list | head``): end silently, as
    git and coreutils do, by the SIGPIPE a write into a closed pipe means. Every block the
    command opened has let go by now (the database, an embedded server's share), so nothing
    is left behind by dying."""
    with contextlib.suppress(OSError, ValueError):
        flush_logs()
        sys.stderr.flush()
    # What is still buffered for the closed pipe goes nowhere rather than fail once more.
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
    # Python ignores SIGPIPE; restored, it ends the process as it would end any other command.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.raise_signal(signal.SIGPIPE)
    return 128 + signal.SIGPIPE  # the shell's number for it, where the signal did not end us


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "sidecar":
        # The sidecar is configured by its HUBD_* variables only, never by the hub's config.
        from hubd.sidecar.main import run_sidecar

        try:
            options = sidecar_options(args)
        except ValueError as exc:
            print(f"hubd sidecar: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return run_sidecar(os.environ, options)
    try:
        config = load_config(getattr(args, "config", None))
    except ConfigError as exc:
        print(f"hubd: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "dev":
        from hubd.daemon.dev import dev_config, external_database_refusal

        refusal = external_database_refusal(
            config, config_path=getattr(args, "config", None), env=os.environ
        )
        if refusal is not None and not args.allow_external_database:
            print(f"hubd: {refusal}", file=sys.stderr)
            return EXIT_USAGE
        config = dev_config(config)
    level = config.log.level
    if args.command in ("alloc", "tenant", "api-key") and level in ("info", "warning"):
        # A command's output is its answer; the daemon's routine news would only bury it.
        level = "warning"
    configure_logging(fmt=config.log.format, level=level)
    try:
        if args.command in ("run", "dev"):
            return _run_daemon(config, args)
        if args.command == "check-config":
            return cmd_check_config(config, args)
        if args.command == "db-url":
            return cmd_db_url(config, args)
        if args.command == "migrate":
            return asyncio.run(cmd_migrate(config, args))
        if args.command == "alloc":
            return asyncio.run(cmd_alloc(config, args))
        if args.command == "tenant":
            return asyncio.run(cmd_tenant(config, args))
        if args.command == "api-key":
            return asyncio.run(cmd_api_key(config, args))
    except IdempotencyConflict as exc:
        # Not a usage error: the request was well formed, and the key is taken.
        _say_error(f"hubd: {exc}")
        return EXIT_FAILED
    except (InvalidRequest, ConfigError, PluginLoadError) as exc:
        _say_error(f"hubd: {exc}")
        return EXIT_USAGE
    except AllocationNotFound as exc:
        _say_error(f"hubd: {exc}")
        return EXIT_FAILED
    except (DatabaseUnavailable, EmbeddedPostgresError) as exc:
        _say_error(f"hubd: database unreachable: {exc}")
        return EXIT_UNREACHABLE
    except HubdError as exc:
        _say_error(f"hubd: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
