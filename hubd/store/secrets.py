"""Reconnect secrets: what binds a generation's identity to its latest connection (protocol v2).

The token a provisioner hands a sidecar sits in its environment, where any process of the same
uid can read it. So the token alone only opens a generation's *first* connection: each welcome
carries a fresh secret, and once a generation has one, a handshake must present it. Each accepted
connection rotates it. The secret that authenticated the latest connection (or the token alone,
on a first connection) stays valid until the sidecar acknowledges its welcome: a sidecar whose
welcome was lost on the way still holds it.

Only SHA-256 digests are stored (:func:`hubd.tokens.hash_token`). These values carry digests and
keep them out of ``repr``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import attrs

from hubd.routing import Target
from hubd.store.database import Database, Pool
from hubd.store.queries import load_queries

__all__ = ["Acknowledgement", "Rotation", "SecretState", "acknowledge"]

SQL = load_queries("secrets.sql")


def _digest(value: Any) -> bytes | None:
    return bytes(value) if value is not None else None


@attrs.frozen(kw_only=True)
class SecretState:
    """A generation's reconnect secret as a handshake sees it."""

    secret_hash: bytes | None = attrs.field(default=None, repr=False)
    """The secret of the latest welcome; ``None``: the generation has none yet."""
    previous_hash: bytes | None = attrs.field(default=None, repr=False)
    """The secret that authenticated the latest connection (``None``: the token alone did)."""
    acknowledged: bool = True
    """Whether the latest welcome was acknowledged; until it is, ``previous_hash`` (or the
    token alone) is still accepted."""

    @property
    def is_set(self) -> bool:
        return self.secret_hash is not None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SecretState:
        """From the ``identity`` statement's columns (all NULL: no secret)."""
        return cls(
            secret_hash=_digest(row["secret_hash"]),
            previous_hash=_digest(row["previous_hash"]),
            acknowledged=row["acknowledged"] is not False,
        )


@attrs.frozen(kw_only=True)
class Rotation:
    """What an accepted handshake writes with its connection record: the secret state it saw
    (the guard), the digest of the secret its welcome carries (``None``: a v1 sidecar, told
    none) and the digest of what it presented (``None``: the token alone)."""

    seen_hash: bytes | None = attrs.field(repr=False)
    secret_hash: bytes | None = attrs.field(repr=False)
    presented_hash: bytes | None = attrs.field(repr=False)


@attrs.frozen
class Acknowledgement:
    """A sidecar's word that it holds the secret of its welcome (``secret_hash``'s)."""

    target: Target
    sidecar_id: str
    secret_hash: bytes = attrs.field(repr=False)


async def acknowledge(
    db: Database, acknowledgements: Collection[Acknowledgement]
) -> set[Acknowledgement]:
    """Each sidecar confirmed it holds its secret: what authenticated its connection stops
    being accepted. Returns those that took effect (not: a newer rotation made them moot)."""
    rows = await db.fetch(
        "acknowledge reconnect secrets",
        SQL.acknowledge_secrets(
            allocation_ids=[each.target.allocation_id for each in acknowledgements],
            generations=[each.target.generation for each in acknowledgements],
            sidecar_ids=[each.sidecar_id for each in acknowledgements],
            secret_hashes=[each.secret_hash for each in acknowledgements],
        ),
        pool=Pool.SOCKETS,
    )
    return {
        Acknowledgement(
            Target(row["allocation_id"], row["generation"]),
            row["sidecar_id"],
            bytes(row["secret_hash"]),
        )
        for row in rows
    }
