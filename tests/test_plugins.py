"""hubd.plugins.registry: finding plugins by built-in name, module:attr and entry point; every
start-up error is one line that names the provisioner. hubd.plugins.protocol: the checks on
what a plugin returns."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from hubd.config import Config, ProvisionerConfig
from hubd.daemon.hooks import ON_READY_GROUP, load_on_ready
from hubd.errors import PluginError, PluginLoadError
from hubd.plugins.local import LocalProvisioner
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRequest,
    EnsureRequest,
    Provisioner,
    Rejected,
    check_ensure_result,
)
from hubd.plugins.registry import ENTRY_POINT_GROUP, load_provisioners
from hubd.published import encode_metadata
from hubd.store import Database
from tests import hookkit

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "plugins"
HERE = "tests.test_plugins"
LEAKED = "hubd_sc_" + "ab" * 32


# -- factories and shapes referenced as "tests.test_plugins:<name>" ---------------------------


class Minimal:
    """The smallest object that satisfies the contract."""

    api_version = "1"
    binding_fingerprint = "fp"

    def __init__(self, id: str) -> None:
        self.id = id

    async def ensure(self, request: EnsureRequest) -> Accepted:
        return Accepted(None)

    async def destroy(self, request: DestroyRequest) -> Destroyed:
        return Destroyed()


class SyncEnsure(Minimal):
    def ensure(self, request: EnsureRequest) -> Accepted:  # type: ignore[override]
        return Accepted(None)


class NoDestroy:
    api_version = "1"
    binding_fingerprint = "fp"

    def __init__(self, id: str) -> None:
        self.id = id

    async def ensure(self, request: EnsureRequest) -> Accepted:
        return Accepted(None)


class EmptyApiVersion(Minimal):
    api_version = ""


CALLS: list[dict[str, Any]] = []
NOT_CALLABLE = 42


def minimal(*, id: str, options: Mapping[str, Any], state_dir: Path) -> Minimal:
    return Minimal(id)


def recording(*, id: str, options: dict[str, Any], state_dir: Path) -> Minimal:
    CALLS.append({"id": id, "options": options, "state_dir": state_dir})
    options["mutated"] = True
    options["nested"].append("mutated")
    return Minimal(id)


def returns_object(**_: Any) -> object:
    return object()


def returns_sync_ensure(*, id: str, **_: Any) -> SyncEnsure:
    return SyncEnsure(id)


def returns_no_destroy(*, id: str, **_: Any) -> NoDestroy:
    return NoDestroy(id)


def returns_empty_api_version(*, id: str, **_: Any) -> EmptyApiVersion:
    return EmptyApiVersion(id)


def returns_other_id(**_: Any) -> Minimal:
    return Minimal("someone-else")


async def async_factory(*, id: str, **_: Any) -> Minimal:
    return Minimal(id)


def rejects_options(*, options: Mapping[str, Any], **_: Any) -> Minimal:
    raise ValueError(f"option 'size' must be positive,\nnot {options['size']!r}")


def leaks_secret(**_: Any) -> Minimal:
    raise RuntimeError(f"login failed with {LEAKED}")


class Factories:
    @staticmethod
    def create(*, id: str, **_: Any) -> Minimal:
        return Minimal(id)


# -- helpers ----------------------------------------------------------------------------------


def config(plugin: str, provisioner_id: str = "p1", **options: Any) -> ProvisionerConfig:
    return ProvisionerConfig(id=provisioner_id, plugin=plugin, options=options)


def load_error(tmp_path: Path, *configs: ProvisionerConfig) -> str:
    """The PluginLoadError message of loading ``configs``, checked to be a single line."""
    with pytest.raises(PluginLoadError) as caught:
        load_provisioners(configs, state_dir=tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def make_distribution(
    root: Path, name: str, entry_points: Mapping[str, str], group: str = ENTRY_POINT_GROUP
) -> None:
    """An installed distribution as importlib.metadata sees one: a dist-info on sys.path."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples_on_path: None) -> Path:
    """A directory on sys.path to install distributions into."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.fixture
def clean_calls() -> Iterator[list[dict[str, Any]]]:
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def ensure_request(sidecar_id: str) -> EnsureRequest:
    return EnsureRequest(
        allocation_id="al_1",
        generation=1,
        tenant_id=None,
        session_id=None,
        spec={},
        sidecar_id=sidecar_id,
        token="hubd_sc_" + "0" * 64,
        hub_ws_url="ws://127.0.0.1:1/v1/sidecars/connect",
    )


# -- tests ------------------------------------------------------------------------------------


class TestBuiltin:
    """The built-in ``local`` plugin."""

    def test_local_by_name(self, tmp_path: Path) -> None:
        """plugin = "local" builds a LocalProvisioner under the configured id."""
        loaded = load_provisioners(
            [config("local", "dev", command=[sys.executable, "-V"])], state_dir=tmp_path
        )
        provisioner = loaded["dev"]
        assert isinstance(provisioner, LocalProvisioner)
        assert isinstance(provisioner, Provisioner)
        assert provisioner.id == "dev"
        assert provisioner.api_version == "1"
        assert len(provisioner.binding_fingerprint) == 64

    def test_default_config(self, tmp_path: Path) -> None:
        """The default configuration's provisioners load."""
        loaded = load_provisioners(Config().provisioners, state_dir=tmp_path)
        assert list(loaded) == ["local"]

    def test_bad_option(self, tmp_path: Path) -> None:
        """A bad option of the local plugin names the provisioner and the option."""
        message = load_error(tmp_path, config("local", "dev", grace="soon"))
        assert message.startswith("provisioner 'dev': ")
        assert "'grace'" in message
        assert "soon" in message

    def test_builtin_wins_over_entry_point(self, tmp_path: Path, site: Path) -> None:
        """An installed entry point named like a built-in cannot take its place."""
        make_distribution(site, "hijack", {"local": "echo_provisioner:create"})
        loaded = load_provisioners([config("local")], state_dir=tmp_path)
        assert isinstance(loaded["p1"], LocalProvisioner)


