"""Named SQL statements: translation of ``:name`` parameters, keyword binding, that the ``.sql``
files and the store modules that reference them agree, and running a bound statement."""

from __future__ import annotations

import ast
import asyncio
import re
from importlib import resources
from pathlib import Path

import pytest

import hubd.store
from hubd.errors import InvalidRequest
from hubd.store.database import Database, Pool
from hubd.store.queries import load_queries, parse_queries, translate

STORE = Path(hubd.store.__file__).parent
WRITES = STORE.parent / "reconciler" / "writes.py"


def sql_files() -> list[str]:
    return sorted(
        entry.name
        for entry in resources.files("hubd.store").joinpath("sql").iterdir()
        if entry.name.endswith(".sql")
    )


def strip_comments(sql: str) -> str:
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))


def _loaded(tree: ast.Module) -> dict[str, str]:
    """The names a module assigns ``load_queries(...)`` to, with the file each loads."""
    loaded: dict[str, str] = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "load_queries"
        ):
            (target,) = node.targets
            (argument,) = node.value.args
            assert isinstance(target, ast.Name)
            assert isinstance(argument, ast.Constant)
            loaded[target.id] = argument.value
    return loaded


def _module_name(path: Path) -> str:
    parts = path.relative_to(STORE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def references() -> dict[str, dict[str, set[str]]]:
    """For each ``.sql`` file loaded by a store module: the statement names referenced as
    attributes of the name it is loaded into, per module; the store's modules and the write
    values (``hubd/reconciler/writes.py``, which name the transitions' statements and import
    their file's queries from :mod:`hubd.store.transitions`)."""
    trees = {
        path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(STORE.rglob("*.py"))
    }
    by_module = {_module_name(path): _loaded(tree) for path, tree in trees.items()}
    trees[WRITES] = ast.parse(WRITES.read_text(encoding="utf-8"))
    found: dict[str, dict[str, set[str]]] = {}
    for module, tree in trees.items():
        loaded = _loaded(tree)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module in by_module:
                for alias in node.names:
                    if alias.name in by_module[node.module]:
                        loaded[alias.asname or alias.name] = by_module[node.module][alias.name]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in loaded
            ):
                filename = loaded[node.value.id]
                found.setdefault(filename, {}).setdefault(module.name, set()).add(node.attr)
    return found


class TestStatementsAndStores:
    def test_every_sql_file_is_loaded_by_a_store_module(self) -> None:
        """Each file under ``hubd/store/sql`` is loaded by some module of the store."""
        assert sorted(references()) == sql_files()

    @pytest.mark.parametrize("filename", sql_files())
    def test_every_referenced_statement_exists(self, filename: str) -> None:
        """A statement a store module names is defined in the file it loads: a typo is caught
        here, not at the first call in production."""
        defined = load_queries(filename).names()
        for module, names in references().get(filename, {}).items():
            assert names <= defined, f"{module} references {sorted(names - defined)}"

    @pytest.mark.parametrize("filename", sql_files())
    def test_every_statement_is_used(self, filename: str) -> None:
        """Every block of every file is referenced by some store module: no dead SQL."""
        used = set().union(*references().get(filename, {}).values())
        unused = load_queries(filename).names() - used
        assert not unused, f"{filename}: {sorted(unused)} unused"

    @pytest.mark.parametrize("filename", sql_files())
    def test_no_positional_parameter_is_left(self, filename: str) -> None:
        """After translation, every ``$n`` a statement holds is one of its named parameters."""
        queries = load_queries(filename)
        for name in queries.names():
            statement = queries[name]
            positions = {int(n) for n in re.findall(r"\$(\d+)", strip_comments(statement.sql))}
            assert positions == set(range(1, len(statement.params) + 1)), name

    def test_fenced_statements_take_the_fence(self) -> None:
        """Every claim-owned transition takes the fence parameters and the writing instance."""
        queries = load_queries("transitions.sql")
        fence = {"allocation_id", "lease_id", "generation", "instance_id"}
        for name in ("bind_initial_sidecar", "park", "begin_replacement", "mark_released"):
            assert fence <= set(queries[name].params), name


