"""``hubd tenant`` as a real child process against the test database: a wall it grants holds a
login role's calls to ``hubd_v1``, ``list`` names every role that can see every tenant, revoke
never widens a role's access unless asked by name, and no role or tenant name is ever SQL."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from hubd.store.migrate import apply_migrations
from tests.apikit import app_role, dsn_as
from tests.clikit import Result, run_hubd_async
from tests.conftest import PostgresServer, drop_database, fresh_database

_names = itertools.count()

_PASSWORD = f"pw{os.urandom(8).hex()}"

INJECTION = 'x"; DROP TABLE hubd_allocations; --'


def unique(stem: str = "hubd_tenant_test") -> str:
    # Roles belong to the whole server, which every test and process shares.
    return f"{stem}_{os.getpid()}_{next(_names)}"


async def hubd(database_url: str, *args: str) -> Result:
    return await run_hubd_async("tenant", *args, env={"HUBD_DATABASE_URL": database_url})


@contextlib.asynccontextmanager
async def admin_of(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def role(
    database_url: str, name: str | None = None, *, options: str = "LOGIN"
) -> AsyncIterator[str]:
    """A role of the server (``options`` as CREATE ROLE takes them; a login gets the password
    ``login`` uses), dropped after the block whatever it was granted."""
    name = name or unique()
    async with admin_of(database_url) as admin:
        statement = await admin.fetchval(
            "SELECT format('CREATE ROLE %I ' || $2 || ' PASSWORD %L', $1::text, $3::text)",
            name,
            options,
            password_of(name),
        )
        try:
            await admin.execute(statement)
        except asyncpg.InsufficientPrivilegeError:
            pytest.skip("the test server's role may not create roles")
        try:
            yield name
        finally:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name
            )
            for template in ("DROP OWNED BY %I", "DROP ROLE %I"):
                await admin.execute(
                    await admin.fetchval("SELECT format($1, $2::text)", template, name)
                )


def password_of(_name: str) -> str:
    return _PASSWORD


async def login(database_url: str, name: str) -> asyncpg.Connection:
    return await asyncpg.connect(database_url, user=name, password=password_of(name))


async def grant_role(database_url: str, granted: str, to: str) -> None:
    async with admin_of(database_url) as admin:
        await admin.execute(
            await admin.fetchval("SELECT format('GRANT %I TO %I', $1::text, $2::text)", granted, to)
        )


async def walls(database_url: str) -> dict[str, tuple[str | None, bool]]:
    async with admin_of(database_url) as admin:
        rows = await admin.fetch("SELECT * FROM hubd_tenant_roles")
    return {r["role_name"]: (r["tenant_id"], r["every_tenant"]) for r in rows}


async def uses_app(database_url: str, name: str) -> bool:
    async with admin_of(database_url) as admin:
        return bool(await admin.fetchval("SELECT pg_has_role($1, 'hubd_app', 'MEMBER')", name))


async def listed(database_url: str) -> dict[str, object]:
    result = await hubd(database_url, "list", "--json")
    assert result.code == 0, result.err
    data: dict[str, object] = json.loads(result.out)
    return data


class TestGrant:
    async def test_a_wall_holds_the_roles_calls(self, database_url: str) -> None:
        """grant walls a plain login role into its tenant and grants it hubd_app: its requests
        get the tenant, one for another tenant is refused with 42501, the view shows its
        tenant's rows alone; granting the same again changes nothing."""
        async with role(database_url) as alice:
            result = await hubd(database_url, "grant", alice, "--tenant", "acme")
            assert result.code == 0, result.err
            assert result.out.strip() == f'{alice} is walled into tenant "acme"; hubd_app granted'
            assert await walls(database_url) == {alice: ("acme", False)}
            assert await uses_app(database_url, alice)

            async with admin_of(database_url) as admin:
                await admin.fetchrow("SELECT * FROM hubd_v1.request('fake', tenant => 'globex')")
            conn = await login(database_url, alice)
            try:
                mine = await conn.fetchrow("SELECT * FROM hubd_v1.request('fake')")
                assert mine["tenant"] == "acme"
                with pytest.raises(asyncpg.InsufficientPrivilegeError) as refused:
                    await conn.fetchrow("SELECT * FROM hubd_v1.request('fake', tenant => 'globex')")
                assert refused.value.sqlstate == "42501"
                seen = await conn.fetch("SELECT tenant FROM hubd_v1.allocations")
                assert [r["tenant"] for r in seen] == ["acme"]
            finally:
                await conn.close()

            again = await hubd(database_url, "grant", alice, "--tenant", "acme")
            assert again.code == 0, again.err
            assert "(unchanged); it had hubd_app already" in again.out

    async def test_a_wall_moves_and_an_operator_sees_every_tenant(self, database_url: str) -> None:
        """A second grant moves the wall and says from where; --every-tenant makes an operator's
        role, which requests for any tenant."""
        async with role(database_url) as alice, role(database_url) as ops:
            assert (await hubd(database_url, "grant", alice, "--tenant", "acme")).code == 0
            moved = await hubd(database_url, "grant", alice, "--tenant", "globex")
            assert moved.code == 0, moved.err
            assert 'walled into tenant "globex" (until now: tenant "acme")' in moved.out

            granted = await hubd(database_url, "grant", ops, "--every-tenant")
            assert granted.code == 0, granted.err
            assert granted.out.strip() == (
                f"{ops} sees every tenant (an operator's role); hubd_app granted"
            )
            assert await walls(database_url) == {alice: ("globex", False), ops: (None, True)}
            conn = await login(database_url, ops)
            try:
                for tenant in ("acme", "globex"):
                    made = await conn.fetchrow(
                        "SELECT * FROM hubd_v1.request('fake', tenant => $1)", tenant
                    )
                    assert made["tenant"] == tenant
            finally:
                await conn.close()