class TestModuleReference:
    """``plugin = "package.module:attr"``."""

    async def test_example_plugin(self, tmp_path: Path, examples_on_path: None) -> None:
        """The example plugin loads by module:attr, takes its options and keeps the contract."""
        loaded = load_provisioners(
            [config("echo_provisioner:create", "echo", region="eu-1", capacity=1)],
            state_dir=tmp_path,
        )
        echo = loaded["echo"]
        assert echo.binding_fingerprint == hashlib.sha256(b'{"region":"eu-1"}').hexdigest()
        first = await echo.ensure(ensure_request("sc_1"))
        assert first == Accepted("echo:eu-1:sc_1")
        assert await echo.ensure(ensure_request("sc_1")) == first
        full = await echo.ensure(ensure_request("sc_2"))
        assert isinstance(full, Rejected)
        assert full.code == "at_capacity"
        assert full.retryable
        destroy = DestroyRequest(
            allocation_id="al_1", generation=1, sidecar_id="sc_1", external_ref=None
        )
        assert await echo.destroy(destroy) == Destroyed()
        assert await echo.destroy(destroy) == Destroyed()

    def test_example_plugin_bad_option(self, tmp_path: Path, examples_on_path: None) -> None:
        """The example plugin's option errors reach the operator with the provisioner id."""
        message = load_error(tmp_path, config("echo_provisioner:create", "echo", capacity=0))
        assert message == "provisioner 'echo': echo option 'capacity': must be a positive integer"

    def test_factory_contract(self, tmp_path: Path, clean_calls: list[dict[str, Any]]) -> None:
        """The factory gets id, a private copy of the options and the state dir, as keywords."""
        configured = config(f"{HERE}:recording", size=3, nested=["a"])
        load_provisioners([configured], state_dir=tmp_path)
        assert clean_calls == [
            {
                "id": "p1",
                "options": {"size": 3, "nested": ["a", "mutated"], "mutated": True},
                "state_dir": tmp_path,
            }
        ]
        assert configured.options == {"size": 3, "nested": ["a"]}

    def test_dotted_attribute(self, tmp_path: Path) -> None:
        """The attribute part may be dotted, e.g. a static method of a class."""
        loaded = load_provisioners([config(f"{HERE}:Factories.create")], state_dir=tmp_path)
        assert isinstance(loaded["p1"], Minimal)

    def test_several(self, tmp_path: Path) -> None:
        """Each configured provisioner is built once, keyed by its id, in config order."""
        loaded = load_provisioners(
            [config(f"{HERE}:minimal", "a"), config("local", "b"), config(f"{HERE}:minimal", "c")],
            state_dir=tmp_path,
        )
        assert list(loaded) == ["a", "b", "c"]
        assert [p.id for p in loaded.values()] == ["a", "b", "c"]


