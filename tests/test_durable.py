"""Durable sessions (``--durable``): a session whose worker is killed (``kill -9``) or
whose whole server dies is restored from the session store when its client resumes,
with its env's state, step counter and RNG; no step is lost or run twice. An env that
cannot be snapshotted is refused at start with the reason."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import websockets

import stadium
from stadium._core.resume import TOKEN_HEADER, ResumeChannel, new_session_id, new_token
from stadium._env.snapshot import _envelope
from stadium._errors import ConfigError, ResumeError
from stadium._server.durability.records import (
    INLINE_BYTES,
    RECORD_VERSION,
    Durable,
    SessionRecord,
    read_key_file,
    token_digest,
)
from stadium._server.durability.session_store import DirectoryStore
from stadium.envs.benchmark import BenchmarkEnv
from tests.conftest import UNIT, serve, wait_until
from tests.relay import relay_to

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    """``stadium serve`` in a subprocess (its own process group)."""

    def __init__(self, store: Path, *args: str, target: str = "benchmark") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "stadium", "serve", target, "--host", "127.0.0.1",
               "--port", str(self.port), "--durable", "--session-store", str(store),
               "--log-level", "warning", "--drain-timeout", "1", *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, start_new_session=True)

    def wait_healthy(self) -> None:
        import urllib.request

        deadline = time.monotonic() + 30 * UNIT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        pytest.fail("server did not come up")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "sessions"


@pytest.fixture
def shared_key(tmp_path: Path) -> str:
    """A ``--session-store-key`` file: servers sharing a store sign its records with it."""
    key = tmp_path / "store.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    return str(key)


async def test_killed_worker_sessions_continue_with_their_state(store: Path) -> None:
    server = _Server(store, "--workers", "2")
    try:
        await asyncio.to_thread(server.wait_healthy)
        async with stadium.SessionPool(server.url, size=8, max_retries=40) as pool:
            await pool.reset(seeds=range(8))
            for _ in range(3):
                before = await pool.step([{"wait_seconds": 0.0}] * 8)
            pids = [r.observation["pid"] for r in before]
            victim = pids[0]
            os.kill(victim, signal.SIGKILL)  # one worker dies mid-episode
            after = await pool.step([{"wait_seconds": 0.0}] * 8)
            assert [r.observation["step_count"] for r in after] == [4] * 8
            assert [r.observation["session_hash"] for r in after] == [
                r.observation["session_hash"] for r in before
            ]  # the same episodes, restored from their snapshots
            moved = [i for i, p in enumerate(pids) if p == victim]
            assert moved
            assert all(after[i].observation["pid"] != victim for i in moved)
            assert all(pool.clients[i].resumes == 1 for i in moved)
            again = await pool.step([{"wait_seconds": 0.0}] * 8)
            assert [r.observation["step_count"] for r in again] == [5] * 8
        # Closed sessions leave nothing in the store.
        await wait_until(lambda: not list(store.iterdir()), 10 * UNIT, "store emptied")
    finally:
        server.stop()


async def test_step_in_flight_when_the_worker_dies_runs_once(store: Path) -> None:
    server = _Server(store, "--workers", "2")
    try:
        await asyncio.to_thread(server.wait_healthy)
        async with stadium.AsyncClient(server.url, max_retries=40) as env:
            await env.reset(seed=3)
            first = await env.step({"wait_seconds": 0.0})
            step = asyncio.create_task(env.step({"wait_seconds": 2.0 * UNIT}))
            await asyncio.sleep(0.3 * UNIT)
            os.kill(first.observation["pid"], signal.SIGKILL)
            result = await step  # lost with its worker: sent again, run on the restored env
            assert result.observation["step_count"] == 2
            assert result.observation["session_hash"] == first.observation["session_hash"]
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 3
    finally:
        server.stop()


async def test_session_moves_to_another_server_sharing_the_store(
    store: Path, shared_key: str
) -> None:
    a, b = (
        _Server(store, "--session-store-key", shared_key),
        _Server(store, "--session-store-key", shared_key),
    )
    try:
        await asyncio.gather(asyncio.to_thread(a.wait_healthy), asyncio.to_thread(b.wait_healthy))
        async with relay_to(a.url) as relay:  # the "router": sends sessions to node a
            async with stadium.AsyncClient(relay.url, max_retries=40) as env:
                await env.reset(seed=7)
                for _ in range(4):
                    last = await env.step({"wait_seconds": 0.0})
                a.kill()  # node a is gone; the router now sends to node b
                relay.upstream = ("127.0.0.1", b.port)
                moved = await env.step({"wait_seconds": 0.0})
                assert moved.observation["step_count"] == 5
                assert moved.observation["session_hash"] == last.observation["session_hash"]
                assert env.resumes == 1
    finally:
        a.kill()
        b.stop()


async def test_an_env_that_cannot_be_durable_is_refused_at_start(tmp_path: Path) -> None:
    env_file = tmp_path / "locked.py"
    env_file.write_text(
        "import threading\n"
        "from stadium.envs.echo import EchoEnv\n"
        "class Locked(EchoEnv):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.guard = threading.Lock()\n"
    )
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "stadium", "serve", f"{env_file}:Locked", "--port", "0",
         "--durable", "--session-store", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "cannot be made durable" in result.stderr
    assert "guard" in result.stderr  # names the attribute that does not pickle
    assert "without --durable" in result.stderr
    assert "serving" not in result.stdout  # refused before it says it serves


async def test_durable_in_process_keeps_one_record_per_live_session(tmp_path: Path) -> None:
    store = tmp_path / "store"
    async with serve("wordguess", durable=True, session_store=str(store)) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset(seed=1)
            await env.step({"word": "apple"})
            assert env.session_id is not None
            assert [p.name for p in store.iterdir()] == [env.session_id]
        await wait_until(lambda: not list(store.iterdir()), 5 * UNIT, "record dropped")
        assert server.runtime.durable is not None
        assert server.runtime.durable.saved >= 2


async def test_a_balanced_client_moves_a_durable_session_to_a_live_node(
    store: Path, shared_key: str
) -> None:
    a, b = (
        _Server(store, "--session-store-key", shared_key),
        _Server(store, "--session-store-key", shared_key),
    )
    try:
        await asyncio.gather(asyncio.to_thread(a.wait_healthy), asyncio.to_thread(b.wait_healthy))
        async with stadium.AsyncClient([a.url, b.url], max_retries=40) as env:
            await env.reset(seed=2)
            last = await env.step({"wait_seconds": 0.0})
            victim, survivor = (a, b) if env.endpoint == a.url else (b, a)
            victim.kill()  # its node is gone: the client finds the session on the other
            moved = await env.step({"wait_seconds": 0.0})
            assert moved.observation["step_count"] == 2
            assert moved.observation["session_hash"] == last.observation["session_hash"]
            assert env.endpoint == survivor.url
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 3
    finally:
        a.kill()
        b.kill()


# -- records the server did not sign (issue 22) ------------------------------------------


class _Plant:
    """What an attacker pickles: unpickling it creates ``marker`` (proof the pickle ran)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


