"""The handshake decisions as pure functions: no loop, no socket, no database."""

from __future__ import annotations

import pytest
from websockets.datastructures import Headers

from hubd.server.handshake import (
    CONNECT_PATH,
    SUBPROTOCOL,
    CloseCode,
    HandshakeRequest,
    Rejection,
    authorize,
    check_origin,
    close_reason,
    parse_request,
    secret_accepted,
    unavailable,
)
from hubd.server.limits import TokenBucket
from hubd.server.wire import is_loopback_host
from hubd.store.channels import (
    MAC_LENGTH,
    ConnectedNotice,
    NoticeKey,
    SocketControl,
    parse_connected_payload,
    parse_sockets_payload,
)
from hubd.store.connection_values import SidecarIdentity
from hubd.store.rows import Status
from hubd.store.secrets import SecretState
from hubd.tokens import hash_token, new_reconnect_secret, new_token

TOKEN = new_token()
ALLOCATION = "al_" + "a" * 32
TAG = "0123456789abcdef" * 2
KEY = NoticeKey(bytes(range(32)))
SIDECAR = "sc_" + "b" * 32


def headers(**overrides: str | None) -> Headers:
    values: dict[str, str | None] = {
        "Authorization": f"Bearer {TOKEN}",
        "Hubd-Allocation-Id": ALLOCATION,
        "Hubd-Sidecar-Id": SIDECAR,
        "Hubd-Generation": "3",
        "Sec-WebSocket-Protocol": SUBPROTOCOL,
    }
    values.update({name.replace("_", "-"): value for name, value in overrides.items()})
    return Headers([(name, value) for name, value in values.items() if value is not None])


def request(**changes: object) -> HandshakeRequest:
    values: dict[str, object] = {
        "allocation_id": ALLOCATION,
        "sidecar_id": SIDECAR,
        "generation": 3,
        "token": TOKEN,
        "origin": None,
    }
    values.update(changes)
    return HandshakeRequest(**values)  # type: ignore[arg-type]


def identity(**changes: object) -> SidecarIdentity:
    values: dict[str, object] = {
        "allocation_id": ALLOCATION,
        "status": Status.ALLOCATED,
        "generation": 3,
        "sidecar_id": SIDECAR,
        "token_hash": hash_token(TOKEN),
    }
    values.update(changes)
    return SidecarIdentity(**values)  # type: ignore[arg-type]