class TestList:
    async def test_walls_and_every_role_that_sees_every_tenant(self, database_url: str) -> None:
        """list names each wall, and each role that uses hubd_app with no wall (directly or
        through a group): flagged as seeing every tenant once any role is walled."""
        async with (
            app_role(database_url) as unwalled_dsn,
            role(database_url) as alice,
            role(database_url, options="NOLOGIN") as group,
            role(database_url) as bob,
        ):
            single = await listed(database_url)
            assert single["any_wall"] is False
            assert single["walls"] == []

            await grant_role(database_url, "hubd_app", group)
            await grant_role(database_url, group, bob)
            assert (await hubd(database_url, "grant", alice, "--tenant", "acme")).code == 0

            data = await listed(database_url)
            assert data["any_wall"] is True
            assert data["walls"] == [
                {
                    "role": alice,
                    "tenant": "acme",
                    "every_tenant": False,
                    "granted_at": data["walls"][0]["granted_at"],  # type: ignore[index]
                    "role_exists": True,
                    "can_login": True,
                    "uses_hubd_app": True,
                    "reads_tables": False,
                }
            ]
            unwalled_rows = {u["role"]: u for u in data["unwalled"]}  # type: ignore[attr-defined]
            app_login = urlsplit(unwalled_dsn).username
            assert unwalled_rows[app_login] == {
                "role": app_login,
                "can_login": True,
                "through": ["hubd_app"],
                "sees_every_tenant": True,
            }
            assert unwalled_rows[bob]["through"] == [group]
            assert unwalled_rows[bob]["sees_every_tenant"] is True
            assert unwalled_rows[group]["sees_every_tenant"] is False
            assert alice not in unwalled_rows
            async with admin_of(database_url) as admin:
                me = await admin.fetchval("SELECT current_user")
            assert me in data["table_readers"]  # type: ignore[operator]
            assert me not in unwalled_rows

            text = await hubd(database_url, "list")
            assert text.code == 0, text.err
            assert f'{alice}  tenant "acme"' in text.out.replace("   ", "  ")
            assert "Use hubd_app with no wall; each login sees EVERY tenant:" in text.out
            assert any(
                line.split()[:3] == [bob, "EVERY", "tenant"] for line in text.out.splitlines()
            )
            assert "Read hubd's tables directly, past any wall: " in text.out