async def _resume_reply(url: str, sid: str, token: str) -> dict[str, Any]:
    ws_url = url.replace("http", "ws") + f"/ws?stadium_resume={sid}&stadium_received=0"
    async with websockets.connect(ws_url, additional_headers={TOKEN_HEADER: token}) as ws:
        reply: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
        return reply


def _planted(sid: str, token: str, marker: Path) -> SessionRecord:
    envelope = _envelope(BenchmarkEnv, False)[0]  # the class the server restores: checked
    blob = envelope + pickle.dumps(_Plant(str(marker)))
    return SessionRecord(
        RECORD_VERSION, sid, token_digest(token), "json", blob, "ep", 3, True, 4, []
    )


async def test_a_planted_record_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    """Whoever can write the store plants a record under an id and token of his choosing
    (as the server wrote them before records were signed) and resumes it: refused, and
    its pickle never runs."""
    store_dir, marker = tmp_path / "store", tmp_path / "the-pickle-ran"
    async with serve("benchmark", durable=True, session_store=str(store_dir)) as server:
        sid, token = new_session_id(1), new_token()  # pid 1: not one of this server's workers
        record = _planted(sid, token, marker)
        DirectoryStore(store_dir).put(sid, msgspec.msgpack.encode(record))
        reply = await _resume_reply(server.url, sid, token)
        await asyncio.sleep(0.2 * UNIT)  # a restore would have run by now
        assert not marker.exists(), "the planted pickle ran"
        assert reply["type"] == "error"
        assert reply["data"]["code"] == "RESUME_FAILED"
        assert "not one this server signed" in reply["data"]["message"]
        assert str(store_dir) not in reply["data"]["message"]
        durable = server.runtime.durable
        assert durable is not None
        assert durable.refused == 1
        # Signed with another key (another server's, or a guessed one): refused the same way.
        other = Durable(DirectoryStore(store_dir), key=os.urandom(32))
        assert not other.save(record)  # written at once
        assert other.saved == 1
        reply = await _resume_reply(server.url, sid, token)
        assert reply["data"]["code"] == "RESUME_FAILED"
        assert durable.refused == 2
        assert not marker.exists()