class TestParseRequest:
    def test_well_formed(self) -> None:
        """Four well-formed headers and the subprotocol make a typed request."""
        parsed = parse_request(CONNECT_PATH, headers())
        assert parsed == request()

    def test_query_string_ignored(self) -> None:
        """A query string does not change which endpoint is asked for."""
        assert isinstance(parse_request(CONNECT_PATH + "?x=1", headers()), HandshakeRequest)

    def test_bearer_scheme_case_insensitive(self) -> None:
        """The bearer scheme is matched without regard to case, as HTTP auth schemes are."""
        parsed = parse_request(CONNECT_PATH, headers(Authorization=f"bearer {TOKEN}"))
        assert isinstance(parsed, HandshakeRequest)

    @pytest.mark.parametrize("path", ["/", "/v1/sidecars", "/v1/sidecars/connect/x", "/v2/x"])
    def test_other_paths_404(self, path: str) -> None:
        """Any path but the connect endpoint is 404."""
        assert parse_request(path, headers()) == Rejection(status=404, reason="not found")

    @pytest.mark.parametrize(
        "name", ["Authorization", "Hubd-Allocation-Id", "Hubd-Sidecar-Id", "Hubd-Generation"]
    )
    def test_missing_header_400(self, name: str) -> None:
        """Each missing handshake header is a 400 that names it."""
        parsed = parse_request(CONNECT_PATH, headers(**{name: None}))
        assert parsed == Rejection(status=400, reason=f"missing {name} header")

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("Authorization", f"Basic {TOKEN}"),
            ("Authorization", TOKEN),
            ("Authorization", "Bearer hubd_sc_short"),
            ("Authorization", "Bearer " + TOKEN.upper()),
            ("Authorization", f"Bearer {TOKEN} extra"),
            ("Hubd-Allocation-Id", "al_123"),
            ("Hubd-Allocation-Id", "x" * 35),
            ("Hubd-Sidecar-Id", "sc with spaces"),
            ("Hubd-Sidecar-Id", "s" * 200),
            ("Hubd-Generation", "0"),
            ("Hubd-Generation", "-1"),
            ("Hubd-Generation", "01"),
            ("Hubd-Generation", "abc"),
            ("Hubd-Generation", "2147483648"),
        ],
        # Named by shape, not value: a token (random per run) would make the ids differ between
        # collections, and test ids are printed.
        ids=[
            "basic-scheme",
            "no-scheme",
            "short-token",
            "upper-case-token",
            "trailing-word",
            "allocation-id-short",
            "allocation-id-long",
            "sidecar-id-spaces",
            "sidecar-id-long",
            "generation-zero",
            "generation-negative",
            "generation-leading-zero",
            "generation-not-a-number",
            "generation-too-large",
        ],
    )
    def test_malformed_header_400(self, name: str, value: str) -> None:
        """A malformed header is a 400 naming the header, never repeating its value."""
        parsed = parse_request(CONNECT_PATH, headers(**{name: value}))
        assert isinstance(parsed, Rejection)
        assert parsed.status == 400
        assert name in parsed.reason
        assert value not in parsed.reason
        assert TOKEN not in parsed.reason

    def test_repeated_header_400(self) -> None:
        """A handshake header given twice is ambiguous and refused."""
        raw = headers()
        raw["Hubd-Generation"] = "4"
        parsed = parse_request(CONNECT_PATH, raw)
        assert isinstance(parsed, Rejection)
        assert parsed.status == 400

    def test_missing_subprotocol_400(self) -> None:
        """A client that does not speak hubd.sidecar.v1 is refused before any look-up."""
        parsed = parse_request(CONNECT_PATH, headers(**{"Sec-WebSocket-Protocol": "chat"}))
        assert parsed == Rejection(status=400, reason=f"missing subprotocol {SUBPROTOCOL}")

    def test_origin_carried(self) -> None:
        """The Origin header, when present, is carried for the origin check."""
        parsed = parse_request(CONNECT_PATH, headers(Origin="https://app.example"))
        assert isinstance(parsed, HandshakeRequest)
        assert parsed.origin == "https://app.example"

    def test_token_not_in_repr(self) -> None:
        """A parsed request never shows its token in repr."""
        assert TOKEN not in repr(request())


class TestOrigin:
    def test_absent_origin_allowed(self) -> None:
        """Sidecars are not browsers and send no Origin: that is accepted."""
        assert check_origin(None, ()) is None

    def test_listed_origin_allowed(self) -> None:
        """An origin listed in the config is accepted."""
        assert check_origin("https://ok.example", ("https://ok.example",)) is None

    def test_other_origin_403(self) -> None:
        """Any other origin is 403."""
        assert check_origin("https://evil.example", ("https://ok.example",)) == Rejection(
            status=403, reason="origin not allowed"
        )


