-- Statements on hubd_tenant_roles, the tenant walls of the application API's roles, and on the
-- catalog facts `hubd tenant` checks before it moves one.
--
-- "Uses": a role uses another when it has that role's privileges or may SET ROLE to it, which
-- pg_has_role answers for 'USAGE, SET' from PostgreSQL 16. There a membership may give neither
-- (the ADMIN-only membership a CREATEROLE role gets in each role it creates): such a member is
-- no user of the role, and counting it would refuse walls for nothing. PostgreSQL 15 knows no
-- SET privilege and no such membership; there MEMBER is exactly the right to SET ROLE. Each
-- statement picks the word once (p.uses) and never hands 'SET' to a 15.
--
-- A role that reads hubd_allocations directly (a superuser, hubd's own role, one granted SELECT
-- or a member of one) is past every wall: the checks leave it out, and the listing names it
-- apart.

-- name: lock
-- Taken first by every change: the checks read the table, and two changes at once could each
-- pass their checks and together open a wall. It blocks no reader (hubd_caller_scope takes
-- ACCESS SHARE).
LOCK TABLE hubd_tenant_roles IN SHARE ROW EXCLUSIVE MODE;

-- name: role
-- What the checks need to know of :role_name; no row when no role has that name. app_granted:
-- hubd_app was granted to it directly; holds_app: it uses hubd_app, directly or through roles
-- it uses (app_through: the roles granted to it that lead there, hubd_app itself when direct).
SELECT r.rolname AS role_name, r.rolsuper AS superuser, r.rolcanlogin AS can_login,
    r.rolname = current_user AS is_hubd_role, current_user AS hubd_role,
    r.oid IS NOT DISTINCT FROM app.oid AS is_app_role,
    r.oid <> hubd.oid AND pg_has_role(r.oid, hubd.oid, p.uses) AS uses_hubd_role,
    has_table_privilege(r.oid, 'hubd_allocations', 'SELECT') AS reads_tables,
    app.oid IS NOT NULL AS app_exists,
    EXISTS (
        SELECT 1 FROM pg_auth_members AS m WHERE m.roleid = app.oid AND m.member = r.oid
    ) AS app_granted,
    coalesce(pg_has_role(r.oid, app.oid, p.uses), false) AS holds_app,
    array(
        SELECT DISTINCT g.rolname FROM pg_auth_members AS m
        JOIN pg_roles AS g ON g.oid = m.roleid
        WHERE m.member = r.oid AND pg_has_role(r.oid, g.oid, p.uses)
          AND pg_has_role(g.oid, app.oid, p.uses) AND (g.oid = app.oid OR NOT g.rolsuper)
        ORDER BY g.rolname
    ) AS app_through
FROM pg_roles AS r
CROSS JOIN (
    SELECT CASE WHEN current_setting('server_version_num')::integer >= 160000
        THEN 'USAGE, SET' ELSE 'MEMBER' END AS uses
) AS p
JOIN pg_roles AS hubd ON hubd.rolname = current_user
LEFT JOIN pg_roles AS app ON app.rolname = 'hubd_app'
WHERE r.rolname = :role_name::text;

-- name: wall
-- The wall of :role_name as it stands; no row when it has none.
SELECT tenant_id, every_tenant, granted_at FROM hubd_tenant_roles
WHERE role_name = :role_name::text;

-- name: scope_conflicts
-- The mapped roles that would reach past their own wall once :role_name has the scope
-- (:tenant_id, :every_tenant): a role walled into a tenant that uses :role_name, when
-- :role_name would see another tenant or every tenant (member); and, when :role_name would be
-- walled, a role it uses that sees another tenant or every tenant. hubd_caller_scope takes the
-- wall of the role a session SET ROLE to before its login's, so either is a way around a wall.
SELECT w.role_name, w.tenant_id, w.every_tenant, pg_has_role(r.oid, me.oid, p.uses) AS member
FROM hubd_tenant_roles AS w
CROSS JOIN (
    SELECT CASE WHEN current_setting('server_version_num')::integer >= 160000
        THEN 'USAGE, SET' ELSE 'MEMBER' END AS uses
) AS p
JOIN pg_roles AS r ON r.rolname = w.role_name
JOIN pg_roles AS me ON me.rolname = :role_name::text
WHERE r.oid <> me.oid AND NOT r.rolsuper
  AND ((NOT w.every_tenant AND (:every_tenant::boolean OR w.tenant_id <> :tenant_id::text)
        AND pg_has_role(r.oid, me.oid, p.uses))
    OR (NOT :every_tenant::boolean AND (w.every_tenant OR w.tenant_id <> :tenant_id::text)
        AND pg_has_role(me.oid, r.oid, p.uses)))
ORDER BY w.role_name;

