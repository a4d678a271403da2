"""Finding, building and checking the provisioner plugins named by ``[[provisioners]]``.

A provisioner's ``plugin`` names a **factory**, looked up in this order:

1. a built-in name: ``"local"`` (:mod:`hubd.plugins.local`) or ``"container"``
   (:mod:`hubd.plugins.container`, with the ``containers`` extra);
2. ``"package.module:attr"`` (anything with a colon): the module is imported and ``attr``, which
   may be dotted (``"pkg.mod:Class.create"``), is looked up in it;
3. otherwise the name of an entry point in the group ``hubd.provisioners`` of an installed
   distribution (``[project.entry-points."hubd.provisioners"]`` in its ``pyproject.toml``).

The factory contract: hubd calls ::

    factory(id=<the provisioner id>, options=<its [provisioners.options] table>, state_dir=<Path>)

with keyword arguments only, synchronously, once per ``[[provisioners]]`` entry at start-up.
``options`` is a private deep copy of the table (the
plugin may keep it); ``state_dir`` is hubd's state directory, under which a plugin may keep files
in a sub-directory named after itself (it may not exist yet). The factory validates its options
and returns an object that satisfies :class:`~hubd.plugins.protocol.Provisioner`: non-empty string
attributes ``id`` (equal to the id it was given), ``api_version`` and ``binding_fingerprint``, and
``async def`` methods ``ensure`` and ``destroy``. Options it cannot accept are reported by raising
:class:`~hubd.errors.PluginLoadError` (or ``ValueError`` / ``TypeError``) with a message that names
the option. A factory must not start background work that outlives a failed start-up.

A factory may also carry ``check_options`` (:class:`~hubd.plugins.protocol.ChecksOptions`):
``factory.check_options(id=..., options=...)`` validates the table as the factory would, builds
nothing, and raises as the factory does. ``hubd check-config`` calls it for every provisioner
(:func:`check_options`), so a bad option fails the pre-flight as it would fail ``hubd run``.

Every problem is one :class:`~hubd.errors.PluginLoadError` whose single-line message starts with
the provisioner id, so an operator knows which ``[[provisioners]]`` entry to fix; the daemon turns
it into exit code 2.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from hubd.config import ProvisionerConfig
from hubd.errors import PluginLoadError
from hubd.plugins.protocol import ChecksOptions, Provisioner
from hubd.redaction import scrub

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "check_options",
    "find_callable",
    "load_provisioners",
    "resolve_factories",
]

ENTRY_POINT_GROUP: Final = "hubd.provisioners"

BUILTIN_PLUGINS: Final[Mapping[str, str]] = {
    "local": "hubd.plugins.local:create",
    # Needs the containers extra (aiodocker); importing it says so when that is missing.
    "container": "hubd.plugins.container:create",
}
"""Built-in plugin names and the factory each stands for. Looked up first, so an installed
distribution cannot take over a built-in name."""

_REFERENCE: Final = re.compile(
    r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)
_MAX_DETAIL: Final = 300

Factory = Callable[..., object]


def load_provisioners(
    configs: Sequence[ProvisionerConfig], *, state_dir: Path
) -> dict[str, Provisioner]:
    """Build every configured provisioner, keyed by id, or raise :class:`PluginLoadError`."""
    loaded: dict[str, Provisioner] = {}
    for config in configs:
        if config.id in loaded:
            raise PluginLoadError(
                f"provisioner {config.id!r}: configured twice; ids must be unique"
            )
        factory = _resolve(config)
        loaded[config.id] = _build(config, factory, state_dir)
    return loaded


def resolve_factories(configs: Sequence[ProvisionerConfig]) -> dict[str, Factory]:
    """Find (import) every configured provisioner's factory without calling it: the pre-flight
    of ``hubd check-config``, which must do no I/O a plugin's factory might. Raises
    :class:`PluginLoadError` naming the provisioner and the plugin."""
    return {config.id: _resolve(config) for config in configs}


def check_options(configs: Sequence[ProvisionerConfig]) -> dict[str, bool]:
    """Find every configured provisioner's factory and run its ``check_options`` hook on a
    private copy of its options: id → whether the plugin has the hook (and so whether its
    options were checked at all). Raises :class:`PluginLoadError` as :func:`load_provisioners`
    would for the same problem."""
    checked: dict[str, bool] = {}
    for config in configs:
        factory = _resolve(config)
        if not isinstance(factory, ChecksOptions):
            checked[config.id] = False
            continue
        where = f"provisioner {config.id!r}"
        try:
            factory.check_options(id=config.id, options=copy.deepcopy(config.options))
        except PluginLoadError as exc:
            raise PluginLoadError(f"{where}: {' '.join(str(exc).split())}") from exc
        except Exception as exc:
            # The plugin's own parser: whatever it raised means the options are refused.
            raise PluginLoadError(
                f"{where}: plugin {config.plugin!r} refused its options: {_detail(exc)}"
            ) from exc
        checked[config.id] = True
    return checked


def _detail(exc: BaseException) -> str:
    """An exception as one bounded line with anything secret-looking hidden: options handed to a
    factory may hold credentials, and a plugin's message may quote them."""
    text = " ".join(str(exc).split()) or "(no message)"
    if len(text) > _MAX_DETAIL:
        text = text[: _MAX_DETAIL - 1] + "…"
    return scrub(f"{type(exc).__name__}: {text}")


