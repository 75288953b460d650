"""The client's resume book with literal inputs, no sockets: numbering, unanswered
requests, the ``received`` count, what a resume asks for and what it sends again,
reply matching by id, the resumable close codes; and the one ConnectOptions every
client builds its connection from."""

from __future__ import annotations

import collections
import dataclasses
import ssl

import msgspec
import pytest

import stadium
from stadium._client.options import TOKEN_ENV, ConnectOptions, with_query
from stadium._core.client import ClientProtocol
from stadium._core.frames import Reply
from stadium._core.resume import (
    ADDR_HEADER,
    GRACE_HEADER,
    GRACE_SLACK_S,
    NODE_HEADER,
    SESSION_HEADER,
    TOKEN_HEADER,
    AfterResume,
    ResumeAsk,
    ResumeBook,
    ResumeCall,
    ResumedData,
    resumable_close,
)
from stadium._errors import ConfigError


def _resumed(book: ResumeBook[str], data: dict[str, object]) -> AfterResume[str]:
    """``book`` reads a ``resumed`` answer's data given as JSON would bring it."""
    return book.resumed(msgspec.convert(data, ResumedData[Reply]))


def _sent(book: ResumeBook[str], *requests: str) -> list[int]:
    numbers = []
    for request in requests:
        rid = book.number()
        book.keep(rid, request)
        numbers.append(rid)
    return numbers


def test_requests_are_numbered_from_one_and_kept_until_answered() -> None:
    book: ResumeBook[str] = ResumeBook("s1", "t1")
    assert _sent(book, "a", "b", "c") == [1, 2, 3]
    assert book.sent == 3
    assert list(book.unanswered) == [(1, "a"), (2, "b"), (3, "c")]
    assert book.replied() == "a"  # replies come in order: the oldest is answered
    assert book.received == 1
    assert list(book.unanswered) == [(2, "b"), (3, "c")]


def test_a_reply_with_an_id_answers_only_the_request_of_that_number() -> None:
    book: ResumeBook[str] = ResumeBook("s1")
    _sent(book, "a", "b")
    assert book.replied(2) is None  # not the oldest: counted, nothing answered
    assert book.received == 1
    assert [rid for rid, _ in book.unanswered] == [1, 2]
    assert book.replied(1) == "a"
    assert book.replied() == "b"
    assert book.replied() is None  # a reply with nothing kept (e.g. a refusal): counted
    assert book.received == 4


def test_a_resume_asks_with_the_replies_received_and_the_token() -> None:
    book: ResumeBook[str] = ResumeBook("s1", "t1", node="n1", address="10.0.0.1:8000")
    _sent(book, "a", "b")
    book.replied()
    ask = book.ask()
    assert ask.query() == {
        "stadium_resume": "s1",
        "stadium_received": "1",
        "stadium_node": "n1",
        "stadium_addr": "10.0.0.1:8000",
    }
    assert ask.headers() == {TOKEN_HEADER: "t1"}
    assert ask.call() == ResumeCall("s1", "t1", 1)
    assert ResumeAsk.from_call(ask.call()).sid == "s1"
    assert ResumeAsk(None).query() == {"stadium_resume": "1"}  # a new resumable session
    assert with_query("ws://h:1/ws?stadium_resume=1&x=y", ask.query()) == (
        "ws://h:1/ws?x=y&stadium_resume=s1&stadium_received=1&stadium_node=n1"
        "&stadium_addr=10.0.0.1%3A8000"
    )


def test_resumed_resends_what_the_server_never_got_and_rotates_the_token() -> None:
    book: ResumeBook[str] = ResumeBook("s1", "t1", node="n1", address="a1")
    _sent(book, "a", "b", "c", "d")
    book.replied()  # "a" answered; the connection drops with b, c, d in flight
    back = _resumed(book, {"session": "s1", "token": "t2", "requests": 2, "replayed": 1})
    assert back.resend == ["c", "d"]  # numbered above the server's 2: lost on the way in
    assert back.owed == [(2, "b")]  # got, its reply follows the `resumed` frame
    assert back.answered == []
    assert (book.session_id, book.token, book.node, book.address) == ("s1", "t2", "n1", "a1")
    # The kept requests stay kept until their replies come (the replayed one first).
    assert [rid for rid, _ in book.unanswered] == [2, 3, 4]
    assert [book.replied(), book.replied(), book.replied()] == ["b", "c", "d"]