class TestEntryPoints:
    """Plugins named by an entry point in group ``hubd.provisioners``."""

    def test_loads(self, tmp_path: Path, site: Path) -> None:
        """An installed distribution's entry point is found by its name."""
        make_distribution(site, "hubd_echo", {"echo": "echo_provisioner:create"})
        loaded = load_provisioners([config("echo", region="us-2")], state_dir=tmp_path)
        assert type(loaded["p1"]).__name__ == "EchoProvisioner"

    def test_fails_to_load(self, tmp_path: Path, site: Path) -> None:
        """An entry point whose module is missing names the entry point, its owner and why."""
        make_distribution(site, "hubd_broken", {"broken": "hubd_no_such_module:create"})
        message = load_error(tmp_path, config("broken"))
        assert message.startswith("provisioner 'p1': entry point 'broken' ")
        assert "hubd_broken 1.0" in message
        assert "ModuleNotFoundError" in message
        assert "hubd_no_such_module" in message

    def test_ambiguous(self, tmp_path: Path, site: Path) -> None:
        """Two distributions offering one name to different factories is an error, not a pick."""
        make_distribution(site, "hubd_one", {"twin": "echo_provisioner:create"})
        make_distribution(site, "hubd_two", {"twin": f"{HERE}:minimal"})
        message = load_error(tmp_path, config("twin"))
        assert "ambiguous" in message
        assert "hubd_one 1.0" in message
        assert "hubd_two 1.0" in message

    def test_unknown_lists_choices(self, tmp_path: Path, site: Path) -> None:
        """An unknown name lists the built-ins and installed entry points, and suggests one."""
        make_distribution(site, "hubd_echo", {"echo": "echo_provisioner:create"})
        message = load_error(tmp_path, config("ecoh"))
        assert message.startswith("provisioner 'p1': unknown plugin 'ecoh'; did you mean 'echo'?")
        assert "built-in: local" in message
        assert "entry points in group 'hubd.provisioners': echo" in message
        assert "'package.module:attr'" in message


