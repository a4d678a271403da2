"""The package's shape: layers point one way, no module needs another that needs it back, and
every module stays small enough to hold one concept.

Imports are read from the source (``import`` statements anywhere in a module, those under
``TYPE_CHECKING`` included: a circle of types is a circle a reader must hold in their head).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hubd"
MAX_LINES = 450
# Modules cut by meaning, not length: each may pass MAX_LINES (up to its own bound) for the one
# concept it holds, which split in two would leave halves that borrow each other's state.
LARGE = {
    # The handshake gate, its slots and shares, and the counts it keeps: one policy, read
    # together (the counters were cut off to get under the limit).
    "hubd.server.slots": 560,
    # AllocationStore, one class: every statement on hubd_allocations, so that a claim and all it
    # writes share one set of pipelines (split, its halves borrowed each other's pool and state).
    "hubd.store.allocations": 490,
}

# What each layer must never import. The store is the bottom of the daemon (SQL and the values
# it returns), the reconciler, the listener and the HTTP API stand beside each other on top of
# it, and the daemon wires them; the configuration is read by everyone and reads none of them.
# The command line's modules sit on top of all of it.
COMMAND_LINE = {"commands", "tenant_command", "api_key_command", "cli"}
FORBIDDEN = {
    "store": {"config", "plugins", "reconciler", "server", "http", "daemon", *COMMAND_LINE},
    "config": {"store", "plugins", "reconciler", "server", "http", "daemon", *COMMAND_LINE},
    "reconciler": {"server", "http", "daemon", *COMMAND_LINE},
    "server": {"reconciler", "plugins", "http", "daemon", *COMMAND_LINE},
    "http": {"reconciler", "plugins", "server", "daemon", *COMMAND_LINE},
    "plugins": {"store", "reconciler", "server", "http", "daemon", *COMMAND_LINE},
    "client": {"store", "reconciler", "server", "http", "daemon", "plugins", *COMMAND_LINE},
    "sidecar": {"store", "reconciler", "server", "http", "daemon", "plugins", *COMMAND_LINE},
    "daemon": COMMAND_LINE,
}

# The only layers that may import the PostgreSQL driver: the store (the daemon's one door) and
# the application's client, which talks to the database on its own.
DRIVER = "asyncpg"
DRIVER_LAYERS = {"store", "client"}

# Modules the reconciler's decisions are made of: plain functions over values, which must load
# without the driver (a reader, a test, or a tool can use them with no database at hand).
PURE = ("hubd.reconciler.writes", "hubd.reconciler.decisions")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported(module: str, path: Path) -> Iterator[str]:
    """The package's modules ``module`` imports (a name imported from a package counts as its
    submodule when one of that name exists)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        yield from (name for name in names if name in MODULES and name != module)


GRAPH = {module: set(_imported(module, path)) for module, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _circles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(GRAPH[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_graph_is_read() -> None:
    """The reader finds the imports it is meant to judge (a broken reader passes everything)."""
    assert "hubd.store.database" in GRAPH["hubd.daemon.running"] or any(
        _layer(name) == "store" for name in GRAPH["hubd.daemon.running"]
    )
    assert any(_layer(name) == "reconciler" for name in GRAPH["hubd.daemon.running"])
    assert len(MODULES) > 50


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert _circles() == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_point_one_way(layer: str) -> None:
    wrong = sorted(
        f"{module} -> {name}"
        for module, names in GRAPH.items()
        if _layer(module) == layer
        for name in names
        if _layer(name) in FORBIDDEN[layer]
    )
    assert wrong == []


def test_every_module_is_small() -> None:
    large = {
        module: lines
        for module, path in MODULES.items()
        if (lines := len(path.read_text().splitlines())) > LARGE.get(module, MAX_LINES)
    }
    assert large == {}
    # An exception names a module that still exists and still needs it.
    for module, bound in LARGE.items():
        assert module in MODULES, module
        assert MAX_LINES < len(MODULES[module].read_text().splitlines()) <= bound, module


def test_the_asyncio_primitives_stand_below_everything() -> None:
    """Every layer uses ``hubd.aio``, so it may use none of them."""
    assert GRAPH["hubd.aio"] == set()


def _imports_the_driver(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name == DRIVER or name.startswith(f"{DRIVER}.") for name in names):
            return True
    return False


def test_the_driver_is_imported_only_by_the_store_and_the_client() -> None:
    importers = {module for module, path in MODULES.items() if _imports_the_driver(path)}
    assert any(_layer(module) == "store" for module in importers)  # the scan sees imports
    assert sorted(m for m in importers if _layer(m) not in DRIVER_LAYERS) == []


@pytest.mark.parametrize("module", PURE)
def test_the_pure_modules_load_without_the_driver(module: str) -> None:
    # A fresh interpreter: this one loaded the driver long ago.
    check = f"import sys, {module}; print({DRIVER!r} in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"