def test_a_session_restored_elsewhere_takes_its_new_id_node_and_address() -> None:
    book: ResumeBook[str] = ResumeBook("s1", "t1", node="n1", address="a1")
    _resumed(book, {"session": "s9", "token": "t2", "node": "n2", "address": "a2", "requests": 0})
    assert (book.session_id, book.token, book.node, book.address) == ("s9", "t2", "n2", "a2")
    _resumed(book, {"token": "t3", "requests": 0})  # absent: the session's as they were
    assert (book.session_id, book.token, book.node, book.address) == ("s9", "t3", "n2", "a2")


def test_a_batch_resume_answers_the_calls_with_the_replies_it_carries() -> None:
    book: ResumeBook[str] = ResumeBook("s1", "t1")
    _sent(book, "reset", "step", "step2")
    replies = [{"id": 1, "type": "observation"}, {"id": 2, "type": "observation"}]
    back = _resumed(book, {"token": "t2", "requests": 2, "replies": replies})
    assert back.answered == [
        ("reset", Reply("observation", id=1)),
        ("step", Reply("observation", id=2)),
    ]
    assert book.received == 2
    assert back.resend == ["step2"]
    assert back.owed == []


def test_a_carried_reply_for_another_request_answers_nothing() -> None:
    book: ResumeBook[str] = ResumeBook("s1")
    _sent(book, "a", "b")
    back = _resumed(book, {"token": "t", "requests": 2, "replies": [{"id": 2, "type": "state"}]})
    assert back.answered == []
    assert book.received == 0
    assert back.owed == [(1, "a"), (2, "b")]  # the server got them: a batch lost their replies


def test_the_book_of_a_granted_101_and_none_when_not_granted() -> None:
    headers = {
        SESSION_HEADER: "s1",
        TOKEN_HEADER: "t1",
        NODE_HEADER: "n1",
        ADDR_HEADER: "127.0.0.1:9",
        GRACE_HEADER: "30",
    }
    book: ResumeBook[bytes] | None = ResumeBook.granted(headers.get)
    assert book is not None
    assert (book.session_id, book.token, book.node, book.address, book.grace) == (
        "s1",
        "t1",
        "n1",
        "127.0.0.1:9",
        30.0,
    )
    assert (book.sent, book.received, list(book.unanswered)) == (0, 0, [])
    assert book.deadline(100.0) == 100.0 + 30.0 + GRACE_SLACK_S
    bad = ResumeBook[bytes].granted({SESSION_HEADER: "s1", GRACE_HEADER: "soon"}.get)
    assert bad is not None
    assert (bad.grace, bad.token) == (0.0, "")
    assert ResumeBook[bytes].granted({}.get) is None  # an OpenEnv server: not resumable


def test_drain_forgets_every_request_in_order() -> None:
    book: ResumeBook[str] = ResumeBook("s1")
    _sent(book, "a", "b")
    assert book.drain() == ["a", "b"]
    assert list(book.unanswered) == []
    assert book.number() == 3  # numbering goes on


@pytest.mark.parametrize(
    ("code", "resumed"),
    [(None, True), (1006, True), (1012, True), (1000, False), (1001, False), (1008, False)],
)
def test_the_resumable_close_codes(code: int | None, resumed: bool) -> None:
    assert resumable_close(code) is resumed