class TestAuthorize:
    def test_current_identity_accepted(self) -> None:
        """The current sidecar with its token is accepted while provisioning or allocated."""
        assert authorize(request(), identity()) is None
        assert authorize(request(), identity(status=Status.PROVISIONING)) is None

    def test_unknown_allocation_401(self) -> None:
        """No allocation with that id is 401."""
        assert authorize(request(), None) == Rejection(status=401, reason="unauthorized")

    def test_wrong_token_401(self) -> None:
        """A well-formed token of the right length that does not match is 401."""
        rejection = authorize(request(token=new_token()), identity())
        assert rejection == Rejection(status=401, reason="unauthorized")

    def test_wrong_sidecar_401(self) -> None:
        """Another sidecar id with the right token is 401, with the same reason as a bad token."""
        rejection = authorize(request(sidecar_id="sc_other"), identity())
        assert rejection == Rejection(status=401, reason="unauthorized")

    def test_newer_generation_401(self) -> None:
        """A generation newer than the allocation's is no identity the hub knows: 401."""
        assert isinstance(authorize(request(generation=4), identity()), Rejection)
        assert authorize(request(generation=4), identity()).status == 401  # type: ignore[union-attr]

    def test_no_identity_bound_401(self) -> None:
        """A pending allocation has no identity yet: 401."""
        rejection = authorize(
            request(), identity(status=Status.PENDING, sidecar_id=None, token_hash=None)
        )
        assert rejection is not None
        assert rejection.status == 401

    def test_stale_generation_409(self) -> None:
        """An older generation is 409 whatever the token: the sidecar was replaced."""
        rejection = authorize(request(generation=2, token=new_token()), identity())
        assert rejection == Rejection(
            status=409, reason="stale generation: this sidecar was replaced"
        )

    @pytest.mark.parametrize(
        "status",
        [Status.REPLACING, Status.RELEASING, Status.RELEASED, Status.FAILED, Status.DESTROY_FAILED],
    )
    def test_not_accepting_409(self, status: Status) -> None:
        """Terminal, replacing and releasing allocations accept no sidecar: 409."""
        rejection = authorize(request(), identity(status=status))
        assert rejection == Rejection(status=409, reason="allocation no longer accepts sidecars")

    def test_unavailable_503(self) -> None:
        """Identity that cannot be checked is 503 with a Retry-After, never 401."""
        assert unavailable(7) == Rejection(
            status=503, reason="sidecar identity cannot be checked now", retry_after=7
        )


OLD = new_reconnect_secret()
NEW = new_reconnect_secret()


class TestReconnectSecret:
    def test_parsed_only_with_v2(self) -> None:
        """The secret header is taken with v2, refused (400) with v1, and must be well formed;
        v1 alone is still spoken."""
        parsed = parse_request(CONNECT_PATH, headers(Hubd_Reconnect_Secret=NEW))
        assert isinstance(parsed, HandshakeRequest)
        assert (parsed.version, parsed.secret) == (2, NEW)
        assert NEW not in repr(parsed)
        v1 = parse_request(CONNECT_PATH, headers(Sec_WebSocket_Protocol="hubd.sidecar.v1"))
        assert isinstance(v1, HandshakeRequest)
        assert (v1.version, v1.secret) == (1, None)
        both = headers(Sec_WebSocket_Protocol="hubd.sidecar.v1", Hubd_Reconnect_Secret=NEW)
        assert isinstance(parse_request(CONNECT_PATH, both), Rejection)
        bad = parse_request(CONNECT_PATH, headers(Hubd_Reconnect_Secret="hubd_rs_short"))
        assert bad == Rejection(status=400, reason="malformed Hubd-Reconnect-Secret header")

    @pytest.mark.parametrize(
        ("presented", "state", "accepted"),
        [
            (None, SecretState(), True),
            (NEW, SecretState(), False),
            (None, SecretState(secret_hash=hash_token(NEW)), False),
            (NEW, SecretState(secret_hash=hash_token(NEW)), True),
            (OLD, SecretState(secret_hash=hash_token(NEW)), False),
            # Not acknowledged yet: what opened the latest connection still works.
            (None, SecretState(secret_hash=hash_token(NEW), acknowledged=False), True),
            (
                OLD,
                SecretState(
                    secret_hash=hash_token(NEW), previous_hash=hash_token(OLD), acknowledged=False
                ),
                True,
            ),
            (
                None,
                SecretState(
                    secret_hash=hash_token(NEW), previous_hash=hash_token(OLD), acknowledged=False
                ),
                False,
            ),
            (
                OLD,
                SecretState(
                    secret_hash=hash_token(NEW), previous_hash=hash_token(OLD), acknowledged=True
                ),
                False,
            ),
        ],
        ids=[
            "first-connection",
            "secret-nobody-was-given",
            "token-alone-after-first",
            "current",
            "stale",
            "first-welcome-lost",
            "later-welcome-lost",
            "token-alone-when-a-secret-opened-it",
            "previous-after-ack",
        ],
    )
    def test_which_credential_opens(
        self, presented: str | None, state: SecretState, accepted: bool
    ) -> None:
        """The current secret always; the token alone only before any secret exists; the
        credential of the latest connection only until its welcome is acknowledged."""
        assert secret_accepted(presented, state) is accepted

    def test_authorize_uses_the_secret(self) -> None:
        """A right token with a missing secret is the same 401 as a wrong token; v1 is
        refused once the generation has a secret."""
        state = SecretState(secret_hash=hash_token(NEW))
        assert authorize(request(), identity(secret=state)) == Rejection(
            status=401, reason="unauthorized"
        )
        assert authorize(request(secret=NEW), identity(secret=state)) is None
        assert authorize(request(version=1), identity(secret=state)) is not None
        assert authorize(request(version=1), identity()) is None


