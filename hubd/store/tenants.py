"""Tenant walls: which tenant a database role sees through the application API.

A row of ``hubd_tenant_roles`` (migration 0016) walls a role into one tenant, or lets it see
every tenant; a role that uses ``hubd_app`` and has no row, and whose login has none, sees every
tenant. ``hubd_caller_scope`` applies the wall on each call, so a change holds from the next
statement of every open session.

A wall holds only a role that reaches hubd's tables through ``hubd_v1`` alone. A superuser, hubd's
own role and any role that reads the tables directly are refused a wall, since it would not hold
them. So are the changes that would let a walled role reach past its wall: a role walled into a
tenant that may SET ROLE to one that sees more (``hubd_caller_scope`` takes the wall of the role
a session set before its login's), and, for a wall, members of the role that would inherit
``hubd_app`` with no wall of their own. Every check and its change run in one transaction
behind a lock that every change takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Final

import asyncpg
import attrs
import structlog
from asyncpg import Connection, Record

from hubd.errors import InvalidRequest, StoreError
from hubd.store.database import Database
from hubd.store.inputs import validate_label
from hubd.store.queries import load_queries

__all__ = [
    "APP_ROLE",
    "Granted",
    "Revoked",
    "TenantMap",
    "TenantWalls",
    "UnwalledRole",
    "WallRow",
    "quoted_role",
    "scope_text",
]

log = structlog.get_logger(__name__)

SQL = load_queries("tenants.sql")

APP_ROLE: Final = "hubd_app"
MAX_ROLE_BYTES: Final = 63
"""PostgreSQL's longest role name (NAMEDATALEN - 1); a longer one names no role."""

_PLAIN_IDENTIFIER: Final = re.compile(r"[a-z_][a-z0-9_$]*")


def quoted_role(name: str) -> str:
    """``name`` as SQL takes it, bare when plain and in double quotes otherwise, so a message can
    be pasted into psql; as a JSON string when it holds a character a terminal would act on."""
    if not name.isprintable():
        return json.dumps(name)
    if _PLAIN_IDENTIFIER.fullmatch(name):
        return name
    return '"' + name.replace('"', '""') + '"'


def scope_text(tenant_id: str | None) -> str:
    """A scope as the command line says it."""
    if tenant_id is None:
        return "every tenant"
    # A wall written with SQL was never checked: quote what a terminal would act on.
    return f"tenant {json.dumps(tenant_id, ensure_ascii=not tenant_id.isprintable())}"


@attrs.frozen(kw_only=True)
class Granted:
    role_name: str
    tenant_id: str | None
    """The tenant the role is now walled into; None: it sees every tenant."""
    had_wall: bool
    tenant_before: str | None
    """The tenant of the wall it had (None with ``had_wall``: every tenant)."""
    granted_app: bool
    """hubd_app was granted now (False: it was granted to the role already)."""
    can_login: bool


@attrs.frozen(kw_only=True)
class Revoked:
    role_name: str
    role_exists: bool
    had_wall: bool
    tenant_before: str | None
    past_walls: bool
    """The role reads hubd's tables directly (a superuser, say): no wall ever held it."""
    revoked_app: bool
    """hubd_app was revoked from the role now."""
    uses_app: bool
    """It still uses hubd_app, so with no wall it sees every tenant; else it cannot call the
    API (a role past every wall aside)."""
    app_through: tuple[str, ...]
    """The roles granted to it through which it still uses hubd_app."""


@attrs.frozen(kw_only=True)
class WallRow:
    role_name: str
    tenant_id: str | None
    granted_at: datetime
    role_exists: bool
    can_login: bool
    holds_app: bool
    reads_tables: bool


@attrs.frozen(kw_only=True)
class UnwalledRole:
    role_name: str
    can_login: bool
    """A login sees every tenant; a role without one is reached only by SET ROLE, and then the
    login's own wall holds."""
    app_through: tuple[str, ...]


@attrs.frozen(kw_only=True)
class TenantMap:
    walls: tuple[WallRow, ...]
    unwalled: tuple[UnwalledRole, ...]
    """Roles that use hubd_app with no wall, past the roles that read the tables directly."""
    table_readers: tuple[str, ...]
    """Login roles that read hubd's tables directly, past any wall."""

    @property
    def walled(self) -> bool:
        """Whether any role is walled into one tenant (else hubd is used as single-tenant)."""
        return any(w.tenant_id is not None for w in self.walls)


def _check_name(role_name: str) -> None:
    # PostgreSQL takes no NUL in text, and compares no longer name with a role's.
    if not role_name or "\x00" in role_name or len(role_name.encode()) > MAX_ROLE_BYTES:
        raise InvalidRequest(
            f"unknown role {quoted_role(role_name)}: a role name is 1-{MAX_ROLE_BYTES} bytes"
        )


