"""The frames between a worker and its env processes, and the sandbox's settings: no
processes (the process-level tiers are test_isolation.py)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import msgspec
import pytest

from stadium import ConfigError
from stadium._server.isolation import Limits, wire
from stadium._server.isolation.sandbox import UidLease, bwrap_argv


def test_frames_split_anywhere_come_out_whole_and_in_order() -> None:
    bodies = [msgspec.msgpack.encode(["step", b"x" * n, {}]) for n in (0, 1, 70_000, 3)]
    stream = b"".join(wire.frame(b) for b in bodies)
    for cut in (1, 3, 4, 5, 4096, len(stream)):
        reader = wire.FrameReader()
        out: list[bytes] = []
        for i in range(0, len(stream), cut):
            out += reader.feed(stream[i : i + cut])
        assert out == bodies
        assert [wire.decode(b)[1] for b in out] == [b"x" * n for n in (0, 1, 70_000, 3)]


def test_a_frame_over_the_limit_is_refused() -> None:
    reader = wire.FrameReader()
    with pytest.raises(ValueError, match="over the"):
        reader.feed(wire.HEADER.pack(wire.MAX_FRAME + 1))


def test_blocking_reads_see_whole_frames_and_the_end_of_the_stream() -> None:
    a, b = socket.socketpair()
    body = msgspec.msgpack.encode({"observation": "y" * 300_000})
    sender = threading.Thread(target=lambda: (a.sendall(wire.frame(body)), a.close()))
    sender.start()
    assert wire.recv_frame(b) == body
    assert wire.recv_frame(b) is None
    sender.join()
    b.close()


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
    from stadium._server.worker import Worker

    monkeypatch.setattr(sandbox.shutil, "which", lambda _name: None)
    with pytest.raises(ConfigError, match=r"bubblewrap.*code asks for it; --isolation process"):
        Worker.build(ServerConfig(target="code"))
