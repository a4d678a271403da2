"""``hubd tenant quota`` and ``hubd tenant usage``: the operator's limits on what one tenant may
ask for, and what each tenant uses (docs/operations.md, "Quotas").

``quota (--tenant NAME | --default | --untenanted) [--max-active N] [--max-pending N]
[--rate R --burst B] [--no-max-active] [--no-max-pending] [--no-rate]`` sets what it is given and
keeps the rest; ``--clear`` removes the scope's quota. The database holds the quotas, so every
replica and every application enforces the same ones from the next request on; there is no
config file key for them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from hubd.commands import EXIT_OK
from hubd.presentation import print_table
from hubd.store.database import Database
from hubd.store.quotas import Quota, Quotas, QuotaScope, TenantUsage

__all__ = ["add_arguments", "cmd_quota", "cmd_usage", "usage_json"]


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number of 0 or more, not {text!r}")
    return int(text)


def _rate(text: str) -> float:
    try:
        value = float(text.removesuffix("/s"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be requests a second, e.g. 5 or 0.5, not {text!r}"
        ) from None
    if not 0 < value <= 1_000_000:
        raise argparse.ArgumentTypeError("must be above 0 and at most 1000000 a second")
    return value


def add_arguments(
    commands: Any, common: argparse.ArgumentParser, parser_class: type[argparse.ArgumentParser]
) -> None:
    """``quota`` and ``usage`` under ``hubd tenant``."""
    del parser_class
    quota = commands.add_parser(
        "quota",
        help="set or clear a tenant's quota (or the default)",
        description="Bound what one tenant may ask for: allocations not yet ended "
        "(--max-active), allocations waiting for a sidecar (--max-pending) and a request rate "
        "(--rate requests a second, --burst at once). A request over a limit fails in the "
        "caller's transaction with SQLSTATE HU429, naming the limit. The default applies to "
        "every tenant without a quota of its own (each counted on its own), and to requests "
        "with no tenant unless --untenanted has one. What is not given is kept.",
        parents=[common],
    )
    scope = quota.add_mutually_exclusive_group(required=True)
    scope.add_argument("--tenant", metavar="NAME", help="the tenant")
    scope.add_argument("--default", action="store_true", help="every tenant without its own")
    scope.add_argument("--untenanted", action="store_true", help="requests with no tenant")
    quota.add_argument("--max-active", type=_count, metavar="N")
    quota.add_argument("--max-pending", type=_count, metavar="N")
    quota.add_argument("--rate", type=_rate, metavar="R", help="requests a second, refilled")
    quota.add_argument("--burst", type=_count, metavar="B", help="requests at once (≥ 1)")
    for name in ("max-active", "max-pending", "rate"):
        quota.add_argument(f"--no-{name}", action="store_true", help=f"remove the {name} limit")
    quota.add_argument("--clear", action="store_true", help="remove the scope's quota")
    quota.add_argument("--json", action="store_true", help="print the quota as JSON")
    usage = commands.add_parser(
        "usage",
        help="what each tenant uses, and the quota that applies to it",
        parents=[common],
    )
    usage.add_argument("--json", action="store_true", help="a JSON array instead of a table")


def _scope(args: argparse.Namespace) -> QuotaScope:
    if args.default:
        return QuotaScope.default()
    if args.untenanted:
        return QuotaScope.untenanted()
    return QuotaScope.tenant(args.tenant)


async def cmd_quota(db: Database, args: argparse.Namespace) -> int:
    quotas, scope = Quotas(db), _scope(args)
    if args.clear:
        if await quotas.clear(scope):
            print(f"{scope.describe()}: quota removed")
        else:
            print(f"{scope.describe()} had no quota of its own", file=sys.stderr)
        return EXIT_OK
    clear = frozenset(
        name
        for name, flag in (
            ("max_active", args.no_max_active),
            ("max_pending", args.no_max_pending),
            ("rate", args.no_rate),
        )
        if flag
    )
    if (args.rate is None) != (args.burst is None):
        print("hubd: --rate and --burst go together", file=sys.stderr)
        return 2
    quota = await quotas.set(
        scope,
        max_active=args.max_active,
        max_pending=args.max_pending,
        rate=args.rate,
        burst=args.burst,
        clear=clear,
    )
    if args.json:
        print(json.dumps(_quota_json(quota), indent=2))
    else:
        print(f"{scope.describe()}: {_limits(quota)}")
    return EXIT_OK


async def cmd_usage(db: Database, args: argparse.Namespace) -> int:
    found = await Quotas(db).usage()
    if args.json:
        print(json.dumps(usage_json(found), indent=2))
        return EXIT_OK
    if not found:
        print("No allocations and no quotas.")
        return EXIT_OK
    rows = [
        (
            _name(u.scope),
            str(u.active),
            str(u.pending),
            "-" if u.quota is None else _limits(u.quota),
            "-" if u.tokens is None else f"{u.tokens:.1f}",
        )
        for u in found
    ]
    print_table(("TENANT", "ACTIVE", "PENDING", "QUOTA", "BUCKET"), rows)
    return EXIT_OK


def _name(scope: QuotaScope) -> str:
    if scope.key.startswith("tenant:"):
        return scope.key.removeprefix("tenant:")
    return f"({scope.key})"


def _limits(quota: Quota) -> str:
    parts = []
    if quota.max_active is not None:
        parts.append(f"max_active {quota.max_active}")
    if quota.max_pending is not None:
        parts.append(f"max_pending {quota.max_pending}")
    if quota.rate is not None:
        parts.append(f"rate {quota.rate:g}/s burst {quota.burst}")
    shown = ", ".join(parts) or "no limits"
    if quota.scope.key == "default":
        shown += " (default)"
    return shown


def _quota_json(quota: Quota) -> dict[str, Any]:
    return {
        "scope": quota.scope.key,
        "max_active": quota.max_active,
        "max_pending": quota.max_pending,
        "rate": quota.rate,
        "burst": quota.burst,
    }


def usage_json(found: Sequence[TenantUsage]) -> list[dict[str, Any]]:
    """``hubd tenant usage --json``."""
    return [
        {
            "scope": u.scope.key,
            "tenant": u.scope.key.removeprefix("tenant:")
            if u.scope.key.startswith("tenant:")
            else None,
            "active": u.active,
            "pending": u.pending,
            "quota": None if u.quota is None else _quota_json(u.quota),
            "tokens": u.tokens,
            "admitted": u.admitted,
        }
        for u in found
    ]
