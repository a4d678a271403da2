"""``hubd api-key``: the HTTP API's keys (docs/http.md).

``create (--tenant NAME | --every-tenant) [--name TEXT]`` prints a new key once (only its hash is
kept); ``revoke ID`` refuses it from the next request on, on every replica; ``list`` shows every
key without its secret.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hubd.commands import EXIT_FAILED, EXIT_OK
from hubd.config import Config
from hubd.presentation import print_table
from hubd.store.api_keys import ApiKey, ApiKeyStore
from hubd.store.connect import open_database

__all__ = ["add_arguments", "cmd_api_key"]


def add_arguments(parser: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="api_key_command", required=True)
    create = commands.add_parser(
        "create",
        help="make a key; it is printed once, only its hash is kept",
        parents=[common],
    )
    scope = create.add_mutually_exclusive_group(required=True)
    scope.add_argument("--tenant", help="the key sees, requests and follows this tenant alone")
    scope.add_argument(
        "--every-tenant", action="store_true", help="an operator's key: every tenant"
    )
    create.add_argument("--name", default="", help="what the key is for (shown by list)")
    revoke = commands.add_parser("revoke", help="refuse a key from now on", parents=[common])
    revoke.add_argument("id", help="the key's id (the 16 hex digits after hubd_)")
    listing = commands.add_parser("list", help="every key, never its secret", parents=[common])
    listing.add_argument("--json", action="store_true")


async def cmd_api_key(config: Config, args: argparse.Namespace) -> int:
    async with open_database(config.database.url, config.state_path, pool_size=1) as db:
        keys = ApiKeyStore(db)
        if args.api_key_command == "create":
            made, key = await keys.create(
                tenant=None if args.every_tenant else args.tenant, name=args.name
            )
            # The key alone on stdout, for a script to capture; what it is, on stderr.
            print(key, flush=True)
            sees = "every tenant" if made.tenant is None else f"tenant {made.tenant!r}"
            print(f"hubd: key {made.id} made for {sees}; it is shown once", file=sys.stderr)
            return EXIT_OK
        if args.api_key_command == "revoke":
            revoked = await keys.revoke(args.id)
            if revoked is None:
                print(f"hubd: no key {args.id!r}", file=sys.stderr)
                return EXIT_FAILED
            print(f"{revoked.id} revoked")
            return EXIT_OK
        listed = await keys.list()
        if args.json:
            print(json.dumps([_json(key) for key in listed], indent=2))
        else:
            print_table(
                ("ID", "TENANT", "NAME", "CREATED", "REVOKED"),
                [
                    (
                        k.id,
                        k.tenant or "(every tenant)",
                        k.name or "-",
                        k.created_at.isoformat(timespec="seconds"),
                        "-" if k.revoked_at is None else k.revoked_at.isoformat(timespec="seconds"),
                    )
                    for k in listed
                ],
            )
        return EXIT_OK


def _json(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.id,
        "tenant": key.tenant,
        "name": key.name,
        "created_at": key.created_at.isoformat(),
        "revoked_at": None if key.revoked_at is None else key.revoked_at.isoformat(),
    }
