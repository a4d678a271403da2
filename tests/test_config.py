"""hubd.config: loading, validation, environment overrides, redaction and rendering."""

from __future__ import annotations

import os
import pathlib
import tomllib

import attrs
import platformdirs
import pytest

from hubd.config import (
    Config,
    DatabaseConfig,
    ProvisionerConfig,
    ReconcilerConfig,
    ServerConfig,
    load_config,
    redact_url,
    render_toml,
)
from hubd.errors import ConfigError
from hubd.reconciler.settings import ReconcilerSettings
from hubd.units import format_duration, parse_duration, parse_listen

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "config" / "hubd.toml"
PASSWORD = "s3cr3t-canary"


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "hubd.toml"
    path.write_text(text, encoding="utf-8")
    return path


def load(tmp_path: pathlib.Path, text: str, **env: str) -> Config:
    return load_config(write(tmp_path, text), env=env)


class TestDefaults:
    """With no file, every key takes the documented default."""

    def test_no_file_gives_defaults(self) -> None:
        """Loading without a path or HUBD_CONFIG yields Config() with the design's defaults."""
        config = load_config(env={})
        assert config == Config()
        assert config.database.url == ""
        assert config.database.embedded
        assert config.database.pool_size == 10
        assert config.server.listen == "127.0.0.1:8765"
        assert config.admin.listen == "127.0.0.1:9465"
        assert config.reconciler.lease_duration == 60.0
        assert config.reconciler.connect_timeout == 120.0
        assert config.reconciler.operation_timeout == 30.0
        assert config.reconciler.max_concurrent_claims == 64
        assert config.reconciler.poll_interval == 5.0
        assert config.reconciler.repair_interval == 30.0
        assert config.reconciler.shutdown_grace == 20.0
        assert config.reconciler.automatic_replacement_recovery is False
        assert config.instance.heartbeat_interval == 5.0
        assert config.instance.ttl == 20.0
        assert config.events.lock_wait_alarm == 5.0
        assert config.events.lock_hold_limit == 30.0
        assert config.log.format == "json"
        assert config.log.level == "info"
        assert config.server.allowed_origins == ()

    def test_default_provisioner_is_local(self) -> None:
        """Without a provisioners key there is one local provisioner running `hubd sidecar`."""
        (provisioner,) = load_config(env={}).provisioners
        assert provisioner == ProvisionerConfig(
            id="local", plugin="local", options={"command": ["hubd", "sidecar"]}
        )

    def test_empty_file_gives_defaults(self, tmp_path: pathlib.Path) -> None:
        """An empty file is the default configuration."""
        assert load(tmp_path, "") == Config()

    def test_example_file_equals_defaults(self) -> None:
        """The documented config/hubd.toml loads to exactly the defaults."""
        assert load_config(EXAMPLE, env={}) == Config()

    def test_example_file_documents_every_key(self) -> None:
        """Every key of every section appears in config/hubd.toml."""
        with EXAMPLE.open("rb") as file:
            example = tomllib.load(file)
        assert example == Config().to_display_dict()

    def test_state_path_defaults_to_user_data_dir(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An empty state.dir resolves to the platform's user data dir for hubd (for a user
        other than root), and to /var/lib/hubd for root."""
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        expected = pathlib.Path(platformdirs.user_data_dir("hubd", appauthor=False))
        assert Config().state_path == expected
        monkeypatch.setattr(os, "geteuid", lambda: 0)
        assert Config().state_path == pathlib.Path("/var/lib/hubd")

    def test_state_path_expands_user(self, tmp_path: pathlib.Path) -> None:
        """A state.dir with ~ is expanded to an absolute path."""
        config = load(tmp_path, '[state]\ndir = "~/hubd-state"\n')
        assert config.state_path == pathlib.Path.home() / "hubd-state"


class TestDurations:
    """Durations are written with a unit and held as float seconds."""

    @pytest.mark.parametrize(
        ("text", "seconds"),
        [
            ("500ms", 0.5),
            ("2m", 120.0),
            ("1.5s", 1.5),
            ("30s", 30.0),
            ("1h", 3600.0),
            ("1m30s", 90.0),
            ("100ms", 0.1),
            (" 45s ", 45.0),
        ],
    )
    def test_parse(self, text: str, seconds: float) -> None:
        """Each unit scales its number to seconds."""
        assert parse_duration(text) == seconds

    def test_file_values_parse(self, tmp_path: pathlib.Path) -> None:
        """Strings, integers and floats in the file all become seconds."""
        config = load(
            tmp_path,
            '[reconciler]\nlease_duration = "2m"\noperation_timeout = 45\npoll_interval = 0.5\n'
            'shutdown_grace = "1.5s"\nconnect_timeout = "500ms"\n',
        )
        assert config.reconciler.lease_duration == 120.0
        assert config.reconciler.operation_timeout == 45.0
        assert config.reconciler.poll_interval == 0.5
        assert config.reconciler.shutdown_grace == 1.5
        assert config.reconciler.connect_timeout == 0.5

    @pytest.mark.parametrize("text", ["soon", "30", "30 sec", "-5s", "0s", "0ms", "1d", ""])
    def test_bad_duration_names_the_key(self, tmp_path: pathlib.Path, text: str) -> None:
        """A garbage, unitless, zero or negative duration is rejected naming its key."""
        with pytest.raises(ConfigError, match=r"^reconciler\.poll_interval: "):
            load(tmp_path, f'[reconciler]\npoll_interval = "{text}"\n')

    @pytest.mark.parametrize("value", ["0", "-1", "true", "[1]"])
    def test_bad_toml_duration_names_the_key(self, tmp_path: pathlib.Path, value: str) -> None:
        """A zero, negative, boolean or array duration in TOML is rejected naming its key."""
        with pytest.raises(ConfigError, match=r"^instance\.ttl: "):
            load(tmp_path, f"[instance]\nttl = {value}\n")

    @pytest.mark.parametrize("seconds", [0.5, 1.5, 30.0, 120.0, 0.1, 1e-7, 3600.25])
    def test_format_round_trips(self, seconds: float) -> None:
        """format_duration writes text that parses back to the same seconds."""
        assert parse_duration(format_duration(seconds)) == seconds

    def test_format_style(self) -> None:
        """Whole seconds render as "30s" and sub-second values as milliseconds."""
        assert format_duration(30.0) == "30s"
        assert format_duration(0.5) == "500ms"
        assert format_duration(1.5) == "1.5s"


class TestValidation:
    """An invalid configuration is one ConfigError naming the dotted key at fault."""

    def test_unknown_key_named(self, tmp_path: pathlib.Path) -> None:
        """A misspelt key is named in full, with a suggestion."""
        with pytest.raises(ConfigError) as info:
            load(tmp_path, '[reconciler]\nlease_duraton = "60s"\n')
        assert "unknown key 'reconciler.lease_duraton'" in str(info.value)
        assert "reconciler.lease_duration" in str(info.value)

    def test_unknown_section_named(self, tmp_path: pathlib.Path) -> None:
        """An unknown table is named."""
        with pytest.raises(ConfigError, match="unknown section 'databse'"):
            load(tmp_path, '[databse]\nurl = ""\n')

    def test_wrong_type_named(self, tmp_path: pathlib.Path) -> None:
        """A value of the wrong TOML type is rejected naming its key and the expected type."""
        with pytest.raises(ConfigError, match=r"^database\.pool_size: must be an integer"):
            load(tmp_path, '[database]\npool_size = "ten"\n')
        with pytest.raises(ConfigError, match=r"^reconciler\.automatic_replacement_recovery: "):
            load(tmp_path, '[reconciler]\nautomatic_replacement_recovery = "yes"\n')
        with pytest.raises(ConfigError, match=r"^server\.allowed_origins\[1\]: must be a string"):
            load(tmp_path, '[server]\nallowed_origins = ["https://a.example", 3]\n')

    def test_section_must_be_table(self, tmp_path: pathlib.Path) -> None:
        """A section given as a plain value is rejected naming it."""
        with pytest.raises(ConfigError, match=r"^log: must be a table"):
            load(tmp_path, 'log = "json"\n')

    def test_operation_timeout_must_be_shorter_than_lease(self, tmp_path: pathlib.Path) -> None:
        """operation_timeout ≥ lease_duration is rejected naming both keys and both values."""
        with pytest.raises(ConfigError) as info:
            load(tmp_path, '[reconciler]\nlease_duration = "20s"\n')
        assert str(info.value) == (
            "reconciler.operation_timeout: must be shorter than reconciler.lease_duration "
            "(30s ≥ 20s)"
        )
        with pytest.raises(ConfigError, match=r"reconciler\.lease_duration"):
            load(tmp_path, '[reconciler]\nlease_duration = "30s"\noperation_timeout = "30s"\n')

    def test_reconciler_settings_keep_the_same_claim_rules(self) -> None:
        """Settings built in code for the reconciler are held to the [reconciler] section's
        rules, stated once: the same problem, named without the section."""
        with pytest.raises(ValueError, match=r"^operation_timeout: must be shorter than "):
            ReconcilerSettings(lease_duration=20, operation_timeout=30)
        with pytest.raises(ValueError, match=r"^max_concurrent_claims: must be at least 1"):
            ReconcilerSettings(max_concurrent_claims=0)
        with pytest.raises(ValueError, match=r"^instance_ttl: must be positive"):
            ReconcilerSettings(instance_ttl=0)

    def test_max_concurrent_claims_zero_rejected(self, tmp_path: pathlib.Path) -> None:
        """max_concurrent_claims must be at least 1."""
        with pytest.raises(ConfigError, match=r"^reconciler\.max_concurrent_claims: "):
            load(tmp_path, "[reconciler]\nmax_concurrent_claims = 0\n")

    @pytest.mark.parametrize("value", ["-1", "65"])
    def test_max_claims_per_tenant_bounds(self, tmp_path: pathlib.Path, value: str) -> None:
        """0 (half) to max_concurrent_claims; the error names both ends."""
        with pytest.raises(ConfigError, match=r"^reconciler\.max_claims_per_tenant: .*\(64\)"):
            load(tmp_path, f"[reconciler]\nmax_claims_per_tenant = {value}\n")

    def test_max_claims_per_tenant_is_the_tenant_room(self, tmp_path: pathlib.Path) -> None:
        assert ReconcilerSettings(max_concurrent_claims=16).tenant_room == 4
        assert ReconcilerSettings(max_concurrent_claims=1).tenant_room == 1
        assert ReconcilerSettings(max_concurrent_claims=6).tenant_room == 3
        # The default: 64 slots, 4 of them for one tenant while another is in sight.
        assert ReconcilerSettings().tenant_room == 4
        assert ReconcilerSettings(max_concurrent_claims=256).tenant_room == 4
        eight = ReconcilerSettings(max_concurrent_claims=16, max_claims_per_tenant=8)
        assert eight.tenant_room == 8
        config = load(tmp_path, "[reconciler]\nmax_claims_per_tenant = 8\n")
        assert config.reconciler.max_claims_per_tenant == 8

    def test_pool_size_zero_rejected(self, tmp_path: pathlib.Path) -> None:
        """database.pool_size must be at least 1."""
        with pytest.raises(ConfigError, match=r"^database\.pool_size: "):
            load(tmp_path, "[database]\npool_size = 0\n")

    def test_max_connections_bounds(self, tmp_path: pathlib.Path) -> None:
        """server.max_connections defaults to 4096 and takes 1 up to 2^20 (Linux's default
        fs.nr_open), from the file or the environment; outside that the error names the key
        and the bounds."""
        assert load(tmp_path, "").server.max_connections == 4096
        assert load(tmp_path, "[server]\nmax_connections = 1\n").server.max_connections == 1
        config = load(tmp_path, "", HUBD_SERVER_MAX_CONNECTIONS="12000")
        assert config.server.max_connections == 12000
        for bad in ("0", "-5", str((1 << 20) + 1)):
            with pytest.raises(
                ConfigError, match=r"^server\.max_connections: must be between 1 and 1048576"
            ):
                load(tmp_path, f"[server]\nmax_connections = {bad}\n")
        with pytest.raises(ConfigError, match=r"^server\.max_connections: must be an integer"):
            load(tmp_path, '[server]\nmax_connections = "lots"\n')

    def test_heartbeat_must_be_shorter_than_ttl(self, tmp_path: pathlib.Path) -> None:
        """An instance heartbeat no more often than its TTL is rejected."""
        with pytest.raises(ConfigError, match=r"^instance\.heartbeat_interval: .*instance\.ttl"):
            load(tmp_path, '[instance]\nheartbeat_interval = "20s"\n')

    def test_feed_lock_bounds(self, tmp_path: pathlib.Path) -> None:
        """The feed lock's alarm and hold limit are positive, and the limit is not below the
        alarm (a holder would be ended before anyone was told); equal is allowed."""
        with pytest.raises(
            ConfigError, match=r"^events\.lock_hold_limit: must be at least events\.lock_wait_"
        ):
            load(tmp_path, '[events]\nlock_wait_alarm = "10s"\nlock_hold_limit = "5s"\n')
        with pytest.raises(ConfigError, match=r"^events\.lock_hold_limit: .*lock_wait_alarm"):
            load(tmp_path, '[events]\nlock_wait_alarm = "1m"\n')
        for key in ("lock_wait_alarm", "lock_hold_limit"):
            with pytest.raises(ConfigError, match=rf"^events\.{key}: must be positive"):
                load(tmp_path, f'[events]\n{key} = "0s"\n')
        both = load(tmp_path, '[events]\nlock_wait_alarm = "2s"\nlock_hold_limit = "2s"\n')
        assert (both.events.lock_wait_alarm, both.events.lock_hold_limit) == (2.0, 2.0)
        with pytest.raises(ConfigError, match=r"^events\.lock_hold_limit: "):
            attrs.evolve(Config().events, lock_hold_limit=1.0)

    @pytest.mark.parametrize(
        "listen", ["localhost", "127.0.0.1:", "127.0.0.1:65536", ":8765", "::1:8765", "[x]:1"]
    )
    def test_bad_listen_rejected(self, tmp_path: pathlib.Path, listen: str) -> None:
        """A listen address that is not host:port with a port in 0-65535 is rejected."""
        with pytest.raises(ConfigError, match=r"^admin\.listen: "):
            load(tmp_path, f'[admin]\nlisten = "{listen}"\n')

    def test_listen_forms(self) -> None:
        """Host names, IPv4, bracketed IPv6 and port 0 are accepted."""
        assert parse_listen("localhost:0") == ("localhost", 0)
        assert parse_listen("192.0.2.1:8765") == ("192.0.2.1", 8765)
        assert parse_listen("[::1]:65535") == ("::1", 65535)

    def test_database_url_scheme(self, tmp_path: pathlib.Path) -> None:
        """database.url must be empty or a postgres URL, and the error hides its password."""
        with pytest.raises(ConfigError, match=r"^database\.url: ") as info:
            load(tmp_path, f'[database]\nurl = "mysql://hubd:{PASSWORD}@db/hubd"\n')
        assert PASSWORD not in str(info.value)
        for url in ("postgres://db/hubd", "postgresql://hubd@db:5432/hubd"):
            assert load(tmp_path, f'[database]\nurl = "{url}"\n').database.url == url

    @pytest.mark.parametrize(
        ("query", "fragment"),
        [
            ("target_session_attrs=standby", "would pick a standby"),
            ("target_session_attrs=read-only", "would pick a standby"),
            ("target_session_attrs=bogus", "must be read-write, primary, any"),
        ],
    )
    def test_database_url_target_session_attrs(
        self, tmp_path: pathlib.Path, query: str, fragment: str
    ) -> None:
        """A multi-host URL is checked as a connect would use it: a target that picks a
        standby, or none libpq knows, is refused at load, password hidden."""
        url = f"postgresql://hubd:{PASSWORD}@a:5432,b:5433/hubd?{query}"
        with pytest.raises(ConfigError, match=r"^database\.url: ") as info:
            load(tmp_path, f'[database]\nurl = "{url}"\n')
        assert fragment in str(info.value)
        assert PASSWORD not in str(info.value)
        good = "postgresql://hubd@a:5432,b:5433/hubd?target_session_attrs=read-write"
        assert load(tmp_path, f'[database]\nurl = "{good}"\n').database.url == good

    def test_database_url_empty_host_in_list(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(ConfigError, match="an empty host in the host list"):
            load(tmp_path, '[database]\nurl = "postgresql://hubd@a,,b/hubd"\n')

    @pytest.mark.parametrize(
        ("present", "missing"),
        [("tls_cert", "server.tls_key"), ("tls_key", "server.tls_cert")],
    )
    def test_tls_both_or_neither(self, tmp_path: pathlib.Path, present: str, missing: str) -> None:
        """A TLS certificate without its key, or a key without its certificate, is rejected."""
        with pytest.raises(ConfigError, match=rf"^{missing}: must be set together"):
            load(tmp_path, f'[server]\n{present} = "/etc/hubd/x.pem"\n')

    def test_tls_both_gives_wss(self, tmp_path: pathlib.Path) -> None:
        """With both TLS files the derived public URL uses wss://."""
        config = load(tmp_path, '[server]\ntls_cert = "/c.pem"\ntls_key = "/k.pem"\n')
        assert config.server.tls_enabled
        assert config.server.effective_public_url == "wss://127.0.0.1:8765"

    def test_log_enums(self, tmp_path: pathlib.Path) -> None:
        """log.format and log.level accept only their documented values (in any case)."""
        with pytest.raises(ConfigError, match=r"^log\.format: must be one of json, console"):
            load(tmp_path, '[log]\nformat = "xml"\n')
        with pytest.raises(ConfigError, match=r"^log\.level: "):
            load(tmp_path, '[log]\nlevel = "verbose"\n')
        assert load(tmp_path, '[log]\nlevel = "DEBUG"\n').log.level == "debug"

    def test_event_loop_choice(self, tmp_path: pathlib.Path) -> None:
        """runtime.event_loop is uvloop unless the file or HUBD_RUNTIME_EVENT_LOOP says
        asyncio; anything else is named as the mistake it is."""
        assert Config().runtime.event_loop == "uvloop"
        assert load(tmp_path, '[runtime]\nevent_loop = "asyncio"\n').runtime.event_loop == (
            "asyncio"
        )
        assert load(tmp_path, "", HUBD_RUNTIME_EVENT_LOOP="AsyncIO").runtime.event_loop == (
            "asyncio"
        )
        with pytest.raises(
            ConfigError, match=r"^runtime\.event_loop: must be one of uvloop, asyncio; not 'trio'"
        ):
            load(tmp_path, '[runtime]\nevent_loop = "trio"\n')

    def test_direct_construction_is_validated(self) -> None:
        """Sections built in code are held to the same rules as loaded ones."""
        with pytest.raises(ConfigError, match=r"^reconciler\.operation_timeout: "):
            ReconcilerConfig(lease_duration=10)
        with pytest.raises(ConfigError, match=r"^reconciler\.poll_interval: must be positive"):
            ReconcilerConfig(poll_interval=0)
        with pytest.raises(ConfigError, match=r"^database\.url: "):
            DatabaseConfig(url="sqlite:///x")
        with pytest.raises(ConfigError, match=r"server\.tls_key"):
            attrs.evolve(Config().server, tls_cert="/c.pem")