class TestCloseCodes:
    def test_codes(self) -> None:
        """The close codes are the protocol's."""
        assert [int(code) for code in CloseCode] == [
            1000,
            1001,
            1008,
            1009,
            1011,
            4000,
            4001,
            4002,
            4003,
        ]

    def test_reasons(self) -> None:
        """Each code the hub sends carries a short reason; unknown codes carry none."""
        assert close_reason(4000) == "superseded"
        assert close_reason(4001) == "retired"
        assert close_reason(4002) == "fenced"
        assert close_reason(4003) == "protocol error"
        assert close_reason(1001) == "going away"
        assert close_reason(4999) == ""


class TestSmallDecisions:
    @pytest.mark.parametrize(
        ("host", "loopback"),
        [
            ("127.0.0.1", True),
            ("::1", True),
            ("[::1]", True),
            ("localhost", True),
            ("0.0.0.0", False),  # noqa: S104 -- a value, not a bind
            ("10.0.0.1", False),
            ("hub.example", False),
            ("", False),
        ],
    )
    def test_loopback(self, host: str, loopback: bool) -> None:
        """Only loopback listeners may go without TLS silently."""
        assert is_loopback_host(host) is loopback

    def test_message_budget(self) -> None:
        """The message budget allows a burst, then refills at its rate."""
        budget = TokenBucket(rate=2.0, burst=3, now=0.0)
        assert [budget.take(0.0) for _ in range(4)] == [True, True, True, False]
        assert budget.take(0.5) is True
        assert budget.take(0.5) is False

    @pytest.mark.parametrize(
        ("body", "notice"),
        [
            (f"{TAG}:3:7:cn_1", ConnectedNotice(TAG, 3, 7, "cn_1")),
            (f"{TAG}:3:7", None),
            (f"{TAG}:3:7:", None),
            (f"{TAG}:3", None),
            (f"{TAG}:0:1:cn_1", None),
            (f"{TAG}::1:cn_1", None),
            (TAG, None),
            (":3:1:cn_1", None),
            (f"{TAG}:x:1:cn_1", None),
            (f"{TAG}:3:x:cn_1", None),
            (f"{TAG}:3:7:cn:1", None),
            # An allocation id is no tag, nor is anything but 32 lowercase hex digits.
            (f"{ALLOCATION}:3:7:cn_1", None),
            (f"{TAG.upper()}:3:7:cn_1", None),
            (f"{TAG[:-1]}:3:7:cn_1", None),
            (f"{TAG}0:3:7:cn_1", None),
            # Digits int() refuses, or too many of them.
            (f"{TAG}:\u00b2:7:cn_1", None),
            (f"{TAG}:3:{'9' * 5000}:cn_1", None),
            ("after-heal", None),
        ],
    )
    def test_connected_payload(self, body: str, notice: ConnectedNotice | None) -> None:
        """A hubd_connected payload, its mac held, names one allocation's tag, a generation
        and its record's number, or nothing when malformed."""
        assert parse_connected_payload(KEY.notice(body), KEY) == notice

    @pytest.mark.parametrize(
        ("body", "control"),
        [
            (f"{TAG}:2:fence", SocketControl(TAG, 2, retire=False)),
            (f"{TAG}:2:retire", SocketControl(TAG, 2, retire=True)),
            (f"{TAG}:2:close", None),
            (f"{TAG}:0:fence", None),
            (f"{TAG}:fence", None),
            (f"{ALLOCATION}:2:fence", None),
            (f"{TAG.upper()}:2:retire", None),
            (f"{TAG}:\u00b2:retire", None),
            (f"{TAG}:{'9' * 5000}:fence", None),
        ],
    )
    def test_sockets_payload(self, body: str, control: SocketControl | None) -> None:
        """A hubd_sockets payload, its mac held, says fence or retire for one allocation's tag
        and one generation, or nothing."""
        assert parse_sockets_payload(KEY.notice(body), KEY) == control