def _resolve(config: ProvisionerConfig) -> Factory:
    name = config.plugin.strip()
    where = f"provisioner {config.id!r}"
    if name in BUILTIN_PLUGINS:
        return _from_reference(where, name, BUILTIN_PLUGINS[name])
    if ":" in name:
        return _from_reference(where, name, name)
    return _from_entry_point(where, name)


def _from_reference(where: str, plugin: str, reference: str, role: str = "plugin") -> Factory:
    match = _REFERENCE.fullmatch(reference)
    if match is None:
        raise PluginLoadError(
            f"{where}: {role} {plugin!r} is not a valid reference; expected 'package.module:attr'"
        )
    module_name, attr_path = match["module"], match["attr"]
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        # Module-level code of a plugin can raise anything; all of it means "cannot load".
        raise PluginLoadError(
            f"{where}: cannot import module {module_name!r} for {role} {plugin!r}: {_detail(exc)}"
        ) from exc
    try:
        target: object = functools.reduce(getattr, attr_path.split("."), module)
    except AttributeError:
        raise PluginLoadError(
            f"{where}: module {module_name!r} has no attribute {attr_path!r} ({role} {plugin!r})"
        ) from None
    return _callable(where, plugin, target, role)


def find_callable(where: str, name: str, *, group: str) -> Callable[..., object]:
    """The hook ``name`` names, found as a provisioner's plugin is (without the built-ins):
    ``"package.module:attr"`` imported, otherwise an entry point of that name in ``group``.
    Raises :class:`PluginLoadError` starting with ``where`` (what the operator fixes)."""
    name = name.strip()
    if ":" in name:
        return _from_reference(where, name, name, "hook")
    return _from_entry_point(where, name, group=group)


def _from_entry_point(where: str, name: str, *, group: str = ENTRY_POINT_GROUP) -> Factory:
    found = list(importlib.metadata.entry_points(group=group, name=name))
    if not found:
        if group != ENTRY_POINT_GROUP:
            installed = sorted(
                {entry.name for entry in importlib.metadata.entry_points(group=group)}
            )
            raise PluginLoadError(
                f"{where}: {name!r} is neither 'package.module:attr' nor an entry point in "
                f"group {group!r} (installed: {', '.join(installed) or 'none'})"
            )
        raise PluginLoadError(f"{where}: unknown plugin {name!r}; {_known_plugins(name)}")
    if len({entry.value for entry in found}) > 1:
        owners = ", ".join(sorted(_owner(entry) for entry in found))
        raise PluginLoadError(
            f"{where}: plugin {name!r} is ambiguous: several distributions provide an entry point "
            f"of that name in group {group!r} ({owners}); name one by 'module:attr'"
        )
    entry = found[0]
    try:
        target = entry.load()
    except Exception as exc:
        # Loading imports the distribution's module, whose top-level code can raise anything.
        raise PluginLoadError(
            f"{where}: entry point {name!r} ({entry.value}, from {_owner(entry)}) failed to load: "
            f"{_detail(exc)}"
        ) from exc
    return _callable(where, name, target, "plugin" if group == ENTRY_POINT_GROUP else "hook")