async def test_an_altered_or_moved_record_is_refused(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "store")
    durable = Durable(store, key=os.urandom(32))
    sid, token = new_session_id(1), new_token()
    record = _planted(sid, token, tmp_path / "marker")
    durable.save(record)
    assert durable.saved == 1
    good = durable.load(sid, token)
    assert isinstance(good, SessionRecord)  # the server's own record reads back
    raw = store.get(sid)
    assert raw is not None
    altered = bytearray(raw)
    altered[-1] ^= 1
    store.put(sid, bytes(altered))
    refused = durable.load(sid, token)
    assert isinstance(refused, ResumeError)
    assert "not one this server signed" in str(refused)
    other = new_session_id(1)  # the signature covers the id: a record cannot change names
    store.put(other, raw)
    assert isinstance(durable.load(other, token), ResumeError)
    assert durable.refused == 2
    assert not (tmp_path / "marker").exists()


async def test_store_errors_sent_to_clients_carry_no_paths(tmp_path: Path) -> None:
    store_dir = tmp_path / "a-secret-server-path"
    store = DirectoryStore(store_dir)
    durable = Durable(store)
    sid = new_session_id(1)
    (store_dir / sid).mkdir()  # reading the entry fails with an OSError naming its path
    error = durable.load(sid, new_token())
    assert isinstance(error, ResumeError)
    assert "could not be read" in str(error)
    assert "a-secret-server-path" not in str(error)