def _unknown(role_name: str) -> InvalidRequest:
    return InvalidRequest(
        f"unknown role {quoted_role(role_name)}: no role of that name on this server "
        "(pg_roles); create it first (CREATE ROLE … LOGIN PASSWORD …)"
    )


def _past_every_wall(role: Record) -> str | None:
    """Why a wall would not hold ``role``, or None."""
    name, hubd_role = quoted_role(role["role_name"]), quoted_role(role["hubd_role"])
    if role["is_hubd_role"]:
        return (
            f"{name} is the role hubd connects as: it owns hubd's tables and reads them "
            "directly, so a wall on it would be a lie; give applications roles of their own"
        )
    if role["superuser"]:
        return f"{name} is a superuser: it reads hubd's tables directly, so a wall would be a lie"
    if role["is_app_role"]:
        return (
            f"{APP_ROLE} is the role that opens the API to the roles granted it: wall each of "
            "those instead"
        )
    if role["uses_hubd_role"]:
        return (
            f"{name} may act as {hubd_role}, the role hubd connects as, which owns hubd's "
            "tables: a wall would be a lie"
        )
    if role["reads_tables"]:
        return (
            f"{name} may read hubd_allocations directly (a grant of SELECT, or a role that has "
            "one): a wall in the API would not hold it"
        )
    return None


def _escapes(role_name: str, tenant_id: str | None, conflicts: Sequence[Record]) -> str:
    name = quoted_role(role_name)
    reasons = []
    for row in conflicts:
        other = quoted_role(row["role_name"])
        if row["member"]:
            reasons.append(
                f"{other}, walled into {scope_text(row['tenant_id'])}, may SET ROLE {name} "
                f"and would then see {scope_text(tenant_id)}"
            )
        else:
            theirs = None if row["every_tenant"] else row["tenant_id"]
            reasons.append(f"{name} may SET ROLE {other} and would then see {scope_text(theirs)}")
    return (
        f"{name} would open a wall: {'; '.join(reasons)}. Revoke the membership, or give the "
        "roles the same scope"
    )


