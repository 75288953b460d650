"""The messages between a worker and its env processes, their limits, the worker's reading
of a session's socket, and the sandbox's settings: no env processes (the process-level
tiers are test_isolation.py and test_seam.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stadium import ConfigError, EnvProtocolError, ErrorCode
from stadium._server.isolation import Limits, wire
from stadium._server.isolation.sandbox import UidLease, bwrap_argv
from stadium._server.isolation.worker.proc import EnvProcess, Gone, WireStats, foreign_error
from tests.conftest import UNIT

MIB = 1024 * 1024
SMALL = wire.WireLimits(frame_bytes=4 * MIB, decoded_bytes=8 * MIB, elements=200_000, depth=20)

REQUESTS: list[msgspec.Struct] = [
    wire.Reset({"seed": 3, "options": {"a": [1]}}, 64),
    wire.Step(b"\x81\xa1x\x01", {"timeout_s": 2.5}),
    wire.GetState(),
    wire.ListTools(),
    wire.CallTool("add", {"a": 1, "b": [2, 3]}),
    wire.Restore(b"snapshot"),
    wire.Fork(),
    wire.Close(),
]
REPLIES: list[tuple[msgspec.msgpack.Decoder[Any], msgspec.Struct]] = [
    (wire.HELLO_REPLY, wire.Hello()),
    (wire.HELLO_REPLY, wire.Raised("SandboxError", "no pid namespace")),
    (wire.STEP_REPLY, wire.StepOk({"text": "hi"}, 1.5, False, False, {"k": 1})),
    (wire.STEP_REPLY, wire.StepOk([1, 2], None, True, True, None, unsnapshotted="a lock")),
    (wire.STEP_REPLY, wire.Raised("ValueError", "bad", {"code": "EXECUTION_ERROR"})),
    (wire.VALUE_REPLY, wire.ValueOk({"step_count": 3})),
    (wire.TOOLS_REPLY, wire.ToolsOk([{"name": "add", "inputSchema": {}}])),
    (wire.DONE_REPLY, wire.Done()),
]
CONTROL: list[msgspec.Struct] = [
    wire.Ready(12, "docker-default", None),
    wire.Ready(12),
    wire.Failed("ImportError: no module"),
    wire.Spawned(5 << 22 | 2),
    wire.Exit((1 << 64) - 1, -1),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_round_trips(msg: msgspec.Struct) -> None:
    assert wire.decode_request(wire.encode(msg)) == msg


@pytest.mark.parametrize(("decoder", "msg"), REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips_through_the_limits(
    decoder: msgspec.msgpack.Decoder[Any], msg: msgspec.Struct
) -> None:
    assert SMALL.decode(decoder, wire.encode(msg)) == msg


def test_a_durable_snapshot_comes_as_a_view_of_the_frame_no_copy() -> None:
    body = bytearray(wire.encode(wire.StepOk(1, 0.0, False, False, None, memoryview(b"s" * 99))))
    reply = wire.WireLimits().decode(wire.STEP_REPLY, body)
    assert isinstance(reply.snapshot, memoryview)
    assert bytes(reply.snapshot) == b"s" * 99
    assert reply.snapshot.obj is body


@pytest.mark.parametrize("msg", CONTROL, ids=lambda m: type(m).__name__)
def test_every_control_message_round_trips(msg: msgspec.Struct) -> None:
    assert wire.decode_control(wire.encode(msg)) == msg
    spawn = wire.Spawn(["/sys/fs/cgroup/memory/x"], 1_000_001, "127.0.0.1 h\n")
    assert wire.decode_spawn(wire.encode(spawn)) == spawn


def test_the_native_inits_exit_report_is_an_exit_message() -> None:
    # native/stadium-init writes ["exit", key (uint64), status (int64)] by hand.
    packet = (
        b"\x93\xa4exit\xcf" + (5 << 22 | 2).to_bytes(8, "big") + b"\xd3" + (9).to_bytes(8, "big")
    )
    assert wire.decode_control(packet) == wire.Exit(5 << 22 | 2, 9)


@pytest.mark.parametrize(
    "packet", [b"", b"\xc1", wire.encode(wire.Hello()), msgspec.msgpack.encode(["exit", "x", 1])]
)
def test_a_control_packet_that_is_no_control_message_is_refused(packet: bytes) -> None:
    with pytest.raises(EnvProtocolError) as caught:
        wire.decode_control(packet)
    assert caught.value.context["limit"] == "type"


def _step(observation: Any) -> bytes:
    return wire.encode(wire.StepOk(observation, 0.0, False, False, None))


@pytest.mark.parametrize(
    ("observation", "limit"),
    [
        ([[]] * 1_000_000, "decoded_bytes"),  # 1 MB that would decode to ~64 MB
        ([{}] * 200_000, "decoded_bytes"),
        ([0] * 300_000, "elements"),
        ([[1, "a"]] * 60_000, "decoded_bytes"),  # no run of one kind: read value by value
        ([1.5] * 400_000, "decoded_bytes"),
        ("x" * (5 * MIB), "frame_bytes"),
    ],
)
def test_a_reply_over_a_limit_is_refused_naming_the_limit(observation: Any, limit: str) -> None:
    with pytest.raises(EnvProtocolError) as caught:
        SMALL.decode(wire.STEP_REPLY, _step(observation))
    assert caught.value.code is ErrorCode.ENV_PROTOCOL
    assert caught.value.context["limit"] == limit
    assert limit in caught.value.message


def test_nesting_is_refused_past_the_depth_limit_in_large_frames_and_small_ones() -> None:
    deep: Any = []
    for _ in range(30):
        deep = [deep]
    with pytest.raises(EnvProtocolError, match="depth"):  # scanned: over 64 KiB
        SMALL.decode(wire.STEP_REPLY, _step([deep, "x" * wire.DIRECT_BYTES]))
    body = b"\x96\x00" + b"\x91" * 50_000 + b"\x90\xc0\xc2\xc2\xc0"  # 50 KiB: decoded directly
    with pytest.raises(EnvProtocolError, match="malformed"):  # msgspec's recursion guard
        SMALL.decode(wire.STEP_REPLY, body)


def test_what_fits_decodes_and_the_estimate_bounds_what_it_takes() -> None:
    observation = {
        "rows": [{"x": i, "y": "abc" * 20} for i in range(20_000)],
        "img": b"p" * 300_000,
    }
    body = _step(observation)
    estimate = wire.scan(body, wire.WireLimits())
    assert wire.WireLimits().decode(wire.STEP_REPLY, body).observation == observation
    # tracemalloc counts what decoding allocates: the estimate is above it.
    import tracemalloc

    tracemalloc.start()
    try:
        decoded = msgspec.msgpack.decode(body)
        taken = tracemalloc.get_traced_memory()[0]
        del decoded
    finally:
        tracemalloc.stop()
    assert taken < estimate < 3 * taken


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        b"\x96\x00",
        _step(1) + b"\x00",  # bytes after the value
        _step("x" * 100_000)[:-1],  # cut
        b"\x96\x00\xdd\xff\xff\xff\xff" + b"\x00" * 70_000,  # an array claiming 4 G values
        b"\x96\x00\xdb\xff\xff\xff\xff" + b"x" * 70_000,  # a str claiming 4 GB
        wire.encode(wire.ValueOk(1)) + b"\x00" * 70_000,
        msgspec.msgpack.encode(["hello", 1]),  # the old wire
    ],
)
def test_malformed_frames_are_refused(body: bytes) -> None:
    with pytest.raises(EnvProtocolError):
        SMALL.decode(wire.STEP_REPLY, body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_but_the_wires_error(data: bytes) -> None:
    for body in (data, b"\x96\x00" + data, data + b"\x00" * (wire.DIRECT_BYTES + 1)):
        for decoder in (wire.STEP_REPLY, wire.VALUE_REPLY, wire.HELLO_REPLY, wire.DONE_REPLY):
            with contextlib.suppress(EnvProtocolError):
                SMALL.decode(decoder, body)
        with contextlib.suppress(EnvProtocolError):
            wire.decode_control(body[:65536])


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=12)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=40,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_values, st.sampled_from([0, 70_000]), st.data())
def test_the_scanner_reads_exactly_what_msgpack_encodes(value: Any, pad: int, data: Any) -> None:
    body = _step([value, "p" * pad])
    cost = wire.scan(body, wire.WireLimits())
    assert cost > 0
    decoded = SMALL.decode(wire.STEP_REPLY, body).observation[0]
    assert msgspec.msgpack.encode(decoded) == msgspec.msgpack.encode(value)  # NaN too
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(EnvProtocolError):  # any prefix is refused, never misread
        wire.scan(body[:cut], wire.WireLimits())


def test_the_reply_limit_refuses_what_cannot_hold_a_reply() -> None:
    assert wire.WireLimits.of_mib(64) == wire.WireLimits()
    with pytest.raises(ConfigError, match="--sandbox-reply-mib"):
        wire.WireLimits.of_mib(4)


# -- the worker's side of a session's socket ----------------------------------------------


async def _pair(limits: wire.WireLimits = SMALL) -> tuple[EnvProcess, socket.socket, WireStats]:
    ours, theirs = socket.socketpair()
    stats = WireStats()
    return EnvProcess(asyncio.get_running_loop(), ours, limits, stats), theirs, stats


async def test_replies_split_anywhere_come_out_whole() -> None:
    proc, theirs, stats = await _pair()
    loop = asyncio.get_running_loop()
    raised: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: raised.append(context))
    for reply in (wire.ValueOk("x" * 70_000), wire.ValueOk(3), wire.ValueOk(b"y" * 300_000)):
        stream = wire.frame(wire.encode(reply))
        for cut in (1, 3, 4, 5, 4096, len(stream)):
            request = asyncio.ensure_future(
                proc.request(wire.encode(wire.GetState()), wire.VALUE_REPLY)
            )
            await asyncio.sleep(0)
            theirs.setblocking(True)
            assert wire.recv_frame(theirs) == wire.encode(wire.GetState())
            theirs.setblocking(False)
            # Eight pieces of ``cut`` bytes, each read before the next is sent, then the rest.
            pieces = [stream[i : i + cut] for i in range(0, 8 * cut, cut)]
            for piece in [*pieces, stream[8 * cut :]]:
                await loop.sock_sendall(theirs, piece)
                await asyncio.sleep(0.002)
            assert await asyncio.wait_for(request, 5 * UNIT) == reply
    assert (stats.held, stats.refused) == (0, 0)
    assert stats.received > 300_000
    assert not raised  # nothing went wrong in the loop's callbacks
    proc.close()
    theirs.close()


async def test_an_oversized_frame_is_refused_by_its_header_and_its_body_never_read() -> None:
    proc, theirs, stats = await _pair()
    request = asyncio.ensure_future(proc.request(wire.encode(wire.GetState()), wire.VALUE_REPLY))
    await asyncio.sleep(0)
    theirs.sendall(wire.HEADER.pack(SMALL.frame_bytes + 1))  # and nothing more: never ends
    with pytest.raises(EnvProtocolError, match="frame_bytes"):
        await asyncio.wait_for(request, 5 * UNIT)
    assert (stats.held, stats.refused) == (0, 1)
    with pytest.raises(EnvProtocolError):  # never asked anything again
        await proc.request(wire.encode(wire.GetState()), wire.VALUE_REPLY)
    proc.close()
    theirs.close()


async def test_an_unasked_frame_breaks_the_exchange_and_a_late_one_is_the_timers() -> None:
    proc, theirs, _stats = await _pair()
    theirs.sendall(wire.frame(wire.encode(wire.ValueOk(1))))  # no request: unexpected
    await asyncio.sleep(0.05 * UNIT)
    assert proc.broken is not None
    assert proc.broken.context["limit"] == "unexpected"
    proc.close()
    theirs.close()
    proc, theirs, _stats = await _pair()
    request = asyncio.ensure_future(proc.request(wire.encode(wire.GetState()), wire.VALUE_REPLY))
    await asyncio.sleep(0)
    theirs.sendall(wire.HEADER.pack(100_000) + b"x" * 1000)  # a reply that never ends
    await asyncio.sleep(0.05 * UNIT)
    assert not request.done()
    proc.abort()  # the call's timer: its process killed, its call ended at once
    with pytest.raises(Gone):
        await asyncio.wait_for(request, 5 * UNIT)
    proc.close()
    theirs.close()


async def test_a_large_reply_is_checked_in_a_thread_and_a_bad_one_refused() -> None:
    proc, theirs, stats = await _pair()
    request = asyncio.ensure_future(proc.request(wire.encode(wire.GetState()), wire.VALUE_REPLY))
    await asyncio.sleep(0)
    body = wire.encode(wire.ValueOk([[]] * 500_000))  # 0.5 MB amplifying to ~32 MB
    sender = threading.Thread(target=theirs.sendall, args=(wire.frame(body),))
    sender.start()
    with pytest.raises(EnvProtocolError, match="decoded_bytes"):
        await asyncio.wait_for(request, 10 * UNIT)
    sender.join()
    assert (stats.held, stats.refused) == (0, 1)
    proc.close()
    theirs.close()


def test_blocking_reads_see_whole_frames_and_the_end_of_the_stream() -> None:
    a, b = socket.socketpair()
    body = msgspec.msgpack.encode({"observation": "y" * 300_000})
    sender = threading.Thread(target=lambda: (a.sendall(wire.frame(body)), a.close()))
    sender.start()
    assert wire.recv_frame(b) == body
    assert wire.recv_frame(b) is None
    sender.join()
    b.close()


# -- the sandbox's settings -------------------------------------------------------------


def test_the_limits_refuse_what_cannot_be_enforced() -> None:
    assert Limits() == Limits(1024, 1.0, 128, 256, 300.0, "none")
    with pytest.raises(ConfigError, match="--sandbox-memory"):
        Limits(memory_mib=1)
    with pytest.raises(ConfigError, match="--sandbox-pids"):
        Limits(pids=1)
    with pytest.raises(ConfigError, match="allowlist"):
        Limits(network="allowlist")


def test_each_session_of_a_worker_gets_its_own_unprivileged_uid(tmp_path: Path) -> None:
    lease = UidLease(str(tmp_path / "uids"), start=4242)
    uids = {lease.take() for _ in range(1000)}
    assert len(uids) == 1000
    assert min(uids) >= 1_000_000
    lease.close()


def test_the_template_sees_the_code_read_only_and_no_home() -> None:
    argv = bwrap_argv([])
    assert argv[argv.index("--") - 1] == "--new-session"
    binds = {argv[i + 1] for i, arg in enumerate(argv) if arg == "--bind"}
    assert binds == {"/sys/fs/cgroup"}  # the only writable host path; sessions unmount it
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent"):
        assert flag in argv
    assert "/root" not in {argv[i + 1] for i, arg in enumerate(argv) if arg == "--ro-bind"}


def test_an_env_that_asks_for_the_sandbox_says_why_it_cannot_have_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stadium import ServerConfig
    from stadium._server.isolation import sandbox
    from stadium._server.processes.worker import Worker

    monkeypatch.setattr(sandbox.shutil, "which", lambda _name: None)
    with pytest.raises(ConfigError, match=r"bubblewrap.*code asks for it; --isolation process"):
        Worker.build(ServerConfig(target="code"))


async def test_the_control_socket_takes_control_messages_only_and_keeps_no_descriptor() -> None:
    from stadium._server.isolation import Isolation, IsolationConfig

    iso = Isolation(IsolationConfig("process", "echo"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    loop = asyncio.get_running_loop()
    iso._control, iso._loop, iso._ready = ours, loop, loop.create_future()
    stray, other = socket.socketpair()
    before = len(os.listdir("/proc/self/fd"))
    for packet, fds in [
        (b"\xc1junk", [stray.fileno()]),  # not MessagePack, a descriptor along
        (msgspec.msgpack.encode(["exit", "not a key", 0]), []),  # ill-typed
        (msgspec.msgpack.encode(["reboot"]), []),  # unknown
        (wire.encode(wire.Spawned(7)), [stray.fileno()]),  # no spawn asked for
        (wire.encode(wire.Exit(7, 9)), [stray.fileno()]),
        (wire.encode(wire.Ready(1)), []),
    ]:
        socket.send_fds(theirs, [packet], fds)
    iso._on_control()
    assert iso.control_refused == 3
    assert iso._exits == {7: 9}
    assert iso._ready.done()
    assert iso._control is ours  # the template is not taken for gone
    assert len(os.listdir("/proc/self/fd")) == before  # every descriptor sent was closed
    for s in (ours, theirs, stray, other):
        s.close()


def test_an_env_s_error_names_a_class_and_its_message_is_bounded() -> None:
    """Hostile code in a sandbox answers a call with an error it made up: a class name
    carrying escape sequences is refused (it would reach the log and the client), and a
    message of megabytes reaches neither whole."""
    forged = wire.encode(wire.Raised("\x1b]0;owned\x07Error", "boom"))
    with pytest.raises(EnvProtocolError, match="type"):
        SMALL.decode(wire.STEP_REPLY, forged)
    with pytest.raises(EnvProtocolError, match="type"):
        SMALL.decode(wire.STEP_REPLY, wire.encode(wire.Raised("E" * 201, "boom")))
    huge = SMALL.decode(wire.STEP_REPLY, wire.encode(wire.Raised("ValueError", "x" * 3 * MIB)))
    assert isinstance(huge, wire.Raised)
    err = foreign_error(huge)
    assert type(err).__name__ == "ValueError"
    assert len(str(err)) < wire.MESSAGE_CHARS + 64
    assert str(err).endswith(f"({3 * MIB - wire.MESSAGE_CHARS} characters cut)")
    assert foreign_error(wire.Raised("KeyError", "short")).args == ("short",)


def test_a_frame_reader_reads_small_frames_whole_and_large_ones_in_pieces() -> None:
    a, b = socket.socketpair()
    small = wire.encode(wire.GetState())
    large = msgspec.msgpack.encode({"action": "z" * 300_000})
    stream = wire.frame(small) + wire.frame(large) + wire.frame(small) + wire.frame(b"")
    sender = threading.Thread(target=lambda: (a.sendall(stream), a.close()))
    sender.start()
    reader = wire.FrameReader(b)
    assert [bytes(reader.next() or b"-") for _ in range(4)] == [small, large, small, b"-"]
    assert reader.next() is None
    sender.join()
    b.close()


def test_a_frame_reader_goes_on_from_what_its_caller_read() -> None:
    a, b = socket.socketpair()
    small = wire.encode(wire.GetState())
    large = msgspec.msgpack.encode({"action": "z" * 300_000})
    stream = wire.frame(large) + wire.frame(small)
    sender = threading.Thread(target=lambda: (a.sendall(stream[2:]), a.close()))
    sender.start()
    reader = wire.FrameReader(b)
    assert bytes(reader.next(stream[:2]) or b"-") == large  # the header cut after 2 bytes
    assert bytes(reader.next() or b"-") == small
    assert reader.next() is None
    assert wire.FrameReader(b).next(b"") is None  # the caller read the end of the stream
    sender.join()
    b.close()
