"""``hubd tenant``: wall the application API's database roles into tenants.

``grant ROLE --tenant NAME`` walls ROLE into a tenant and grants it ``hubd_app``;
``grant ROLE --every-tenant`` makes it an operator's role that sees every tenant. ``revoke ROLE``
removes the wall and revokes ``hubd_app`` with it: a role that keeps ``hubd_app`` without a wall
sees every tenant, so that widening is only ever asked for by name (``--keep-app-role``), never a
default. ``list`` shows every wall, and every role that uses ``hubd_app`` without one.

Exit codes as for every command: 0 done, 1 the database refused (hubd's role may not grant
``hubd_app``, say), 2 bad input or a change refused because a wall would not hold, 3 database
unreachable. A refused change changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hubd import quota_command
from hubd.commands import EXIT_OK
from hubd.config import Config
from hubd.presentation import print_table, rfc3339
from hubd.store.connect import open_database
from hubd.store.tenants import (
    APP_ROLE,
    Granted,
    Revoked,
    TenantMap,
    TenantWalls,
    WallRow,
    quoted_role,
    scope_text,
)

__all__ = ["add_arguments", "cmd_tenant", "map_json"]


def add_arguments(
    tenant: argparse.ArgumentParser,
    common: argparse.ArgumentParser,
    parser_class: type[argparse.ArgumentParser],
) -> None:
    """The subcommands of ``hubd tenant``."""
    commands = tenant.add_subparsers(
        dest="tenant_command", required=True, parser_class=parser_class
    )
    grant = commands.add_parser(
        "grant",
        help="wall a database role into a tenant (or let it see every tenant) and grant it "
        f"{APP_ROLE}",
        description=f"Wall ROLE into one tenant and grant it {APP_ROLE}, in one transaction: "
        "through the application API it then reads, requests and releases that tenant's "
        "allocations only. With --every-tenant, ROLE is an operator's role that sees every "
        "tenant. Refused (exit 2) for a role no wall would hold (a superuser, hubd's own role, "
        f"{APP_ROLE}, a role that reads hubd's tables directly) and for a change that would let "
        "a walled role reach past its wall through a membership.",
        parents=[common],
    )
    grant.add_argument("role", help="an existing database role, as pg_roles names it")
    scope = grant.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--tenant",
        metavar="NAME",
        help="the tenant the role is walled into (1-200 printable characters, as a request's)",
    )
    scope.add_argument("--every-tenant", action="store_true", help="let the role see every tenant")
    revoke = commands.add_parser(
        "revoke",
        help=f"remove a role's wall and revoke {APP_ROLE} from it",
        description=f"Remove ROLE's wall and revoke {APP_ROLE} from it, in one transaction: it "
        "can no longer call the application API. A role without a wall that can still call the "
        "API sees EVERY tenant, so if ROLE would still use "
        f"{APP_ROLE} through another role, nothing changes (exit 2) unless --keep-app-role.",
        parents=[common],
    )
    revoke.add_argument("role", help="the database role")
    revoke.add_argument(
        "--keep-app-role",
        action="store_true",
        help=f"remove the wall only: ROLE keeps {APP_ROLE} and sees EVERY tenant",
    )
    listing = commands.add_parser(
        "list",
        help=f"every wall, and every role that uses {APP_ROLE} without one",
        parents=[common],
    )
    listing.add_argument("--json", action="store_true", help="one JSON object instead of text")
    quota_command.add_arguments(commands, common, parser_class)


async def cmd_tenant(config: Config, args: argparse.Namespace) -> int:
    async with open_database(
        config.database.url, config.state_path, pool_size=config.database.pool_size
    ) as db:
        walls = TenantWalls(db)
        command = args.tenant_command
        if command == "quota":
            return await quota_command.cmd_quota(db, args)
        if command == "usage":
            return await quota_command.cmd_usage(db, args)
        if command == "grant":
            granted = await walls.grant(
                args.role, tenant_id=None if args.every_tenant else args.tenant
            )
            _print_granted(granted)
            return EXIT_OK
        if command == "revoke":
            revoked = await walls.revoke(args.role, keep_app_role=args.keep_app_role)
            _print_revoked(revoked)
            return EXIT_OK
        if command == "list":
            found = await walls.map()
            if args.json:
                print(json.dumps(map_json(found), indent=2))
            else:
                _print_map(found)
            return EXIT_OK
        raise AssertionError(command)


def _print_granted(granted: Granted) -> None:
    name = quoted_role(granted.role_name)
    if granted.tenant_id is None:
        line = f"{name} sees every tenant (an operator's role)"
    else:
        line = f"{name} is walled into {scope_text(granted.tenant_id)}"
    if granted.had_wall and granted.tenant_before == granted.tenant_id:
        line += " (unchanged)"
    elif granted.had_wall:
        line += f" (until now: {scope_text(granted.tenant_before)})"
    line += f"; {APP_ROLE} granted" if granted.granted_app else f"; it had {APP_ROLE} already"
    print(line)
    if not granted.can_login:
        print(
            f"hubd: note: {name} cannot log in: its wall holds the sessions that SET ROLE {name}",
            file=sys.stderr,
        )


def _print_revoked(revoked: Revoked) -> None:
    name = quoted_role(revoked.role_name)
    if revoked.had_wall:
        line = f"{name}: wall removed (it saw {scope_text(revoked.tenant_before)})"
    else:
        line = f"{name}: had no wall"
    if revoked.revoked_app:
        line += f"; {APP_ROLE} revoked"
    if not revoked.role_exists:
        line += " (no role of that name exists)"
    print(line)
    if revoked.past_walls:
        print(f"{name} reads hubd's tables directly: no wall held it, and it keeps {APP_ROLE}")
        return
    if not revoked.uses_app:
        if revoked.role_exists:
            print(f"{name} can no longer call the application API")
        return
    through = ", ".join(quoted_role(g) for g in revoked.app_through) or "a role granted it"
    print(f"{name} still uses {APP_ROLE} (through {through}) and sees EVERY tenant")
    if revoked.had_wall and revoked.tenant_before is not None:
        print(
            f"hubd: warning: removing the wall widened {name}'s access from "
            f"{scope_text(revoked.tenant_before)} to every tenant",
            file=sys.stderr,
        )


def map_json(found: TenantMap) -> dict[str, Any]:
    """``hubd tenant list --json``."""
    return {
        "any_wall": found.walled,
        "walls": [
            {
                "role": w.role_name,
                "tenant": w.tenant_id,
                "every_tenant": w.tenant_id is None,
                "granted_at": rfc3339(w.granted_at),
                "role_exists": w.role_exists,
                "can_login": w.can_login,
                "uses_hubd_app": w.holds_app,
                "reads_tables": w.reads_tables,
            }
            for w in found.walls
        ],
        "unwalled": [
            {
                "role": u.role_name,
                "can_login": u.can_login,
                "through": list(u.app_through),
                "sees_every_tenant": u.can_login,
            }
            for u in found.unwalled
        ],
        "table_readers": list(found.table_readers),
    }


def _wall_note(wall: WallRow) -> str:
    if not wall.role_exists:
        return "no role of that name exists (the wall holds one created again)"
    if wall.reads_tables:
        return "reads hubd's tables directly: past its wall"
    if not wall.holds_app:
        return f"no {APP_ROLE}: cannot call the API"
    if not wall.can_login:
        return "no login: holds the sessions that SET ROLE to it"
    return ""


def _print_map(found: TenantMap) -> None:
    if found.walls:
        print_table(
            ("ROLE", "SEES", "SINCE", "NOTE"),
            [
                (
                    quoted_role(w.role_name),
                    scope_text(w.tenant_id),
                    rfc3339(w.granted_at) or "-",
                    _wall_note(w),
                )
                for w in found.walls
            ],
        )
    else:
        print("No walls.")
    if found.unwalled:
        print()
        if found.walled:
            print(f"Use {APP_ROLE} with no wall; each login sees EVERY tenant:")
        else:
            print(f"Use {APP_ROLE} with no wall (no role is walled into a tenant: single-tenant):")
        print_table(
            ("ROLE", "SEES", "THROUGH"),
            [
                (
                    quoted_role(u.role_name),
                    "EVERY tenant"
                    if u.can_login
                    else "(no login: SET ROLE keeps the login's wall)",
                    ", ".join(quoted_role(g) for g in u.app_through) or "-",
                )
                for u in found.unwalled
            ],
            indent="  ",
        )
    if found.table_readers:
        print()
        readers = ", ".join(quoted_role(r) for r in found.table_readers)
        print(f"Read hubd's tables directly, past any wall: {readers}")