async def test_key_files_must_be_the_servers_own_and_private(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    assert read_key_file(str(key)) == key.read_bytes()
    key.chmod(0o640)
    with pytest.raises(ConfigError, match="readable or writable by others"):
        read_key_file(str(key))
    key.chmod(0o600)
    short = tmp_path / "short"
    short.write_bytes(b"x" * 8)
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="fewer than 32"):
        read_key_file(str(short))
    if os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    os.chown(key, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        read_key_file(str(key))


async def test_a_record_above_the_bound_ends_durability_not_the_worker(tmp_path: Path) -> None:
    """A session whose state outgrows the record bound stops being durable (logged); the
    others go on, and the session itself keeps being served."""
    async with serve("benchmark", durable=True, session_store=str(tmp_path / "s")) as server:
        durable = server.runtime.durable
        assert durable is not None
        durable.max_record_bytes = 4096
        async with stadium.AsyncClient(server.url) as env:
            await env.reset(seed=1)
            assert list((tmp_path / "s").iterdir())  # its record is written
            saved = durable.saved
            await env.reset(seed=1, options={"state_kb": 64})  # 64 KiB of state: too big
            assert durable.saved == saved  # not written: above the bound
            assert list((tmp_path / "s").iterdir()) == []  # and its old record dropped
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 1
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 2


class _GatedStore:
    """A store whose writes of large records wait for ``gate`` (a slow disk, a big state)."""

    def __init__(self, inner: DirectoryStore) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: set[str] = set()

    def put(self, key: str, data: bytes) -> None:
        if len(data) > INLINE_BYTES:
            self.threads.add(threading.current_thread().name)
            self.entered.set()
            assert self.gate.wait(5 * UNIT), "the gate was never opened"
        self.inner.put(key, data)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def keys(self) -> Iterator[str]:
        return self.inner.keys()

    def sweep(self, older_than_s: float) -> int:
        return self.inner.sweep(older_than_s)


async def test_a_large_record_is_written_off_the_event_loop(tmp_path: Path) -> None:
    """While one session's large record is being written, the worker serves its other
    sessions; that session's reply waits for its record, then comes."""
    async with serve("benchmark", durable=True, session_store=str(tmp_path / "s")) as server:
        durable = server.runtime.durable
        assert durable is not None
        assert isinstance(durable.store, DirectoryStore)
        gated = durable.store = _GatedStore(durable.store)
        async with stadium.AsyncClient(server.url) as big, stadium.AsyncClient(server.url) as small:
            await big.reset(seed=1)
            await small.reset(seed=2)
            grow = asyncio.create_task(big.reset(seed=1, options={"state_kb": 1024}))
            assert await asyncio.to_thread(gated.entered.wait, 10 * UNIT)
            for i in range(3):  # its write is held: the other session goes on meanwhile
                reply = await asyncio.wait_for(small.step({"wait_seconds": 0.0}), 10 * UNIT)
                assert reply.observation["step_count"] == i + 1
            assert not grow.done()  # its reply waits for its record
            gated.gate.set()
            await asyncio.wait_for(grow, 10 * UNIT)
            assert gated.threads
            assert all(t.startswith("stadium-store") for t in gated.threads)
            book = big._protocol.book  # the session's resume book: its id and current token
            assert book is not None
            sid, token = book.session_id, book.token
            assert sid is not None
            record = durable.load(sid, token)
            assert isinstance(record, SessionRecord)
            assert len(record.env) > 1024 * 1024  # the large state is what was written
            assert (await big.step({"wait_seconds": 0.0})).observation["step_count"] == 1
        await wait_until(lambda: not list((tmp_path / "s").iterdir()), 5 * UNIT, "records gone")


@pytest.mark.slow
async def test_a_refused_store_or_key_stops_the_server_before_its_workers_start(
    tmp_path: Path,
) -> None:
    """Refused once at start, with the reason (not by every worker, restarted forever)."""
    group = tmp_path / "group-writable"
    group.mkdir()
    group.chmod(0o770)
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 8)
    short.chmod(0o600)
    for args, says in (
        (["--session-store", str(group)], "writable by its group"),
        (["--session-store-key", str(short)], "fewer than 32"),
    ):
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "stadium", "serve", "benchmark", "--port", "0",
             "--workers", "2", "--durable", *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert says in result.stderr
        assert "worker" not in result.stderr  # no worker was started


class _Target:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed: tuple[int, str] | None = None

    def send(self, data: bytes) -> None:
        assert self.closed is None, "sent after close"
        self.sent.append(data)

    def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


async def test_replies_wait_for_their_record_in_order_and_the_close_after_them() -> None:
    target = _Target()
    channel = ResumeChannel(target)
    deferred = {b"a", b"c"}  # a and c have records written off the loop; b does not
    channel.persist = lambda frame: frame in deferred
    for frame in (b"a", b"b", b"c"):
        channel.send(frame)
    assert target.sent == []  # b waits behind a
    channel.close(1000, "done")
    assert target.closed is None  # the close waits behind the replies
    channel.written(1)
    assert target.sent == [b"a", b"b"]
    channel.written(3)
    assert target.sent == [b"a", b"b", b"c"]
    assert target.closed == (1000, "done")
    # Detached meanwhile: the replies stay for the replay, nothing goes to the old connection.
    other = _Target()
    channel = ResumeChannel(other)
    channel.persist = lambda frame: True
    channel.send(b"x")
    channel.detach()
    channel.written(1)
    assert other.sent == []
    assert channel.replay(0) == [b"x"]