def _owner(entry: importlib.metadata.EntryPoint) -> str:
    dist = entry.dist
    return "an unknown distribution" if dist is None else f"{dist.name} {dist.version}"


def _known_plugins(name: str) -> str:
    entries = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    installed = sorted({entry.name for entry in entries})
    choices = [*BUILTIN_PLUGINS, *installed]
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    names = ", ".join(installed) if installed else "none"
    return (
        f"{hint}built-in: {', '.join(BUILTIN_PLUGINS)}; entry points in group "
        f"{ENTRY_POINT_GROUP!r}: {names}; or give 'package.module:attr'"
    )


def _callable(where: str, plugin: str, target: object, role: str = "plugin") -> Factory:
    if not callable(target):
        raise PluginLoadError(
            f"{where}: {role} {plugin!r} names {target!r:.60} ({type(target).__name__}), "
            f"not a callable{' factory' if role == 'plugin' else ''}"
        )
    return target


def _build(config: ProvisionerConfig, factory: Factory, state_dir: Path) -> Provisioner:
    where = f"provisioner {config.id!r}"
    options: dict[str, Any] = copy.deepcopy(config.options)
    try:
        made = factory(id=config.id, options=options, state_dir=state_dir)
    except PluginLoadError as exc:
        raise PluginLoadError(f"{where}: {' '.join(str(exc).split())}") from exc
    except Exception as exc:
        # A factory rejects bad options by raising; whatever it raised is a start-up error.
        raise PluginLoadError(
            f"{where}: plugin {config.plugin!r} could not be created: {_detail(exc)}"
        ) from exc
    if inspect.isawaitable(made):
        if inspect.iscoroutine(made):
            # Never awaited on purpose: closing it keeps "coroutine was never awaited" quiet.
            made.close()
        raise PluginLoadError(
            f"{where}: plugin {config.plugin!r} factory returned an awaitable; a factory must be "
            f"a plain (not async) callable returning the provisioner"
        )
    problem = _shape_problem(made)
    if problem is not None:
        raise PluginLoadError(
            f"{where}: plugin {config.plugin!r} returned {type(made).__qualname__!r}, which is "
            f"not a provisioner: {problem}"
        )
    assert isinstance(made, Provisioner)
    if made.id != config.id:
        raise PluginLoadError(
            f"{where}: plugin {config.plugin!r} returned a provisioner whose id is {made.id!r}; "
            f"it must use the id it was given"
        )
    return made


def _shape_problem(made: object) -> str | None:
    """Why ``made`` does not satisfy :class:`Provisioner`, or ``None`` if it does."""
    for name in ("id", "api_version", "binding_fingerprint"):
        if not hasattr(made, name):
            return f"attribute {name!r} is missing"
        value = getattr(made, name)
        if not isinstance(value, str) or not value:
            return f"{name!r} must be a non-empty string, not {value!r:.60}"
    for name in ("ensure", "destroy"):
        method = getattr(made, name, None)
        if method is None:
            return f"method {name!r} is missing"
        if not inspect.iscoroutinefunction(method):
            return f"{name!r} must be an 'async def' method"
    # The checks above are stricter than the Protocol's; this keeps the two from drifting apart.
    if not isinstance(made, Provisioner):
        return "it does not satisfy the Provisioner protocol"
    return None