CONNECTED = f"{TAG}:3:7:cn_1"
RETIRE = f"{TAG}:2:retire"


class TestNoticeMacs:
    """Any role may NOTIFY on the daemons' channels: a payload is read only when it ends with
    the mac of the rest under the database's key."""

    @pytest.mark.parametrize(
        "payload",
        [
            CONNECTED,
            RETIRE,
            f"{CONNECTED}:",
            f"{RETIRE}:",
            f"{CONNECTED}:{'0' * MAC_LENGTH}",
            f"{RETIRE}:{'0' * MAC_LENGTH}",
            # Under another database's key.
            NoticeKey(bytes(32)).notice(CONNECTED),
            NoticeKey(bytes(32)).notice(RETIRE),
            # The mac cut, lengthened, in capitals, moved or doubled.
            KEY.notice(RETIRE)[:-1],
            KEY.notice(RETIRE) + "0",
            KEY.notice(RETIRE).upper(),
            f"{KEY.mac(RETIRE)}:{RETIRE}",
            f"{KEY.notice(RETIRE)}:{KEY.mac(RETIRE)}",
            # Another notice's genuine mac, spliced onto a forged body.
            f"{TAG}:3:retire:{KEY.mac(RETIRE)}",
            f"{TAG}:2:fence:{KEY.mac(RETIRE)}",
            f"{TAG}:3:999999999:cn_1:{KEY.mac(CONNECTED)}",
            # A tag is no mac: the key's hash of the body without the mac's prefix.
            f"{RETIRE}:{KEY.tag(RETIRE)}",
            # Not ASCII where the mac goes, or not hex.
            RETIRE + ":" + "\u00e9" * MAC_LENGTH,
            RETIRE + ":" + "g" * MAC_LENGTH,
            "",
            ":",
        ],
    )
    def test_a_payload_without_its_mac_says_nothing(self, payload: str) -> None:
        """Unsigned, signed under another key, with a mac altered or taken from another
        notice, or with a tag for a mac: neither parser reads it."""
        assert parse_connected_payload(payload, KEY) is None
        assert parse_sockets_payload(payload, KEY) is None

    def test_a_replayed_notice_reads_as_it_did(self) -> None:
        """A genuine payload heard and sent again is genuine: what it says was true when the
        database sent it, and the daemon's use of it is idempotent (docs/security.md)."""
        assert parse_connected_payload(KEY.notice(CONNECTED), KEY) == ConnectedNotice(
            TAG, 3, 7, "cn_1"
        )
        assert parse_sockets_payload(KEY.notice(RETIRE), KEY) == SocketControl(TAG, 2, retire=True)

    def test_a_mac_is_never_a_tag(self) -> None:
        """Tags and macs are both the key's hash, kept apart by the macs' prefix, which no
        allocation id starts with ("al_"): the tag of a text is not its mac. And a body of one
        channel never reads as one of the other."""
        assert KEY.mac(ALLOCATION) != KEY.tag(ALLOCATION)
        assert KEY.mac(f"hubd-notice:{ALLOCATION}") != KEY.tag(ALLOCATION)
        assert KEY.tag(f"hubd-notice:{ALLOCATION}") == KEY.mac(ALLOCATION)
        assert len(KEY.mac(RETIRE)) == MAC_LENGTH
        assert parse_sockets_payload(KEY.notice(CONNECTED), KEY) is None
        assert parse_connected_payload(KEY.notice(RETIRE), KEY) is None