class TestRevoke:
    async def test_revoke_takes_the_api_away(self, database_url: str) -> None:
        """revoke removes the wall and revokes hubd_app: the role can no longer call the API
        at all, rather than see every tenant."""
        async with role(database_url) as alice:
            assert (await hubd(database_url, "grant", alice, "--tenant", "acme")).code == 0
            result = await hubd(database_url, "revoke", alice)
            assert result.code == 0, result.err
            assert result.out.splitlines() == [
                f'{alice}: wall removed (it saw tenant "acme"); hubd_app revoked',
                f"{alice} can no longer call the application API",
            ]
            assert await walls(database_url) == {}
            assert not await uses_app(database_url, alice)
            conn = await login(database_url, alice)
            try:
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.fetchrow("SELECT * FROM hubd_v1.request('fake')")
            finally:
                await conn.close()
            assert alice not in {
                w["role"]
                for w in (await listed(database_url))["walls"]  # type: ignore[attr-defined]
            }

    async def test_revoke_never_widens_unless_asked(self, database_url: str) -> None:
        """A role that would keep hubd_app through a group is refused (exit 2, nothing changed);
        --keep-app-role removes the wall, and says loudly that it now sees every tenant."""
        async with (
            role(database_url, options="NOLOGIN") as group,
            role(database_url) as alice,
        ):
            await grant_role(database_url, "hubd_app", group)
            await grant_role(database_url, group, alice)
            assert (await hubd(database_url, "grant", alice, "--tenant", "acme")).code == 0

            refused = await hubd(database_url, "revoke", alice)
            assert refused.code == 2
            assert f"uses hubd_app through {group}" in refused.err
            assert "would see every tenant" in refused.err
            assert "--keep-app-role" in refused.err
            assert await walls(database_url) == {alice: ("acme", False)}
            async with admin_of(database_url) as admin:
                direct = await admin.fetchval(
                    "SELECT count(*) FROM pg_auth_members WHERE roleid = 'hubd_app'::regrole "
                    "AND member = $1::regrole",
                    alice,
                )
            assert direct == 1

            widened = await hubd(database_url, "revoke", alice, "--keep-app-role")
            assert widened.code == 0, widened.err
            through = ", ".join(sorted([group, "hubd_app"]))
            assert f"{alice} still uses hubd_app (through {through}) and sees EVERY tenant" in (
                widened.out
            )
            assert "widened" in widened.err
            assert await walls(database_url) == {}
            conn = await login(database_url, alice)
            try:
                theirs = await conn.fetchrow(
                    "SELECT * FROM hubd_v1.request('fake', tenant => 'globex')"
                )
                assert theirs["tenant"] == "globex"
            finally:
                await conn.close()

    async def test_revoke_of_a_dropped_role_removes_its_wall(self, database_url: str) -> None:
        """A wall outlives its role (names, not OIDs); revoke still removes it, and a name that
        has neither role nor wall is unknown."""
        async with role(database_url) as alice:
            assert (await hubd(database_url, "grant", alice, "--tenant", "acme")).code == 0
        result = await hubd(database_url, "revoke", alice)
        assert result.code == 0, result.err
        assert "(no role of that name exists)" in result.out
        assert await walls(database_url) == {}
        again = await hubd(database_url, "revoke", alice)
        assert again.code == 2
        assert f"unknown role {alice}" in again.err


