"""Sidecar identities, one-time bearer tokens and reconnect secrets.

A token is ``hubd_sc_`` and 64 hex digits from :mod:`secrets`; a reconnect secret (protocol v2,
handed out in each welcome) is ``hubd_rs_`` and 64 hex digits. Only their SHA-256 is stored; a
presented value is checked by hashing it and comparing digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Final

__all__ = [
    "RECONNECT_SECRET_PREFIX",
    "TOKEN_PREFIX",
    "hash_token",
    "new_lease_id",
    "new_reconnect_secret",
    "new_sidecar_id",
    "new_token",
    "reconnect_secret_is_well_formed",
    "token_is_well_formed",
    "verify_token",
]

TOKEN_PREFIX: Final = "hubd_sc_"  # noqa: S105 -- a public prefix, not a secret
RECONNECT_SECRET_PREFIX: Final = "hubd_rs_"  # noqa: S105 -- a public prefix, not a secret
_TOKEN: Final = re.compile(r"^hubd_sc_[0-9a-f]{64}$")
_RECONNECT_SECRET: Final = re.compile(r"^hubd_rs_[0-9a-f]{64}$")


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_hex(32)


def new_reconnect_secret() -> str:
    return RECONNECT_SECRET_PREFIX + secrets.token_hex(32)


def new_sidecar_id() -> str:
    return f"sc_{secrets.token_hex(16)}"


def new_lease_id() -> str:
    return f"ls_{secrets.token_hex(16)}"


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def token_is_well_formed(token: str) -> bool:
    return _TOKEN.match(token) is not None


def reconnect_secret_is_well_formed(secret: str) -> bool:
    return _RECONNECT_SECRET.match(secret) is not None


def verify_token(presented: str, stored_hash: bytes | None) -> bool:
    """Whether ``presented`` hashes to ``stored_hash``; compared in constant time.

    Both sides are fixed-width digests, so the comparison's duration says nothing about how
    much of a guess was right.
    """
    if stored_hash is None:
        return False
    return hmac.compare_digest(hash_token(presented), stored_hash)