class TestProvisioners:
    """[[provisioners]] entries are checked and their options handed on as is."""

    def test_entries_and_options(self, tmp_path: pathlib.Path) -> None:
        """Each entry keeps its id, plugin and options table unchanged."""
        config = load(
            tmp_path,
            '[[provisioners]]\nid = "k8s-prod"\nplugin = "acme.hubd:Kube"\n'
            '[provisioners.options]\nnamespace = "sidecars"\nreplicas = 2\n'
            '[[provisioners]]\nid = "local"\nplugin = "local"\n',
        )
        assert [p.id for p in config.provisioners] == ["k8s-prod", "local"]
        assert config.provisioners[0].options == {"namespace": "sidecars", "replicas": 2}
        assert config.provisioners[1].options == {}
        assert config.provisioner("local") is config.provisioners[1]
        assert config.provisioner("nope") is None

    def test_duplicate_ids_rejected(self, tmp_path: pathlib.Path) -> None:
        """Two provisioners with one id are rejected naming the second entry."""
        with pytest.raises(ConfigError, match=r"^provisioners\[1\]\.id: duplicate .*'local'"):
            load(
                tmp_path,
                '[[provisioners]]\nid = "local"\nplugin = "local"\n'
                '[[provisioners]]\nid = "local"\nplugin = "other"\n',
            )

    @pytest.mark.parametrize(
        ("entry", "key"),
        [
            ('id = "Local"\nplugin = "local"', r"provisioners\[0\]\.id"),
            ('id = ""\nplugin = "local"', r"provisioners\[0\]\.id"),
            ('plugin = "local"', r"provisioners\[0\]\.id"),
            ('id = "a"\nplugin = ""', r"provisioners\[0\]\.plugin"),
            ('id = "a"', r"provisioners\[0\]\.plugin"),
            ('id = "a"\nplugin = "local"\noptions = 3', r"provisioners\[0\]\.options"),
        ],
    )
    def test_bad_entry_named(self, tmp_path: pathlib.Path, entry: str, key: str) -> None:
        """A bad id, an empty plugin or non-table options are rejected naming the entry's key."""
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            load(tmp_path, f"[[provisioners]]\n{entry}\n")

    def test_unknown_entry_key_named(self, tmp_path: pathlib.Path) -> None:
        """A misspelt key inside an entry is named."""
        with pytest.raises(ConfigError, match=r"unknown key 'provisioners\[0\]\.plugn'"):
            load(tmp_path, '[[provisioners]]\nid = "a"\nplugn = "local"\n')

    def test_provisioners_must_be_array_of_tables(self, tmp_path: pathlib.Path) -> None:
        """A provisioners value that is not an array of tables is rejected."""
        with pytest.raises(ConfigError, match=r"^provisioners: "):
            load(tmp_path, 'provisioners = ["local"]\n')