class TestRefusals:
    @pytest.mark.parametrize(
        ("args", "problem"),
        [
            (("--tenant", ""), "tenant must be a non-empty string"),
            (("--tenant", "a" * 201), "tenant must be a non-empty string of at most 200"),
            (("--tenant", "acme\x1b[2J"), "tenant must not contain control characters"),
            (("--tenant", "acme\u202egnp.exe"), "tenant must not contain control characters"),
            ((), "one of the arguments --tenant --every-tenant is required"),
            (("--tenant", "a", "--every-tenant"), "not allowed with argument --tenant"),
        ],
    )
    async def test_bad_tenant_exits_2(
        self, database_url: str, args: tuple[str, ...], problem: str
    ) -> None:
        """The tenant follows a request's label rules, and exactly one scope is given."""
        async with role(database_url) as alice:
            result = await hubd(database_url, "grant", alice, *args)
            assert result.code == 2
            assert problem in result.err
            assert await walls(database_url) == {}

    async def test_unknown_role_exits_2_naming_it(self, database_url: str) -> None:
        result = await hubd(database_url, "grant", "no_such_role_here", "--tenant", "acme")
        assert result.code == 2
        assert "unknown role no_such_role_here" in result.err
        assert await walls(database_url) == {}

    async def test_roles_no_wall_would_hold_are_refused(self, database_url: str) -> None:
        """hubd's own role, a superuser, hubd_app itself and a role that may read hubd's tables
        are refused a wall, each with the reason, and nothing changes."""
        async with admin_of(database_url) as admin:
            me = await admin.fetchval("SELECT current_user")
            is_superuser = await admin.fetchval(
                "SELECT rolsuper FROM pg_roles WHERE rolname = $1", me
            )
        async with role(database_url) as reader:
            async with admin_of(database_url) as admin:
                await admin.execute(f"GRANT SELECT ON hubd_allocations TO {reader}")
            cases = [
                (me, "is the role hubd connects as"),
                ("hubd_app", "hubd_app is the role that opens the API"),
                (reader, f"{reader} may read hubd_allocations directly"),
            ]
            for name, problem in cases:
                result = await hubd(database_url, "grant", name, "--tenant", "acme")
                assert result.code == 2, name
                assert problem in result.err
            if is_superuser:
                async with role(database_url, options="LOGIN SUPERUSER") as root:
                    result = await hubd(database_url, "grant", root, "--every-tenant")
                    assert result.code == 2
                    assert f"{root} is a superuser" in result.err
            revoke = await hubd(database_url, "revoke", me)
            assert revoke.code == 2
            assert "has no wall to remove" in revoke.err
            assert await uses_app(database_url, me)
        assert await walls(database_url) == {}

    async def test_membership_that_would_open_a_wall_is_refused(self, database_url: str) -> None:
        """A walled role that may SET ROLE to one that sees more, and a group walled while a
        member has no wall of its own, are refused naming the roles."""
        async with (
            role(database_url) as alice,
            role(database_url, options="NOLOGIN") as ops,
            role(database_url, options="NOLOGIN") as team,
            role(database_url) as carol,
        ):
            assert (await hubd(database_url, "grant", alice, "--tenant", "acme")).code == 0
            await grant_role(database_url, ops, alice)
            opened = await hubd(database_url, "grant", ops, "--every-tenant")
            assert opened.code == 2
            assert f'{alice}, walled into tenant "acme", may SET ROLE {ops}' in opened.err
            other = await hubd(database_url, "grant", ops, "--tenant", "globex")
            assert other.code == 2
            assert 'would then see tenant "globex"' in other.err
            same = await hubd(database_url, "grant", ops, "--tenant", "acme")
            assert same.code == 0, same.err

            await grant_role(database_url, team, carol)
            unwalled = await hubd(database_url, "grant", team, "--tenant", "acme")
            assert unwalled.code == 2
            assert f"no wall of their own ({carol})" in unwalled.err
            assert (await hubd(database_url, "grant", carol, "--tenant", "globex")).code == 0
            upward = await hubd(database_url, "grant", team, "--tenant", "acme")
            assert upward.code == 2
            assert f'{carol}, walled into tenant "globex", may SET ROLE {team}' in upward.err
            assert await walls(database_url) == {
                alice: ("acme", False),
                ops: ("acme", False),
                carol: ("globex", False),
            }