def test_reply_matching_by_id() -> None:
    proto = ClientProtocol()
    assert proto.reply(b'{"id": 3, "type": "observation", "data": {}}', 3) == Reply(
        "observation", {}, 3
    )
    assert proto.in_sync
    err = proto.reply(b'{"type": "error", "data": {"code": "SESSION_ERROR", "message": "x"}}', 3)
    assert isinstance(err, stadium.SessionError)  # no id: the reply to the request it follows
    assert proto.in_sync
    other = proto.reply(b'{"id": 2, "type": "observation"}', 3)
    assert isinstance(other, stadium.SessionClosedError)
    assert not proto.in_sync  # another request's reply: the session is dropped


def test_connect_options_resolve_the_token_into_the_authorization_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert ConnectOptions.create().headers == {"Authorization": "Bearer from-env"}
    assert ConnectOptions.create(token="").headers == {}
    assert ConnectOptions.create(token="t").headers == {"Authorization": "Bearer t"}
    own = {"authorization": "Basic x", "X-A": "1"}
    assert ConnectOptions.create(token="t", headers=own).headers == own
    monkeypatch.delenv(TOKEN_ENV)
    assert ConnectOptions.create().headers == {}


def test_connect_options_are_given_once_frozen_and_shared() -> None:
    opts = ConnectOptions.create(msgpack=True, request_timeout=5.0, token="")
    assert ConnectOptions.given(opts, msgpack=False, request_timeout=600.0) is opts
    assert ConnectOptions.given(None, request_timeout=5.0, token="") == ConnectOptions(
        request_timeout=5.0
    )
    with pytest.raises(ConfigError, match="given twice: options= and max_retries=, ssl="):
        ConnectOptions.given(opts, max_retries=0, ssl=ssl.create_default_context())
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.msgpack = False  # type: ignore[misc]
    encode, decode = opts.codec()
    assert decode(encode({"a": 1})) == {"a": 1}
    assert encode({"a": 1})[:1] == b"\x81"  # a MessagePack map


def test_every_client_takes_the_same_options_object() -> None:
    import stadium
    from stadium._client.batch_pool import BatchGroup

    opts = stadium.ConnectOptions.create(request_timeout=7.0, token="secret")
    client: stadium.AsyncClient[object] = stadium.AsyncClient("http://127.0.0.1:9", options=opts)
    assert client.options is opts
    assert client.request_timeout == 7.0
    assert client.headers["Authorization"] == "Bearer secret"
    with pytest.raises(ConfigError, match="given twice"):
        stadium.AsyncClient("http://127.0.0.1:9", options=opts, msgpack=True)
    # The same keywords build the same options in every client.
    kw = {"request_timeout": 7.0, "token": "secret"}
    assert stadium.AsyncClient("http://127.0.0.1:9", **kw).options == opts  # type: ignore[arg-type]
    assert "options" in BatchGroup.open.__kwdefaults__  # type: ignore[operator]


def test_carried_replies_without_ids_answer_the_oldest_requests_in_order() -> None:
    # The batched pool numbers its calls in the book only (none on the wire): the replies
    # a resume carries are the missed ones, oldest first, one per request.
    book: ResumeBook[str] = ResumeBook("s1", "t1")
    _sent(book, "reset", "step", "step2")
    book.replied()  # the reset's reply came before the loss
    replies = [{"type": "observation", "data": {"n": 2}}]
    back = _resumed(book, {"token": "t2", "requests": 3, "replies": replies})
    assert back.answered == [("step", Reply("observation", {"n": 2}))]
    assert book.received == 2
    assert back.resend == []
    assert back.owed == [(3, "step2")]


def test_a_batch_result_answers_its_call_only_when_it_is_the_oldest_kept() -> None:
    book: ResumeBook[tuple[dict[str, int], None]] = ResumeBook("s1")
    first, second, other = {"n": 1}, {"n": 2}, {"n": 1}
    book.keep(book.number(), (first, None))
    book.keep_next((second, None))  # number 2
    assert [n for n, _ in book.unanswered] == [1, 2]
    assert not book.replied_to(second)  # not the oldest: nothing counted
    assert not book.replied_to(other)  # an equal call is not the same call
    assert book.received == 0
    assert book.replied_to(first)
    assert book.replied_to(second)
    assert book.received == 2
    assert book.unanswered == collections.deque()
