"""The ``/ws`` handshake (:mod:`stadium._core.handshake`) with literal requests in and
decisions out: access, attach, batches, MessagePack, resume, the 101's headers. No
sockets: the transports that call it are tested over real ones (test_resume, test_batch,
test_access, parametrized over picows and the ASGI app)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from stadium._core.access import AccessPolicy, Refusal
from stadium._core.handshake import (
    PLAIN,
    Terms,
    Upgrade,
    attach_id,
    header_map,
    host_port,
    negotiate,
)
from stadium._core.protocol import Encoding

TOKEN = "s3cret"
ADDR = "10.0.0.7:8000"
WS = {"Upgrade": "websocket", "Host": "127.0.0.1:8000"}
#: The 101 headers naming where a resumable connection's sessions live (grace 30 s).
WHERE = (
    ("X-Stadium-Node", "node-a"),
    ("X-Stadium-Address", ADDR),
    ("X-Stadium-Resume-Grace", "30"),
)


def _terms(grace: float = 30.0, token: str | None = None, origins: tuple[str, ...] = ()) -> Terms:
    counter = itertools.count(1)
    return Terms(
        AccessPolicy(token=token, allowed_origins=origins),
        node="node-a",
        resume_grace=grace,
        mint=lambda: (f"1f-{next(counter):04d}", f"tok{next(counter)}"),
    )


def _ask(target: str, terms: Terms | None = None, /, **headers: str) -> Upgrade | Refusal | None:
    sent = CIMultiDict({**WS, **{k.replace("_", "-"): v for k, v in headers.items()}})
    return negotiate(terms or _terms(), target, sent, local_addr="127.0.0.1", address=ADDR)


# -- what a connection carries ----------------------------------------------------------

UPGRADES: list[tuple[str, str, dict[str, str], Upgrade]] = [
    ("plain (OpenEnv)", "/ws", {}, PLAIN),
    ("unknown query", "/ws?foo=1", {}, PLAIN),
    (
        "msgpack",
        "/ws",
        {"Sec-WebSocket-Protocol": "stadium.msgpack"},
        Upgrade(Encoding.MSGPACK, "stadium.msgpack"),
    ),
    ("unknown subprotocol", "/ws", {"Sec-WebSocket-Protocol": "graphql-ws"}, PLAIN),
    ("attach", "/ws?session_id=abc", {}, Upgrade(attach="abc")),
    (
        "attach, msgpack",
        "/ws?session_id=abc",
        {"Sec-WebSocket-Protocol": "x, stadium.msgpack"},
        Upgrade(Encoding.MSGPACK, "stadium.msgpack", attach="abc"),
    ),
    (
        "batch",
        "/ws",
        {"Sec-WebSocket-Protocol": "stadium.batch"},
        Upgrade(subprotocol="stadium.batch", batch=True),
    ),
    (
        "batch, msgpack",
        "/ws",
        {"Sec-WebSocket-Protocol": "stadium.batch.msgpack"},
        Upgrade(Encoding.MSGPACK, "stadium.batch.msgpack", batch=True),
    ),
    (
        "batch, both offered: JSON preferred",
        "/ws",
        {"Sec-WebSocket-Protocol": "stadium.batch.msgpack, stadium.batch"},
        Upgrade(subprotocol="stadium.batch", batch=True),
    ),
    (
        "batch over msgpack when both offered",
        "/ws",
        {"Sec-WebSocket-Protocol": "stadium.msgpack, stadium.batch.msgpack"},
        Upgrade(Encoding.MSGPACK, "stadium.batch.msgpack", batch=True),
    ),
    (
        "resumable batch",
        "/ws?stadium_resume=1",
        {"Sec-WebSocket-Protocol": "stadium.batch"},
        Upgrade(subprotocol="stadium.batch", headers=WHERE, batch=True, resumable=True),
    ),
    (
        "a batch's resume: the id only routes it, no token needed",
        "/ws?stadium_resume=1f-0001",
        {"Sec-WebSocket-Protocol": "stadium.batch.msgpack"},
        Upgrade(
            Encoding.MSGPACK, "stadium.batch.msgpack", headers=WHERE, batch=True, resumable=True
        ),
    ),
    (
        "attach is never batched",
        "/ws?session_id=abc",
        {"Sec-WebSocket-Protocol": "stadium.batch"},
        Upgrade(attach="abc"),
    ),
    (
        "new resumable session",
        "/ws?stadium_resume=1",
        {},
        Upgrade(
            headers=(("X-Stadium-Session", "1f-0001"), ("X-Stadium-Resume-Token", "tok2"), *WHERE),
            resumable=True,
            session=("1f-0001", "tok2"),
        ),
    ),
    (
        "new resumable session, msgpack",
        "/ws?stadium_resume=true",
        {"Sec-WebSocket-Protocol": "stadium.msgpack"},
        Upgrade(
            Encoding.MSGPACK,
            "stadium.msgpack",
            (("X-Stadium-Session", "1f-0001"), ("X-Stadium-Resume-Token", "tok2"), *WHERE),
            resumable=True,
            session=("1f-0001", "tok2"),
        ),
    ),
    ("an attached session is not resumable", "/ws?session_id=abc&stadium_resume=1", {},
     Upgrade(attach="abc")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("target", "headers", "expected"),
    [case[1:] for case in UPGRADES],
    ids=[case[0] for case in UPGRADES],
)
def test_upgrades(target: str, headers: dict[str, str], expected: Upgrade) -> None:
    assert _ask(target, **headers) == expected


def test_a_resume_names_the_session_its_token_and_what_the_client_got() -> None:
    got = _ask(
        "/ws?stadium_resume=1f-abc&stadium_received=7&stadium_node=n&stadium_addr=h:1",
        X_Stadium_Resume_Token="tok",
        Sec_WebSocket_Protocol="stadium.msgpack",
    )
    assert isinstance(got, Upgrade)
    assert got.resume is not None
    assert (got.resume.sid, got.resume.token, got.resume.received) == ("1f-abc", "tok", 7)
    assert (got.encoding, got.subprotocol, got.headers) == (Encoding.MSGPACK, "stadium.msgpack", ())
    assert got.resumable
    assert not got.batch
    assert got.session is None


def test_resume_off_on_the_server() -> None:
    """``--resume-grace 0``: a new session asking to be resumable is a plain one (no
    headers), a batch's sessions are not resumable; a resume is still decided (and refused
    by the server: no session is held)."""
    terms = _terms(grace=0)
    assert _ask("/ws?stadium_resume=1", terms) == PLAIN
    assert _ask("/ws?stadium_resume=1", terms, Sec_WebSocket_Protocol="stadium.batch") == Upgrade(
        subprotocol="stadium.batch", batch=True
    )
    resumed = _ask("/ws?stadium_resume=1f-ab", terms, X_Stadium_Resume_Token="t")
    assert isinstance(resumed, Upgrade)
    assert resumed.resume is not None


def test_each_new_resumable_session_gets_its_own_id_and_token() -> None:
    terms = _terms()
    first, second = _ask("/ws?stadium_resume=1", terms), _ask("/ws?stadium_resume=1", terms)
    assert isinstance(first, Upgrade)
    assert isinstance(second, Upgrade)
    assert first.session == ("1f-0001", "tok2")
    assert second.session == ("1f-0003", "tok4")


def test_the_address_is_read_only_for_a_resumable_connection() -> None:
    read: list[int] = []

    def address() -> str:
        read.append(1)
        return "[::1]:9"

    headers = CIMultiDict(WS)
    for target in ("/ws", "/ws?session_id=a", "/ws?stadium_resume=1f-a"):
        negotiate(_terms(), target, headers, address=address)
    assert read == []
    got = negotiate(_terms(), "/ws?stadium_resume=1", headers, address=address)
    assert isinstance(got, Upgrade)
    assert ("X-Stadium-Address", "[::1]:9") in got.headers
    assert read == [1]
    got = negotiate(_terms(), "/ws?stadium_resume=1", headers, address="")
    assert isinstance(got, Upgrade)
    assert ("X-Stadium-Address", "node-a") in got.headers  # no IP address: the node's name


# -- refusals ------------------------------------------------------------------------------

REFUSALS: list[tuple[str, str, dict[str, str], int, str, str]] = [
    ("resume id not an id", "/ws?stadium_resume=../../etc", {}, 400, "RESUME_FAILED",
     "is not a session id (use 1 to open a resumable session)"),
    ("resume without its token", "/ws?stadium_resume=1f-abc", {}, 400, "RESUME_FAILED",
     "needs its token in the X-Stadium-Resume-Token header"),
    ("resume, received not a count", "/ws?stadium_resume=1f-abc&stadium_received=x",
     {"X-Stadium-Resume-Token": "t"}, 400, "RESUME_FAILED", "must be a count of replies"),
    ("resume, received a non-ASCII digit", "/ws?stadium_resume=1f-abc&stadium_received=%C2%B2",
     {"X-Stadium-Resume-Token": "t"}, 400, "RESUME_FAILED", "must be a count of replies"),
    ("cross-site page", "/ws", {"Origin": "https://evil.example"}, 403, "FORBIDDEN_ORIGIN",
     "--allow-origin https://evil.example"),
    ("DNS rebinding", "/ws", {"Host": "evil.example:8000"}, 403, "FORBIDDEN_HOST",
     "Connect to 127.0.0.1 or localhost"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("target", "headers", "status", "code", "says"),
    [case[1:] for case in REFUSALS],
    ids=[case[0] for case in REFUSALS],
)
def test_refusals(target: str, headers: dict[str, str], status: int, code: str, says: str) -> None:
    got = _ask(target, None, **{k.replace("-", "_"): v for k, v in headers.items()})
    assert isinstance(got, Refusal)
    assert (got.status, got.code) == (status, code)
    assert says in got.message


def test_the_token_is_checked_before_anything_else_is_decided() -> None:
    terms = _terms(token=TOKEN)
    minted = terms.mint
    calls: list[int] = []

    def mint() -> tuple[str, str]:  # a refused request mints no id
        calls.append(1)
        return minted()

    terms = Terms(terms.access, terms.node, terms.resume_grace, mint)
    for target in ("/ws", "/ws?stadium_resume=1", "/ws?stadium_resume=bad", "/metrics"):
        got = _ask(target, terms)
        assert isinstance(got, Refusal), target
        assert got.status == 401
        assert ("WWW-Authenticate", "Bearer") in got.headers
    assert calls == []
    assert _ask("/ws?stadium_resume=1", terms, Authorization=f"Bearer {TOKEN}") == Upgrade(
        headers=(("X-Stadium-Session", "1f-0001"), ("X-Stadium-Resume-Token", "tok2"), *WHERE),
        resumable=True,
        session=("1f-0001", "tok2"),
    )
    assert calls == [1]
    assert _ask("/health", terms) is None  # open to probes, and answered by the endpoints


def test_what_is_not_a_session_upgrade_goes_to_the_endpoints() -> None:
    for target in ("/health", "/metadata", "/ws/x", "/wsx", "/"):
        assert _ask(target) is None, target
    no_upgrade = CIMultiDict({"Host": "127.0.0.1"})
    assert negotiate(_terms(), "/ws", no_upgrade) is None  # their 426 says how to upgrade
    assert negotiate(_terms(), "/ws", no_upgrade, websocket=True) == PLAIN  # an ASGI scope


def test_allowed_origin_passes() -> None:
    terms = _terms(origins=("https://app.example",))
    assert _ask("/ws", terms, Origin="https://app.example") == PLAIN
    assert _ask("/ws", terms, Origin="http://127.0.0.1:8000") == PLAIN  # same origin


# -- the same decisions from raw (ASGI) headers ------------------------------------------


def test_raw_headers_give_the_same_decisions() -> None:
    raw = [
        (b"host", b"127.0.0.1:8000"),
        (b"Upgrade", b"websocket"),
        (b"Sec-WebSocket-Protocol", b"chat"),
        (b"sec-websocket-protocol", b"stadium.msgpack"),
        (b"X-Stadium-Resume-Token", b"t1"),
        (b"X-Stadium-Resume-Token", b"t2"),
    ]
    headers = header_map(raw)
    assert headers["sec-websocket-protocol"] == "chat, stadium.msgpack"
    assert headers["x-stadium-resume-token"] == "t1"  # the first, as picows' headers give it
    for target in ("/ws", "/ws?stadium_resume=1f-a", "/ws?session_id=s"):
        picows = negotiate(_terms(), target, CIMultiDict(
            [(k.decode(), v.decode()) for k, v in raw]), address=ADDR)  # fmt: skip
        asgi = negotiate(_terms(), target, headers, address=ADDR)
        listed = negotiate(
            _terms(), target, headers, address=ADDR, offered=["chat", "stadium.msgpack"]
        )
        assert _plain(picows) == _plain(asgi) == _plain(listed), target
        assert _plain(asgi)[1] == "stadium.msgpack"  # the second header counted too


def _plain(got: Upgrade | Refusal | None) -> tuple[Any, ...]:
    """An upgrade as plain values (a ResumeAsk has no equality of its own)."""
    assert isinstance(got, Upgrade)
    ask = got.resume
    resume = None if ask is None else (ask.sid, ask.token, ask.received, ask.batched)
    return (*got._replace(resume=None), resume)


def test_helpers() -> None:
    assert attach_id("a=1&session_id=xyz") == "xyz"
    assert attach_id("session_id=") is None
    assert attach_id("stadium_resume=1") is None
    assert host_port(("127.0.0.1", 80)) == "127.0.0.1:80"
    assert host_port(("::1", 80, 0, 0)) == "[::1]:80"
    assert host_port("/run/stadium.sock") is None
    assert host_port(None) is None
    assert host_port(("h", "not a port")) is None


# -- it never raises -------------------------------------------------------------------

_NAMES = [
    "host", "origin", "authorization", "upgrade", "sec-websocket-protocol", "connection",
]  # fmt: skip
_TEXT = st.text(max_size=40)
_KEYS = st.sampled_from(["stadium_resume", "stadium_received", "session_id", "stadium_node"])
_VALUES = st.sampled_from(["1", "true", "1f-ab", "zz-1", "%C2%B2", "٣", "%00", "", "-"])
_PAIRS = st.lists(st.tuples(_KEYS | _TEXT, _VALUES | _TEXT).map("=".join) | _TEXT, max_size=5)
_QUERY = _PAIRS.map("&".join) | (_VALUES | _TEXT).map(  # a resume, near the valid ones
    lambda received: f"stadium_resume=1f-ab&stadium_received={received}"
)
_SUBPROTOCOLS = st.sampled_from(
    ["stadium.batch", "stadium.batch.msgpack", "stadium.msgpack", "", " ", "x"]
)


@settings(max_examples=400, deadline=None)
@given(
    path=st.sampled_from(["/ws", "/ws", "/ws", "/ws/", "/health", ""]) | _TEXT,
    query=_QUERY,
    values=st.dictionaries(st.sampled_from(_NAMES), _TEXT | _SUBPROTOCOLS, max_size=6),
    resume_token=st.none() | st.sampled_from(["tok", ""]) | _TEXT,
    offered=st.none() | st.lists(_SUBPROTOCOLS | _TEXT, max_size=4),
    websocket=st.sampled_from([True, True, None, False]),
    grace=st.sampled_from([0.0, 0.5, 30.0]),
    token=st.sampled_from([None, None, TOKEN]),
    local=st.sampled_from([None, "127.0.0.1", "::1", "10.1.2.3", "", "x"]),
)
def test_never_raises(
    path: str,
    query: str,
    values: dict[str, str],
    offered: list[str] | None,
    resume_token: str | None,
    websocket: bool | None,
    grace: float,
    token: str | None,
    local: str | None,
) -> None:
    terms = _terms(grace=grace, token=token, origins=("https://app.example",))
    target = f"{path}?{query}" if query else path
    if resume_token is not None:
        values["x-stadium-resume-token"] = resume_token
    got: Any = negotiate(
        terms,
        target,
        CIMultiDict(values),
        local_addr=local,
        address=ADDR,
        offered=offered,
        websocket=websocket,
    )
    assert got is None or isinstance(got, Upgrade | Refusal)
    if isinstance(got, Upgrade):
        assert target.partition("?")[0] == "/ws"
        assert got.batch + (got.resume is not None) + (got.session is not None) <= 1
        assert not (got.attach is not None and (got.batch or got.session is not None))
        assert (got.encoding is Encoding.MSGPACK) == (got.subprotocol or "").endswith("msgpack")
    if isinstance(got, Refusal):
        assert got.status in (400, 401, 403)
        assert got.message


@settings(max_examples=200, deadline=None)
@given(
    sid=st.sampled_from(["1f-ab", "0-0", "FF-9z"])
    | st.text(st.characters(categories=["Ll", "Nd", "Pd"]), max_size=12),
    received=st.sampled_from(["0", "12", "\u00b2", "\u2460", "%C2%B2", "\u0663", "-1", ""])
    | st.text(st.characters(categories=["Nd", "No", "Nl"]), max_size=3),
    token=st.sampled_from(["tok", ""]),
)
def test_a_resume_never_raises(sid: str, received: str, token: str) -> None:
    """The resume parameters, near valid ones: any digit of any script, any id."""
    target = f"/ws?stadium_resume={sid}&stadium_received={received}"
    got = _ask(target, None, X_Stadium_Resume_Token=token)
    assert isinstance(got, Upgrade | Refusal)
    if isinstance(got, Upgrade) and got.resume is not None:
        assert got.resume.received >= 0