class TestTranslation:
    def test_names_become_positions_in_order_of_first_use(self) -> None:
        """Parameters are numbered in the order they first appear."""
        sql, params = translate("SELECT :b, :a")
        assert (sql, params) == ("SELECT $1, $2", ("b", "a"))

    def test_a_repeated_name_reuses_its_position(self) -> None:
        """A name used twice is one ``$n``, so it is passed once."""
        sql, params = translate("WHERE id = :id OR parent = :id AND x = :x")
        assert sql == "WHERE id = $1 OR parent = $1 AND x = $2"
        assert params == ("id", "x")

    def test_casts_are_not_parameters(self) -> None:
        """``::type`` is a cast, including right after a parameter and chained."""
        sql, params = translate("SELECT :spec::text::jsonb, a::int, :ids::text[]")
        assert sql == "SELECT $1::text::jsonb, a::int, $2::text[]"
        assert params == ("spec", "ids")

    def test_names_in_comments_are_ignored(self) -> None:
        """A ``:name`` in a line or block comment is text, and the comment is kept."""
        text = "-- uses :ghost\nSELECT /* and :phantom */ :real"
        sql, params = translate(text)
        assert params == ("real",)
        assert sql == "-- uses :ghost\nSELECT /* and :phantom */ $1"

    def test_names_in_literals_and_quoted_identifiers_are_ignored(self) -> None:
        """String literals (with doubled quotes or, in E'' strings, backslash escapes), quoted
        identifiers and dollar quotes keep their text."""
        text = "SELECT 'a:b', 'it''s :x', E'\\':y', \"col:z\", $$ :w $$, $tag$ :v $tag$, :real"
        sql, params = translate(text)
        assert params == ("real",)
        assert sql == text.replace(":real", "$1")

    def test_slices_and_timestamps_are_left_alone(self) -> None:
        """A colon followed by a digit is never a parameter."""
        sql, params = translate("SELECT arr[1:2], '12:30'::time")
        assert (sql, params) == ("SELECT arr[1:2], '12:30'::time", ())

    def test_positional_parameters_are_refused(self) -> None:
        """A file that still says ``$1`` fails to load, naming the statement."""
        with pytest.raises(ValueError, match=r"t\.sql: one: positional \$1"):
            parse_queries("t.sql", "-- name: one\nSELECT $1")

    def test_an_unterminated_literal_is_refused(self) -> None:
        """An unclosed quote would hide every parameter after it: it fails the load."""
        with pytest.raises(ValueError, match="unterminated"):
            translate("SELECT 'oops, :x")


class TestFragments:
    TEXT = (
        "-- fragment: fence\n-- what it says\nid = :id AND lease = :lease\n\n"
        "-- name: one\nUPDATE t SET x = :x WHERE {fence} AND '{fence}' <> ''\n"
    )

    def test_a_fragment_is_put_in_where_named_and_is_no_statement(self) -> None:
        """Its text (without its comments) stands where ``{name}`` was, before translation; a
        ``{name}`` inside a literal is text."""
        queries = parse_queries("t.sql", self.TEXT)
        assert queries.names() == {"one"}
        one = queries["one"]
        assert one.sql == "UPDATE t SET x = $1 WHERE id = $2 AND lease = $3 AND '{fence}' <> ''"
        assert one.params == ("x", "id", "lease")

    def test_an_unknown_fragment_is_refused(self) -> None:
        with pytest.raises(ValueError, match=r"t\.sql: one: no fragment \{ghost\}"):
            parse_queries("t.sql", "-- name: one\nSELECT 1 WHERE {ghost}")

    def test_the_transitions_fence_is_written_once(self) -> None:
        """Each transition that is not in set form is fenced by the one fragment."""
        text = (STORE / "sql" / "transitions.sql").read_text(encoding="utf-8")
        assert text.count("lease_expires_at > clock_timestamp()") == 3  # fence, two set forms
        queries = load_queries("transitions.sql")
        for name in queries.names() - {"park", "mark_released"}:
            assert "lease_expires_at > clock_timestamp()" in queries[name].sql, name