class TestErrors:
    """Every way loading can fail is one PluginLoadError naming the provisioner."""

    def test_unknown_plugin(self, tmp_path: Path) -> None:
        """A name that is no built-in, entry point or reference is rejected."""
        message = load_error(tmp_path, config("nope"))
        assert message.startswith("provisioner 'p1': unknown plugin 'nope'; ")

    @pytest.mark.parametrize("plugin", ["mod:", ":attr", "a:b:c", "my-mod:create", "m:1x"])
    def test_malformed_reference(self, tmp_path: Path, plugin: str) -> None:
        """A reference that is not 'package.module:attr' is rejected before importing."""
        message = load_error(tmp_path, config(plugin))
        assert message == (
            f"provisioner 'p1': plugin {plugin!r} is not a valid reference; "
            "expected 'package.module:attr'"
        )

    def test_module_missing(self, tmp_path: Path) -> None:
        """A module that cannot be found is reported with the import error's text."""
        message = load_error(tmp_path, config("hubd_no_such_module:create"))
        assert message == (
            "provisioner 'p1': cannot import module 'hubd_no_such_module' for plugin "
            "'hubd_no_such_module:create': ModuleNotFoundError: No module named "
            "'hubd_no_such_module'"
        )

    def test_module_raises(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A module whose import raises is reported with that exception."""
        name = f"hubd_broken_plugin_{tmp_path.name.replace('-', '_')}"
        (tmp_path / f"{name}.py").write_text("raise RuntimeError('boom\\nat import')\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        message = load_error(tmp_path, config(f"{name}:create"))
        assert message.startswith(f"provisioner 'p1': cannot import module '{name}' ")
        assert message.endswith("RuntimeError: boom at import")

    def test_attribute_missing(self, tmp_path: Path) -> None:
        """A module without the named attribute is reported with both names."""
        message = load_error(tmp_path, config(f"{HERE}:nothing_here"))
        assert message == (
            f"provisioner 'p1': module '{HERE}' has no attribute 'nothing_here' "
            f"(plugin '{HERE}:nothing_here')"
        )

    def test_not_callable(self, tmp_path: Path) -> None:
        """An attribute that is not callable is no factory."""
        message = load_error(tmp_path, config(f"{HERE}:NOT_CALLABLE"))
        assert message == (
            f"provisioner 'p1': plugin '{HERE}:NOT_CALLABLE' names 42 (int), not a callable factory"
        )

    def test_factory_raises(self, tmp_path: Path) -> None:
        """A factory that rejects its options is reported with its message, on one line."""
        message = load_error(tmp_path, config(f"{HERE}:rejects_options", size=-1))
        assert message == (
            f"provisioner 'p1': plugin '{HERE}:rejects_options' could not be created: "
            "ValueError: option 'size' must be positive, not -1"
        )

    def test_factory_wrong_signature(self, tmp_path: Path) -> None:
        """A callable that does not take the factory's keywords is reported, not crashed on."""
        message = load_error(tmp_path, config("os:getcwd"))
        assert message.startswith("provisioner 'p1': plugin 'os:getcwd' could not be created: ")
        assert "TypeError" in message

    def test_factory_error_is_scrubbed(self, tmp_path: Path) -> None:
        """Anything token-shaped in a factory's error is hidden from the start-up error."""
        message = load_error(tmp_path, config(f"{HERE}:leaks_secret"))
        assert LEAKED not in message
        assert "login failed with ***" in message

    @pytest.mark.parametrize(
        ("factory", "problem"),
        [
            ("returns_object", "returned 'object', which is not a provisioner: attribute 'id' is"),
            ("returns_sync_ensure", "'ensure' must be an 'async def' method"),
            ("returns_no_destroy", "method 'destroy' is missing"),
            ("returns_empty_api_version", "'api_version' must be a non-empty string, not ''"),
        ],
    )
    def test_wrong_shape(self, tmp_path: Path, factory: str, problem: str) -> None:
        """A factory whose result does not satisfy the Provisioner protocol is rejected."""
        message = load_error(tmp_path, config(f"{HERE}:{factory}"))
        assert message.startswith(f"provisioner 'p1': plugin '{HERE}:{factory}' returned '")
        assert problem in message

    def test_async_factory(self, tmp_path: Path) -> None:
        """An async factory is rejected, and its coroutine is closed rather than leaked."""
        message = load_error(tmp_path, config(f"{HERE}:async_factory"))
        assert "factory returned an awaitable" in message

    def test_id_mismatch(self, tmp_path: Path) -> None:
        """A provisioner that reports another id than the configured one is rejected."""
        message = load_error(tmp_path, config(f"{HERE}:returns_other_id"))
        assert message == (
            f"provisioner 'p1': plugin '{HERE}:returns_other_id' returned a provisioner whose "
            "id is 'someone-else'; it must use the id it was given"
        )

    def test_duplicate_id(self, tmp_path: Path) -> None:
        """Two provisioners with one id are rejected even if the config layer let them by."""
        message = load_error(tmp_path, config(f"{HERE}:minimal"), config("local"))
        assert message == "provisioner 'p1': configured twice; ids must be unique"


class TestEnsureResults:
    """What an ensure returns is checked before the reconciler acts on it."""

    def test_accepted_is_copied(self) -> None:
        """An acceptance's metadata is a plain copy: the plugin keeps no handle on it."""
        mine: dict[str, Any] = {"pod": "p", "ports": (80, 443)}
        checked = check_ensure_result(Accepted("ref", endpoint="10.0.0.7:80", metadata=mine))
        mine["pod"] = "changed"
        assert checked == Accepted(
            "ref", endpoint="10.0.0.7:80", metadata={"pod": "p", "ports": [80, 443]}
        )

    @pytest.mark.parametrize(
        ("accepted", "problem"),
        [
            (Accepted(endpoint=""), "endpoint is empty"),
            (Accepted(endpoint=7), "endpoint is int, not a string"),  # type: ignore[arg-type]
            (Accepted(endpoint="x" * 1025), "endpoint is longer than 1024 characters"),
            (Accepted(endpoint="a\x1b[2Jb"), "endpoint contains control characters"),
            (Accepted(metadata=[1]), "metadata is list, not a JSON object"),  # type: ignore[arg-type]
            (Accepted(metadata={1: 2}), "metadata has a key that is not a string"),
            (Accepted(metadata={"a": {"b": float("inf")}}), "metadata.a.b is inf"),
            (Accepted(metadata={"a": [object()]}), "metadata.a[0] is object"),
            (Accepted(metadata={"a": "\x00"}), "metadata.a contains a NUL character"),
            (Accepted(metadata={"a": "\udc80"}), "metadata.a is not valid Unicode"),
            (Accepted(metadata={"a": "x" * 16384}), "metadata is larger than 16384 bytes"),
            (Accepted(metadata={"a": 10**5000}), "metadata.a is an integer of more than"),
        ],
    )
    def test_bad_acceptance(self, accepted: Accepted, problem: str) -> None:
        """A malformed endpoint or metadata is a plugin error naming the problem."""
        with pytest.raises(PluginError, match=r"^ensure returned an Accepted whose ") as caught:
            check_ensure_result(accepted)
        assert problem in str(caught.value)

    def test_deep_metadata(self) -> None:
        """Metadata nested past the bound is refused without recursing over it."""
        deep: dict[str, Any] = {}
        for _ in range(100_000):
            deep = {"a": deep}
        with pytest.raises(PluginError, match="nests deeper than 16 levels"):
            check_ensure_result(Accepted(metadata=deep))

    @pytest.mark.parametrize(
        "metadata",
        [
            {"a": "x" * (16384 - 9)},
            {"n": 1e300, "pad": "é" * 7000},
            {"s": '\n\t"\\' * 2000, "list": [1, 2.5, None, True]},
        ],
        ids=["at-the-bound", "plain-numbers", "escapes"],
    )
    async def test_what_passes_fits_the_column(
        self, db: Database, metadata: dict[str, Any]
    ) -> None:
        """Metadata the check lets through is accepted by the column's domain: the size is
        measured as PostgreSQL prints jsonb."""
        checked = check_ensure_result(Accepted(metadata=metadata))
        assert isinstance(checked, Accepted)
        async with db.connection("test") as conn:
            size = await conn.fetchval(
                "SELECT octet_length($1::text::jsonb::text)", encode_metadata(checked.metadata)
            )
            assert await conn.fetchval(
                "SELECT $1::text::jsonb::hubd_metadata IS NOT NULL",
                encode_metadata(checked.metadata),
            )
        assert size <= 16384

    async def test_what_is_refused_would_not_fit(self, db: Database) -> None:
        """One byte past the bound is refused by the check and by the column alike."""
        metadata = {"a": "x" * (16384 - 8)}
        with pytest.raises(PluginError, match="larger than 16384 bytes"):
            check_ensure_result(Accepted(metadata=metadata))
        async with db.connection("test") as conn:
            assert (
                await conn.fetchval(
                    "SELECT octet_length($1::text::jsonb::text)", encode_metadata(metadata)
                )
                == 16385
            )


class TestOnReadyHooks:
    """The on-ready hook named by ``[reconciler] on_ready``, found as plugins are."""

    def test_by_reference(self) -> None:
        """A module:attr reference names the async function itself; empty names none."""
        assert load_on_ready("tests.hookkit:hold") is hookkit.hold
        assert load_on_ready("") is None

    def test_by_entry_point(self, site: Path) -> None:
        """An entry point in group hubd.on_ready is found by its name."""
        make_distribution(site, "hubd_hooks", {"warm": "tests.hookkit:hold"}, ON_READY_GROUP)
        assert load_on_ready("warm") is hookkit.hold

    def test_entry_point_of_the_wrong_shape(self, site: Path) -> None:
        """An entry point naming a plain function is refused naming the key."""
        make_distribution(site, "hubd_hooks", {"cold": "tests.hookkit:not_async"}, ON_READY_GROUP)
        with pytest.raises(PluginLoadError, match=r"^reconciler\.on_ready 'cold': .* not an async"):
            load_on_ready("cold")

    def test_a_provisioner_entry_point_is_no_hook(self, site: Path) -> None:
        """Only group hubd.on_ready names hooks: a provisioner's entry point of that name is
        not taken for one."""
        make_distribution(site, "hubd_echo", {"echo": "echo_provisioner:create"})
        with pytest.raises(PluginLoadError, match=r"nor an entry point in group 'hubd\.on_ready'"):
            load_on_ready("echo")