-- name: unwalled_members
-- The roles that use :role_name, have no wall of their own and read no table directly: once
-- :role_name holds hubd_app, each could call the API as itself, with no wall, and see every
-- tenant. A wall on :role_name would not hold them.
SELECT r.rolname AS role_name
FROM pg_roles AS r
CROSS JOIN (
    SELECT CASE WHEN current_setting('server_version_num')::integer >= 160000
        THEN 'USAGE, SET' ELSE 'MEMBER' END AS uses
) AS p
JOIN pg_roles AS me ON me.rolname = :role_name::text
WHERE r.oid <> me.oid AND pg_has_role(r.oid, me.oid, p.uses)
  AND NOT has_table_privilege(r.oid, 'hubd_allocations', 'SELECT')
  AND NOT EXISTS (SELECT 1 FROM hubd_tenant_roles AS w WHERE w.role_name = r.rolname)
ORDER BY r.rolname;

-- name: put_wall
-- Walls :role_name into :tenant_id, or lets it see every tenant (:every_tenant, :tenant_id
-- NULL); a different wall already there is replaced, and granted_at says since when the role
-- has the scope it has.
INSERT INTO hubd_tenant_roles AS w (role_name, tenant_id, every_tenant)
VALUES (:role_name::text, :tenant_id::text, :every_tenant::boolean)
ON CONFLICT (role_name) DO UPDATE
SET tenant_id = excluded.tenant_id, every_tenant = excluded.every_tenant, granted_at = now()
WHERE (w.tenant_id, w.every_tenant) IS DISTINCT FROM (excluded.tenant_id, excluded.every_tenant);

-- name: remove_wall
-- Removes the wall of :role_name; returns what it was, no row when there was none.
DELETE FROM hubd_tenant_roles WHERE role_name = :role_name::text
RETURNING tenant_id, every_tenant;

-- name: grant_app
-- The GRANT of hubd_app to :role_name, the name quoted by the server (format's %I): a role name
-- may hold any character, and none is ever spliced into SQL by hand.
SELECT format('GRANT hubd_app TO %I', :role_name::text);

-- name: revoke_app
-- The REVOKE of hubd_app from :role_name, quoted as grant_app quotes it.
SELECT format('REVOKE hubd_app FROM %I', :role_name::text);

-- name: walls
-- Every wall, with what its role is now: a role dropped keeps its row (the wall holds again if
-- a role of that name comes back), one that does not use hubd_app cannot call the API at all,
-- and one that reads the tables directly is past its wall.
SELECT w.role_name, w.tenant_id, w.every_tenant, w.granted_at,
    r.oid IS NOT NULL AS role_exists,
    coalesce(r.rolcanlogin, false) AS can_login,
    coalesce(pg_has_role(r.oid, app.oid, p.uses), false) AS holds_app,
    coalesce(has_table_privilege(r.oid, 'hubd_allocations', 'SELECT'), false) AS reads_tables
FROM hubd_tenant_roles AS w
CROSS JOIN (
    SELECT CASE WHEN current_setting('server_version_num')::integer >= 160000
        THEN 'USAGE, SET' ELSE 'MEMBER' END AS uses
) AS p
LEFT JOIN pg_roles AS r ON r.rolname = w.role_name
LEFT JOIN pg_roles AS app ON app.rolname = 'hubd_app'
ORDER BY w.role_name;

-- name: unwalled_holders
-- The roles that use hubd_app, have no wall and read no table directly: each that can log in
-- sees every tenant through the API. One that cannot log in is reached only by SET ROLE from a
-- login, whose own wall then holds, and each login that uses it is a row of its own.
SELECT r.rolname AS role_name, r.rolcanlogin AS can_login,
    array(
        SELECT DISTINCT g.rolname FROM pg_auth_members AS m
        JOIN pg_roles AS g ON g.oid = m.roleid
        WHERE m.member = r.oid AND pg_has_role(r.oid, g.oid, p.uses)
          AND pg_has_role(g.oid, app.oid, p.uses) AND (g.oid = app.oid OR NOT g.rolsuper)
        ORDER BY g.rolname
    ) AS app_through
FROM pg_roles AS r
CROSS JOIN (
    SELECT CASE WHEN current_setting('server_version_num')::integer >= 160000
        THEN 'USAGE, SET' ELSE 'MEMBER' END AS uses
) AS p
JOIN pg_roles AS app ON app.rolname = 'hubd_app'
WHERE r.oid <> app.oid AND pg_has_role(r.oid, app.oid, p.uses)
  AND NOT has_table_privilege(r.oid, 'hubd_allocations', 'SELECT')
  AND NOT EXISTS (SELECT 1 FROM hubd_tenant_roles AS w WHERE w.role_name = r.rolname)
ORDER BY r.rolname;

-- name: table_readers
-- The login roles that read hubd_allocations directly, walls or not: superusers, hubd's own
-- role, and any role granted SELECT on it (or a member of one).
SELECT r.rolname AS role_name FROM pg_roles AS r
WHERE r.rolcanlogin AND has_table_privilege(r.oid, 'hubd_allocations', 'SELECT')
ORDER BY r.rolname;