class TestPools:
    POOL = (
        '[[pools]]\nid = "py"\nprovisioner = "local"\nsize = 4\nspec = { image = "python:3.12" }\n'
    )

    def test_a_pool_is_read_and_shown_back(self, tmp_path: pathlib.Path) -> None:
        config = load(tmp_path, self.POOL)
        (pool,) = config.pools
        assert (pool.id, pool.provisioner, pool.size, pool.refill_rate) == ("py", "local", 4, 20.0)
        assert pool.spec == {"image": "python:3.12"}
        assert config.to_display_dict()["pools"] == [
            {
                "id": "py",
                "provisioner": "local",
                "spec": {"image": "python:3.12"},
                "size": 4,
                "refill_rate": 20.0,
                "miss": "cold",
                "miss_wait": "",
            }
        ]

    @pytest.mark.parametrize(
        ("extra", "message"),
        [
            ('provisioner = "gpu"', r"pools\[0\]\.provisioner: 'gpu' is no provisioner"),
            ("size = -1", r"pools\[0\]\.size: must be a whole number from 0 to 100000"),
            ("size = true", r"pools\[0\]\.size: must be a whole number"),
            ("refill_rate = 0", r"pools\[0\]\.refill_rate: must be a number"),
            ("spec = 3", r"pools\[0\]\.spec: must be a table"),
            ("colour = 1", r"pools\[0\]\.colour: unknown key"),
            ('miss = "later"', r'pools\[0\]\.miss: must be "cold", "wait" or "refuse"'),
            ('miss = "wait"', r"pools\[0\]\.miss_wait: must be a duration with miss"),
            ('miss_wait = "31s"', r'pools\[0\]\.miss_wait: must be "" or a duration up to 30s'),
        ],
        ids=["provisioner", "size", "size-bool", "rate", "spec", "unknown", "miss", "wait", "long"],
    )
    def test_a_bad_entry_is_named(self, tmp_path: pathlib.Path, extra: str, message: str) -> None:
        text = '[[pools]]\nid = "py"\nprovisioner = "local"\nsize = 4\n'
        key = extra.split(" = ", maxsplit=1)[0]
        lines = [line for line in text.splitlines() if not line.startswith(key + " =")]
        with pytest.raises(ConfigError, match=message):
            load(tmp_path, "\n".join([*lines, extra]) + "\n")

    def test_two_pools_may_share_neither_id_nor_match(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(ConfigError, match=r"pools\[1\]\.id: duplicate pool id 'py'"):
            load(tmp_path, self.POOL + self.POOL)
        alike = self.POOL + self.POOL.replace('id = "py"', 'id = "py2"')
        with pytest.raises(ConfigError, match=r"pools\[1\]: same provisioner and spec"):
            load(tmp_path, alike)

    def test_pools_are_not_set_from_the_environment(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(ConfigError, match="HUBD_POOLS_SIZE: pools cannot be set"):
            load(tmp_path, "", HUBD_POOLS_SIZE="3")


class TestEnvironment:
    """HUBD_<SECTION>_<KEY> variables override the file, parsed to the key's type."""

    FILE = (
        '[database]\nurl = "postgresql://file/hubd"\npool_size = 3\n'
        '[reconciler]\nlease_duration = "90s"\nautomatic_replacement_recovery = true\n'
        '[server]\nallowed_origins = ["https://file.example"]\n'
    )

    def test_string_override(self, tmp_path: pathlib.Path) -> None:
        """A string variable replaces the file's value."""
        config = load(tmp_path, self.FILE, HUBD_DATABASE_URL="postgres://env/hubd")
        assert config.database.url == "postgres://env/hubd"

    def test_duration_override(self, tmp_path: pathlib.Path) -> None:
        """A duration variable is parsed like the file's durations."""
        config = load(tmp_path, self.FILE, HUBD_RECONCILER_LEASE_DURATION="2m")
        assert config.reconciler.lease_duration == 120.0

    @pytest.mark.parametrize(
        ("text", "value"),
        [("false", False), ("0", False), ("no", False), ("TRUE", True), ("1", True)],
    )
    def test_bool_override(self, tmp_path: pathlib.Path, text: str, value: bool) -> None:
        """Booleans accept true/false, 1/0 and yes/no."""
        config = load(tmp_path, self.FILE, HUBD_RECONCILER_AUTOMATIC_REPLACEMENT_RECOVERY=text)
        assert config.reconciler.automatic_replacement_recovery is value

    def test_int_override(self, tmp_path: pathlib.Path) -> None:
        """An integer variable is parsed as an integer."""
        config = load(tmp_path, self.FILE, HUBD_DATABASE_POOL_SIZE="25")
        assert config.database.pool_size == 25

    def test_list_override(self, tmp_path: pathlib.Path) -> None:
        """A list variable is comma-separated; blanks around items are dropped."""
        config = load(
            tmp_path, self.FILE, HUBD_SERVER_ALLOWED_ORIGINS="https://a.example, https://b.example"
        )
        assert config.server.allowed_origins == ("https://a.example", "https://b.example")
        assert (
            load(tmp_path, self.FILE, HUBD_SERVER_ALLOWED_ORIGINS="").server.allowed_origins == ()
        )

    def test_choice_override(self, tmp_path: pathlib.Path) -> None:
        """HUBD_LOG_FORMAT and HUBD_LOG_LEVEL select the log output."""
        config = load(tmp_path, "", HUBD_LOG_FORMAT="console", HUBD_LOG_LEVEL="WARNING")
        assert (config.log.format, config.log.level) == ("console", "warning")

    @pytest.mark.parametrize(
        ("variable", "text"),
        [
            ("HUBD_DATABASE_POOL_SIZE", "many"),
            ("HUBD_RECONCILER_AUTOMATIC_REPLACEMENT_RECOVERY", "maybe"),
            ("HUBD_RECONCILER_LEASE_DURATION", "60"),
            ("HUBD_LOG_FORMAT", "xml"),
        ],
    )
    def test_bad_value_names_variable(
        self, tmp_path: pathlib.Path, variable: str, text: str
    ) -> None:
        """An unparsable value is rejected naming both the key and the variable."""
        with pytest.raises(ConfigError, match=rf"\(from {variable}\): "):
            load(tmp_path, "", **{variable: text})

    def test_env_value_still_validated(self, tmp_path: pathlib.Path) -> None:
        """Cross-key rules apply to values that came from the environment."""
        with pytest.raises(ConfigError, match=r"^reconciler\.operation_timeout: "):
            load(tmp_path, "", HUBD_RECONCILER_OPERATION_TIMEOUT="5m")

    def test_unknown_key_rejected(self, tmp_path: pathlib.Path) -> None:
        """An unknown key in a known section is rejected naming the variable."""
        with pytest.raises(
            ConfigError, match=r"^HUBD_RECONCILER_FOO: unknown key 'reconciler\.foo'"
        ):
            load(tmp_path, "", HUBD_RECONCILER_FOO="1")

    def test_provisioners_not_overridable(self, tmp_path: pathlib.Path) -> None:
        """Provisioners are configured only in the file."""
        with pytest.raises(ConfigError, match=r"^HUBD_PROVISIONERS_ID: "):
            load(tmp_path, "", HUBD_PROVISIONERS_ID="x")

    def test_sidecar_variables_ignored(self, tmp_path: pathlib.Path) -> None:
        """HUBD_TOKEN, HUBD_URL and other variables outside the config sections are ignored."""
        config = load(
            tmp_path,
            "",
            HUBD_TOKEN=PASSWORD,
            HUBD_URL="ws://127.0.0.1:8765",
            HUBD_ALLOCATION_ID="a",
            HUBD_SIDECAR_ID="s",
            HUBD_GENERATION="1",
            OTHER_DATABASE_URL="postgres://elsewhere/x",
        )
        assert config == Config()

    @pytest.mark.parametrize("variable", ["HUBD_LOG", "HUBD_DEBUG", "HUBD_RECONCILER", "HUBD_LOG_"])
    def test_names_without_a_key_ignored(self, tmp_path: pathlib.Path, variable: str) -> None:
        """A HUBD_ variable with no key after its first word (HUBD_LOG=1, exported for some
        other tool) is not an override: ignored, whatever its first word names."""
        assert load(tmp_path, "", **{variable: "1"}) == Config()

    def test_typo_of_a_key_still_refused(self, tmp_path: pathlib.Path) -> None:
        """A key of the override's shape in a known section is still checked: a typo is an
        error naming the variable and the likely one."""
        with pytest.raises(ConfigError, match=r"^HUBD_LOG_LEVL: .*'HUBD_LOG_LEVEL'"):
            load(tmp_path, "", HUBD_LOG_LEVL="debug")

    def test_hubd_config_names_the_file(self, tmp_path: pathlib.Path) -> None:
        """Without a path argument, HUBD_CONFIG names the file to read."""
        path = write(tmp_path, "[database]\npool_size = 4\n")
        assert load_config(env={"HUBD_CONFIG": str(path)}).database.pool_size == 4

    def test_explicit_path_wins_over_hubd_config(self, tmp_path: pathlib.Path) -> None:
        """A path argument is used even when HUBD_CONFIG names another file."""
        path = write(tmp_path, "[database]\npool_size = 4\n")
        env = {"HUBD_CONFIG": str(tmp_path / "absent.toml")}
        assert load_config(path, env=env).database.pool_size == 4

    def test_os_environ_is_the_default(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without an env argument the process environment is read."""
        path = write(tmp_path, "")
        monkeypatch.setenv("HUBD_LOG_LEVEL", "error")
        assert load_config(path).log.level == "error"


class TestFiles:
    """Problems with the file itself name the file."""

    def test_missing_file(self, tmp_path: pathlib.Path) -> None:
        """An explicitly named file that does not exist is an error naming it."""
        path = tmp_path / "absent.toml"
        with pytest.raises(ConfigError, match=r"absent\.toml: config file not found"):
            load_config(path, env={})
        with pytest.raises(ConfigError, match=r"absent\.toml"):
            load_config(env={"HUBD_CONFIG": str(path)})

    def test_syntax_error(self, tmp_path: pathlib.Path) -> None:
        """A TOML syntax error names the file and the parser's position."""
        with pytest.raises(ConfigError, match=r"hubd\.toml: invalid TOML: .*line 2"):
            load(tmp_path, "[database]\nurl = \n")


class TestServer:
    """The sidecar listener's address helpers."""

    def test_host_port(self) -> None:
        """host and port come from listen, IPv6 without brackets."""
        server = ServerConfig(listen="[::1]:9000")
        assert (server.host, server.port) == ("::1", 9000)

    def test_public_url_derived(self) -> None:
        """Without public_url, sidecars dial ws://host:port; wildcard binds become loopback."""
        assert ServerConfig().effective_public_url == "ws://127.0.0.1:8765"
        assert ServerConfig(listen="[::1]:9000").effective_public_url == "ws://[::1]:9000"
        assert ServerConfig(listen="0.0.0.0:9000").effective_public_url == "ws://127.0.0.1:9000"
        assert ServerConfig(listen="127.0.0.1:0").public_url_for(41000) == "ws://127.0.0.1:41000"

    def test_public_url_explicit(self, tmp_path: pathlib.Path) -> None:
        """An explicit public_url is used as is, and must be ws:// or wss://."""
        config = load(tmp_path, '[server]\npublic_url = "wss://hubd.example/sidecar"\n')
        assert config.server.effective_public_url == "wss://hubd.example/sidecar"
        with pytest.raises(ConfigError, match=r"^server\.public_url: "):
            load(tmp_path, '[server]\npublic_url = "http://hubd.example"\n')


class TestRedaction:
    """Secrets never appear in displayed configuration."""

    @pytest.mark.parametrize(
        ("url", "expected"),
        [
            (
                f"postgresql://hubd:{PASSWORD}@db.internal:5432/hubd",
                "postgresql://hubd:***@db.internal:5432/hubd",
            ),
            (
                f"postgres://hubd:{PASSWORD}@db/hubd?sslmode=require&password={PASSWORD}",
                "postgres://hubd:***@db/hubd?sslmode=require&password=***",
            ),
            (f"postgresql://db/hubd?password={PASSWORD}", "postgresql://db/hubd?password=***"),
            (f"postgresql://hubd:a@b/{PASSWORD}@db/hubd", "postgresql://hubd:***@db/hubd"),
            ("postgresql://hubd@db/hubd", "postgresql://hubd@db/hubd"),
            (f"host=db password={PASSWORD} dbname=hubd", "host=db password=*** dbname=hubd"),
            ("", ""),
        ],
    )
    def test_redact_url(self, url: str, expected: str) -> None:
        """The password is replaced by *** while user, host and database stay visible."""
        assert redact_url(url) == expected

    def test_display_dict_hides_secrets(self, tmp_path: pathlib.Path) -> None:
        """to_display_dict redacts database.url and secret-sounding provisioner options."""
        config = load(
            tmp_path,
            f'[database]\nurl = "postgresql://hubd:{PASSWORD}@db/hubd"\n'
            '[[provisioners]]\nid = "k8s"\nplugin = "kube"\n'
            f'[provisioners.options]\napi_token = "{PASSWORD}"\nregion = "eu"\n'
            f'[provisioners.options.auth]\nclient_secret = "{PASSWORD}"\nPassword = "{PASSWORD}"\n',
        )
        display = config.to_display_dict()
        assert PASSWORD not in repr(display)
        assert PASSWORD not in render_toml(display)
        assert display["database"]["url"] == "postgresql://hubd:***@db/hubd"
        options = display["provisioners"][0]["options"]
        assert options == {
            "api_token": "***",
            "region": "eu",
            "auth": {"client_secret": "***", "Password": "***"},
        }
        assert config.provisioners[0].options["api_token"] == PASSWORD


class TestRender:
    """render_toml writes TOML that tomllib reads back unchanged."""

    def test_default_round_trip(self) -> None:
        """The default display dict round-trips and loads back to the defaults."""
        display = Config().to_display_dict()
        text = render_toml(display)
        assert tomllib.loads(text) == display

    def test_full_round_trip(self, tmp_path: pathlib.Path) -> None:
        """A config with every kind of value renders to TOML that loads back to an equal Config."""
        source = (
            '[database]\nurl = "postgresql://hubd@db/hubd"\n'
            '[state]\ndir = "/var/lib/hubd"\n'
            '[server]\nlisten = "[::1]:0"\nallowed_origins = ["https://a.example", "x\\"y"]\n'
            '[reconciler]\nlease_duration = "1m30s"\noperation_timeout = "1.5s"\n'
            'poll_interval = "250ms"\nautomatic_replacement_recovery = true\n'
            '[log]\nformat = "console"\nlevel = "debug"\n'
            '[[provisioners]]\nid = "a"\nplugin = "pkg.mod:Attr"\n'
            "[provisioners.options]\n"
            'command = ["hubd", "sidecar"]\nweights = [1, 2.5]\nflag = false\n'
            '"odd key" = "tab\\there\\nnewline\\u0001"\n'
            "when = 2024-05-01T12:00:00Z\n"
            "mixed = [{ a = 1 }, 2]\n"
            '[[provisioners.options.volumes]]\nname = "v1"\n'
            '[[provisioners.options.volumes]]\nname = "v2"\n'
            "[provisioners.options.nested.deeper]\nx = 1\n"
            '[[provisioners]]\nid = "b"\nplugin = "local"\n'
        )
        config = load(tmp_path, source)
        display = config.to_display_dict()
        text = render_toml(display)
        assert tomllib.loads(text) == display
        assert load(tmp_path, text) == config

    def test_empty_document(self) -> None:
        """An empty document renders as an empty TOML file."""
        assert tomllib.loads(render_toml({})) == {}

    def test_unrenderable_value(self) -> None:
        """A value TOML cannot hold is a TypeError, not silently wrong output."""
        with pytest.raises(TypeError):
            render_toml({"x": None})