class TestBinding:
    QUERIES = parse_queries(
        "t.sql",
        "-- name: pick\n-- Picks a row.\nSELECT * FROM t WHERE a = :a AND b = :b OR a = :a;\n"
        "-- name: plain\nSELECT 1;\n",
    )

    def test_keywords_bind_in_position_order(self) -> None:
        """Arguments are passed by name and arrive in ``$n`` order, each once."""
        bound = self.QUERIES.pick(b=2, a=1)
        assert bound.args == (1, 2)
        assert bound.sql.endswith("WHERE a = $1 AND b = $2 OR a = $1;")

    def test_a_missing_name_raises(self) -> None:
        """Leaving a parameter out is a programming error naming the statement and the name."""
        with pytest.raises(TypeError, match=r"t\.sql: pick: missing parameter\(s\) b"):
            self.QUERIES.pick(a=1)

    def test_an_unknown_name_raises(self) -> None:
        """A name the statement does not take is refused too, not ignored."""
        with pytest.raises(TypeError, match=r"pick: unknown parameter\(s\) c"):
            self.QUERIES.pick(a=1, b=2, c=3)
        with pytest.raises(TypeError, match=r"plain: unknown parameter\(s\) a"):
            self.QUERIES.plain(a=1)

    def test_a_statement_without_parameters_binds_nothing(self) -> None:
        """A statement with no parameters is called with no arguments."""
        assert self.QUERIES.plain().args == ()

    def test_an_unknown_statement_raises(self) -> None:
        """Looking up a statement the file does not define names the file."""
        with pytest.raises(AttributeError, match=r"t\.sql has no statement named 'pik'"):
            _ = self.QUERIES.pik

    def test_duplicate_and_empty_blocks_are_refused(self) -> None:
        """A name defined twice, or a block of comments only, fails the load."""
        with pytest.raises(ValueError, match="defined twice"):
            parse_queries("t.sql", "-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")
        with pytest.raises(ValueError, match="is empty"):
            parse_queries("t.sql", "-- name: a\n-- nothing here\n")


class TestDatabase:
    """Running a bound statement through :class:`Database`, against a real PostgreSQL."""

    QUERIES = parse_queries(
        "t.sql",
        "-- name: add\nSELECT :x::int + 1;\n-- name: divide\nSELECT 1 / :x::int;\n",
    )

    async def test_a_statement_runs_on_the_pool_it_names(self, db: Database) -> None:
        """With every connection of the main pool taken, a statement on the lease pool still
        answers: renewals never queue behind ordinary work."""
        held = [await db.pool.acquire() for _ in range(db.pool.get_max_size())]
        try:
            async with asyncio.timeout(10):
                assert await db.fetchval("add", self.QUERIES.add(x=1), pool=Pool.LEASE) == 2
        finally:
            for conn in held:
                await db.pool.release(conn)

    async def test_driver_errors_are_translated_naming_the_operation(self, db: Database) -> None:
        """A driver error leaves as hubd's own, naming what was being done."""
        with pytest.raises(InvalidRequest, match="divide things: rejected by the schema"):
            await db.fetchval("divide things", self.QUERIES.divide(x=0))

    async def test_a_caller_connection_keeps_the_statement_in_its_transaction(
        self, db: Database
    ) -> None:
        """Given ``conn``, the statement runs there: inside the caller's transaction it sees
        what that transaction wrote, and nothing of it survives a rollback."""
        temp = parse_queries(
            "t.sql",
            "-- name: put\nINSERT INTO scratch VALUES (:v);\n-- name: count\n"
            "SELECT count(*) FROM scratch;\n",
        )
        async with db.pool.acquire() as conn:
            await conn.execute("CREATE TABLE scratch (v int)")
            tx = conn.transaction()
            await tx.start()
            await db.execute("put", temp.put(v=1), conn=conn)
            assert await db.fetchval("count", temp.count(), conn=conn) == 1
            assert await db.fetchval("count", temp.count()) == 0
            await tx.rollback()
            assert await db.fetchval("count", temp.count()) == 0