class TestHostileNames:
    async def test_an_injection_shaped_name_is_only_ever_a_name(self, database_url: str) -> None:
        """A role name shaped like SQL is unknown while no such role exists; once one does, it
        is walled, granted, used and revoked by that exact name, and no table is dropped."""
        unknown = await hubd(database_url, "grant", INJECTION, "--tenant", "acme")
        assert unknown.code == 2
        assert 'unknown role "x""; DROP TABLE hubd_allocations; --"' in unknown.err

        name = f"{INJECTION} {os.getpid()}"
        async with role(database_url, name) as hostile:
            granted = await hubd(database_url, "grant", hostile, "--tenant", "acme")
            assert granted.code == 0, granted.err
            assert await walls(database_url) == {hostile: ("acme", False)}
            assert await uses_app(database_url, hostile)
            conn = await login(database_url, hostile)
            try:
                made = await conn.fetchrow("SELECT * FROM hubd_v1.request('fake')")
                assert made["tenant"] == "acme"
            finally:
                await conn.close()
            assert hostile in {
                w["role"]
                for w in (await listed(database_url))["walls"]  # type: ignore[attr-defined]
            }
            revoked = await hubd(database_url, "revoke", hostile)
            assert revoked.code == 0, revoked.err
            assert not await uses_app(database_url, hostile)
        async with admin_of(database_url) as admin:
            assert await admin.fetchval("SELECT to_regclass('hubd_allocations') IS NOT NULL")


class TestPlainOwner:
    async def test_hubd_role_needs_admin_of_hubd_app(self, postgres_server: PostgresServer) -> None:
        """Where hubd's database belongs to a plain role (docs/operations.md) and a superuser
        made hubd_app, grant fails (exit 1) saying how to let hubd grant it, and changes
        nothing; once hubd's role holds hubd_app WITH ADMIN OPTION, grant and revoke work."""
        database = unique("hubd_tplain")
        async with (
            role(postgres_server.maintenance_dsn) as owner,
            role(postgres_server.maintenance_dsn) as alice,
        ):
            dsn = await fresh_database(postgres_server, database)
            try:
                async with admin_of(dsn) as admin:
                    await admin.execute(f"ALTER DATABASE {database} OWNER TO {owner}")
                    await admin.execute(f"ALTER SCHEMA public OWNER TO {owner}")
                    if not await admin.fetchval(
                        "SELECT 1 FROM pg_roles WHERE rolname = 'hubd_app'"
                    ):
                        await admin.execute("CREATE ROLE hubd_app NOLOGIN")
                owner_dsn = dsn_as(dsn, owner, password_of(owner))
                async with admin_of(owner_dsn) as conn:
                    await apply_migrations(conn)

                refused = await hubd(owner_dsn, "grant", alice, "--tenant", "acme")
                assert refused.code == 1
                assert f"{owner}, the role hubd connects as, may not grant or revoke hubd_app" in (
                    refused.err
                )
                assert f"GRANT hubd_app TO {owner} WITH ADMIN OPTION" in refused.err
                assert await walls(dsn) == {}
                assert not await uses_app(dsn, alice)

                async with admin_of(dsn) as admin:
                    await admin.execute(f"GRANT hubd_app TO {owner} WITH ADMIN OPTION")
                granted = await hubd(owner_dsn, "grant", alice, "--tenant", "acme")
                assert granted.code == 0, granted.err
                conn = await login(dsn, alice)
                try:
                    made = await conn.fetchrow("SELECT * FROM hubd_v1.request('fake')")
                    assert made["tenant"] == "acme"
                finally:
                    await conn.close()
                data = await listed(owner_dsn)
                assert owner in data["table_readers"]  # type: ignore[operator]
                assert data["unwalled"] == []
                revoked = await hubd(owner_dsn, "revoke", alice)
                assert revoked.code == 0, revoked.err
                assert not await uses_app(dsn, alice)
            finally:
                await drop_database(postgres_server, database)
