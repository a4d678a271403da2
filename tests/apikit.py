"""Connecting as an application would: a login role that holds only ``hubd_app``."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from hubd.redaction import redact_dsn

_roles = itertools.count()


class SecretDsn(str):
    """A DSN whose password stays out of test reports (pytest prints arguments' reprs)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(redact_dsn(str(self)))


def dsn_as(dsn: str, user: str, password: str | None = None) -> str:
    """``dsn`` with another user (and password, when given)."""
    parts = urlsplit(dsn)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    credentials = user if password is None else f"{user}:{password}"
    netloc = f"{credentials}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@contextlib.asynccontextmanager
async def app_role(database_url: str) -> AsyncIterator[str]:
    """A login role that is a member of ``hubd_app`` and nothing else; yields its DSN for
    ``database_url``'s database. Skips where the test server's role may not create roles."""
    name = f"hubd_app_test_{os.getpid()}_{next(_roles)}"
    password = f"pw{os.urandom(8).hex()}"
    admin = await asyncpg.connect(database_url)
    try:
        try:
            await admin.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE hubd_app")
        except asyncpg.InsufficientPrivilegeError:
            pytest.skip("the test server's role may not create roles")
        try:
            yield SecretDsn(dsn_as(database_url, name, password))
        finally:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name
            )
            await admin.execute(f"DROP OWNED BY {name}")
            await admin.execute(f"DROP ROLE {name}")
    finally:
        await admin.close()