class TenantWalls:
    """The walls of the application API's roles, and the grant of hubd_app with each."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def grant(self, role_name: str, *, tenant_id: str | None) -> Granted:
        """Wall ``role_name`` into ``tenant_id`` (None: let it see every tenant) and grant it
        hubd_app, in one transaction. A role that does not exist, or that a wall would not
        hold, raises :class:`InvalidRequest` and nothing changes."""
        _check_name(role_name)
        if tenant_id is not None:
            validate_label("tenant", tenant_id)
        what = "tenant grant"
        db = self._db
        async with db.connection(what) as conn, conn.transaction():
            await db.execute(what, SQL.lock(), conn=conn)
            role = await db.fetchrow(what, SQL.role(role_name=role_name), conn=conn)
            if role is None:
                raise _unknown(role_name)
            refusal = _past_every_wall(role)
            if refusal is not None:
                raise InvalidRequest(refusal)
            if not role["app_exists"]:
                raise StoreError(
                    f"role {APP_ROLE} does not exist: `hubd migrate` creates it where hubd's "
                    f"role may create roles; else a superuser runs CREATE ROLE {APP_ROLE} "
                    f"NOLOGIN, then `hubd migrate` grants it the API"
                )
            every = tenant_id is None
            scope = {"role_name": role_name, "tenant_id": tenant_id, "every_tenant": every}
            conflicts = await db.fetch(what, SQL.scope_conflicts(**scope), conn=conn)
            if conflicts:
                raise InvalidRequest(_escapes(role_name, tenant_id, conflicts))
            if not every:
                members = await db.fetch(what, SQL.unwalled_members(role_name=role_name), conn=conn)
                if members:
                    names = ", ".join(quoted_role(m["role_name"]) for m in members)
                    raise InvalidRequest(
                        f"{quoted_role(role_name)} would open a wall: roles that may use it "
                        f"have no wall of their own ({names}), and with {APP_ROLE} each would "
                        "call the API as itself and see every tenant (a wall holds the login and "
                        "the role a session SET ROLE to, not a role's members). Wall them "
                        "first, or revoke their membership"
                    )
            before = await db.fetchrow(what, SQL.wall(role_name=role_name), conn=conn)
            await db.execute(what, SQL.put_wall(**scope), conn=conn)
            granted_app = not role["app_granted"]
            if granted_app:
                await _run_role_statement(
                    conn,
                    await db.fetchval(what, SQL.grant_app(role_name=role_name), conn=conn),
                    role["hubd_role"],
                )
        log.info("tenant_wall_set", role=role_name, tenant=tenant_id, granted_app=granted_app)
        return Granted(
            role_name=role_name,
            tenant_id=tenant_id,
            had_wall=before is not None,
            tenant_before=None if before is None else before["tenant_id"],
            granted_app=granted_app,
            can_login=role["can_login"],
        )

    async def revoke(self, role_name: str, *, keep_app_role: bool) -> Revoked:
        """Remove the wall of ``role_name`` and revoke hubd_app from it, in one transaction.

        Removing a wall widens what the role sees, from its tenant to every tenant, if it can
        still call the API: so hubd_app goes with the wall unless ``keep_app_role``, and a role
        that would still use hubd_app through another role raises :class:`InvalidRequest`
        (nothing changes) unless ``keep_app_role``. hubd_app is never revoked from a role a wall
        would not hold (hubd's own role needs it to grant it). A row whose role was dropped is
        removed all the same."""
        _check_name(role_name)
        what = "tenant revoke"
        db = self._db
        name = quoted_role(role_name)
        async with db.connection(what) as conn, conn.transaction():
            await db.execute(what, SQL.lock(), conn=conn)
            role = await db.fetchrow(what, SQL.role(role_name=role_name), conn=conn)
            removed = await db.fetchrow(what, SQL.remove_wall(role_name=role_name), conn=conn)
            if role is None and removed is None:
                raise _unknown(role_name)
            special = role is not None and _past_every_wall(role) is not None
            if special and removed is None:
                raise InvalidRequest(
                    f"{name} has no wall to remove, and revoke leaves {APP_ROLE} alone for a "
                    f"role no wall would hold: {_past_every_wall(role)}"
                )
            revoked_app = False
            if role is not None and role["app_granted"] and not keep_app_role and not special:
                await _run_role_statement(
                    conn,
                    await db.fetchval(what, SQL.revoke_app(role_name=role_name), conn=conn),
                    role["hubd_role"],
                )
                role = await db.fetchrow(what, SQL.role(role_name=role_name), conn=conn)
                # A grant another role made stays: PostgreSQL only warns.
                revoked_app = role is not None and not role["app_granted"]
            uses_app = role is not None and role["holds_app"] and not special
            through = tuple(role["app_through"]) if role is not None and uses_app else ()
            walled_before = removed is not None and not removed["every_tenant"]
            if walled_before and uses_app and not keep_app_role:
                assert removed is not None
                raise InvalidRequest(_would_widen(role_name, removed["tenant_id"], through))
        log.info(
            "tenant_wall_removed",
            role=role_name,
            tenant=None if removed is None else removed["tenant_id"],
            revoked_app=revoked_app,
            still_uses_app=uses_app,
        )
        return Revoked(
            role_name=role_name,
            role_exists=role is not None,
            past_walls=special,
            had_wall=removed is not None,
            tenant_before=None if removed is None else removed["tenant_id"],
            revoked_app=revoked_app,
            uses_app=uses_app,
            app_through=through,
        )

    async def map(self) -> TenantMap:
        """Every wall, every role that uses hubd_app with none, and the roles past any wall."""
        what = "tenant list"
        db = self._db
        async with db.connection(what) as conn, conn.transaction(readonly=True):
            walls = await db.fetch(what, SQL.walls(), conn=conn)
            unwalled = await db.fetch(what, SQL.unwalled_holders(), conn=conn)
            readers = await db.fetch(what, SQL.table_readers(), conn=conn)
        return TenantMap(
            walls=tuple(
                WallRow(
                    role_name=w["role_name"],
                    tenant_id=None if w["every_tenant"] else w["tenant_id"],
                    granted_at=w["granted_at"],
                    role_exists=w["role_exists"],
                    can_login=w["can_login"],
                    holds_app=w["holds_app"],
                    reads_tables=w["reads_tables"],
                )
                for w in walls
            ),
            unwalled=tuple(
                UnwalledRole(
                    role_name=u["role_name"],
                    can_login=u["can_login"],
                    app_through=tuple(u["app_through"]),
                )
                for u in unwalled
            ),
            table_readers=tuple(r["role_name"] for r in readers),
        )


def _would_widen(role_name: str, tenant_id: str | None, through: Sequence[str]) -> str:
    name = quoted_role(role_name)
    paths = ", ".join(quoted_role(g) for g in through)
    if APP_ROLE in through:
        how = f"{APP_ROLE} was granted to it by another role, whose grant this one may not revoke"
    else:
        how = f"it uses {APP_ROLE} through {paths} as well"
    return (
        f"{name} is walled into {scope_text(tenant_id)} and {how}: with no wall it would see "
        f"every tenant. Nothing was changed. Revoke {paths} from it first, or pass "
        "--keep-app-role to let it see every tenant"
    )


async def _run_role_statement(conn: Connection, statement: str, hubd_role: str) -> None:
    """Run a GRANT or REVOKE of hubd_app the server quoted (grant_app, revoke_app)."""
    try:
        await conn.execute(statement)
    except asyncpg.InsufficientPrivilegeError as exc:
        raise StoreError(
            f"{quoted_role(hubd_role)}, the role hubd connects as, may not grant or revoke "
            f"{APP_ROLE} ({exc}); a superuser lets it: GRANT {APP_ROLE} TO "
            f"{quoted_role(hubd_role)} WITH ADMIN OPTION"
        ) from exc
