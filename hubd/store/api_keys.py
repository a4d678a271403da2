"""The HTTP API's keys: made and revoked by the operator, checked on every HTTP request.

A key reads ``hubd_<id>.<secret>``: 16 hex digits that name its row, then 43 characters of
URL-safe base64 (32 random bytes). Only the secret's sha256 is stored; the key is shown once,
when it is made. A secret with 256 bits of entropy needs no slow hash: nobody can guess one, and
a stolen hash opens nothing. Checking compares the hashes in constant time (hmac).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

import attrs

from hubd.errors import InvalidRequest
from hubd.store.database import Database
from hubd.store.inputs import validate_label
from hubd.store.queries import load_queries

__all__ = ["KEY_PREFIX", "ApiKey", "ApiKeyStore", "KeyScope", "parse_key"]

SQL = load_queries("api_keys.sql")

KEY_PREFIX: Final = "hubd_"
_KEY: Final = re.compile(r"hubd_([0-9a-f]{16})\.([A-Za-z0-9_-]{43})")


@attrs.frozen(kw_only=True)
class KeyScope:
    """What a key may see: one tenant's allocations, or (``tenant`` ``None``) every tenant's."""

    key_id: str
    tenant: str | None


@attrs.frozen(kw_only=True)
class ApiKey:
    """A key as listed: never its secret or hash."""

    id: str
    tenant: str | None
    name: str
    created_at: datetime
    revoked_at: datetime | None


def parse_key(text: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed key, else ``None``."""
    found = _KEY.fullmatch(text)
    return None if found is None else (found.group(1), found.group(2))


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class ApiKeyStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def create(self, *, tenant: str | None, name: str = "") -> tuple[ApiKey, str]:
        """A new key for ``tenant`` (``None``: every tenant); the key itself is returned here
        and never again."""
        if len(name) > 200:
            raise InvalidRequest("name: at most 200 characters")
        key_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        row = await self._db.fetchrow(
            "create api key",
            SQL.create_key(
                id=key_id,
                secret_hash=_digest(secret),
                tenant_id=validate_label("tenant", tenant),
                name=name,
            ),
        )
        assert row is not None
        return _listed(row), f"{KEY_PREFIX}{key_id}.{secret}"

    async def check(self, key: str) -> KeyScope | None:
        """What ``key`` may see, or ``None`` when it is malformed, unknown, revoked or wrong."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        key_id, secret = parsed
        row = await self._db.fetchrow("find api key", SQL.find_key(id=key_id))
        if row is None or not hmac.compare_digest(bytes(row["secret_hash"]), _digest(secret)):
            return None
        return KeyScope(key_id=key_id, tenant=row["tenant_id"])

    async def revoke(self, key_id: str) -> ApiKey | None:
        """Refuse key ``key_id`` from now on; ``None`` when no key has that id."""
        row = await self._db.fetchrow("revoke api key", SQL.revoke_key(id=key_id))
        return None if row is None else _listed(row)

    async def list(self) -> list[ApiKey]:
        return [_listed(row) for row in await self._db.fetch("list api keys", SQL.list_keys())]


def _listed(row: Mapping[str, Any]) -> ApiKey:
    return ApiKey(
        id=row["id"],
        tenant=row["tenant_id"],
        name=row["name"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )
