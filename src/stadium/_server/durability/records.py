"""Durable sessions (``stadium serve --durable``): what a session writes to the store, and when.

A durable session is a resumable one (:mod:`stadium._core.resume`) whose state is also
in a :class:`~stadium._server.durability.session_store.SessionStore`: before each reply is sent, the
session writes a :class:`SessionRecord` — the env's snapshot
(:func:`~stadium._env.snapshot.snapshot_env`), the protocol's counters (episode id,
step count) and the replies a resuming client may have missed, the one being
sent included. So when the worker holding it dies (``kill -9``, OOM, a crash in
native env code) or its node does, the next resume restores the session from
its last reply, on any worker that reaches the store — after a restart, on
another worker or, with a shared directory, on another node — and the client
goes on with no step lost or run twice.

The record holds a digest of the resume token, not the token. Snapshots are pickles
(see ``snapshot``), so every record is signed: an HMAC-SHA256 over the session id and
the record, under a key only the server's processes hold (:func:`process_key`,
made at start and inherited by the forked workers; or ``--session-store-key FILE``
for a store that other servers read too: another node, a restart), and checked
before anything in it is decoded. A record the key did not sign — planted or
altered by whoever could write the store, or moved under another id — is refused
with :class:`~stadium._errors.ResumeError` and never unpickled. Errors sent to
clients never carry the store's paths (the log has the details).

Records larger than :data:`INLINE_BYTES` are encoded, signed and written in the store's
threads, off the event loop (the reply waits for its record, the other sessions do not);
smaller ones at once. A record larger than :data:`MAX_RECORD_BYTES` is not written:
the session stops being durable (logged, at most once per 10 s); taking its snapshot
on every reply would stall the worker's every session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import os
import random
import stat
from collections.abc import Callable

import msgspec

from stadium._errors import ConfigError, ResumeError
from stadium._server.durability.session_store import SessionStore
from stadium._util.throttle import ThrottledLog

log = logging.getLogger("stadium.session")

RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024 * 1024
"""The largest record written (the env's snapshot and the replies kept): above it the
session is no longer durable (see the module docstring)."""
INLINE_BYTES = 64 * 1024
"""Records with an env snapshot this size or smaller are written on the event loop
(see :meth:`Durable.save`); larger ones in the store's threads."""
WRITER_THREADS = 4
"""Threads writing large records (one session's writes stay in order)."""
KEY_BYTES = 32
"""The size of a generated key, and the least a key file must hold."""
_SIGNED = b"STSIG1"
"""What a signed record starts with, then the 32-byte HMAC, then the record."""
_MAC = hashlib.sha256().digest_size


class SessionRecord(msgspec.Struct, array_like=True):
    """One durable session, as the store keeps it (MessagePack)."""

    version: int
    sid: str
    token_digest: bytes
    encoding: str
    env: bytes
    """The env's snapshot (``snapshot.snapshot_env``)."""
    episode_id: str | None
    step_count: int
    ready: bool
    """Whether an episode is running (a reset was answered)."""
    replies: int
    """Replies made on the session, the last one included."""
    recent: list[bytes]
    """The last replies (at most ``resume.REPLAY_FRAMES``), oldest first."""
    tenant: str | None = None
    """The tenant whose session it is (``--tenants``): only its tokens restore it."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SessionRecord)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


_PROCESS_KEY: list[bytes] = []


def process_key() -> bytes:
    """This server's record key: made on the first call (``os.urandom``), in memory only;
    workers forked after it share it (``run_server`` makes it before forking)."""
    if not _PROCESS_KEY:
        _PROCESS_KEY.append(os.urandom(KEY_BYTES))
    return _PROCESS_KEY[0]


def read_key_file(path: str) -> bytes:
    """The key in ``--session-store-key`` file ``path``: owned by the server's user,
    readable by it only, at least :data:`KEY_BYTES` bytes (used whole).

    Raises:
        ConfigError: the file is unreadable, another user's, readable or writable by
            others, or too short (the message says how to make one).
    """
    make = f"make one with: head -c {KEY_BYTES} /dev/urandom > FILE && chmod 600 FILE"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"cannot read --session-store-key: {exc.strerror or exc}; {make}", path=path
        ) from None
    with open(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"--session-store-key is not a regular file; {make}", path=path)
        if info.st_uid != os.getuid():
            raise ConfigError(
                f"--session-store-key belongs to uid {info.st_uid}, not the server's "
                f"({os.getuid()}): whoever owns it can forge records; {make}",
                path=path,
            )
        if info.st_mode & 0o077:
            raise ConfigError(
                f"--session-store-key is readable or writable by others (mode "
                f"{stat.S_IMODE(info.st_mode):o}): whoever reads it can forge records; "
                "chmod 600 it",
                path=path,
            )
        key = file.read(1 << 16)
    if len(key) < KEY_BYTES:
        raise ConfigError(
            f"--session-store-key holds {len(key)} bytes, fewer than {KEY_BYTES}; {make}",
            path=path,
        )
    return key


def _mac(key: bytes, sid: str, data: bytes) -> bytes:
    mac = hmac.new(key, b"stadium-session-record\0", hashlib.sha256)
    mac.update(sid.encode())
    mac.update(b"\0")
    mac.update(data)
    return mac.digest()


_REFUSED = ThrottledLog(log, logging.WARNING)
_STORE_ERRORS = ThrottledLog(log, logging.WARNING)


class Durable:
    """A worker's durable sessions: records in ``store``, kept until the session ends."""

    def __init__(
        self,
        store: SessionStore,
        key: bytes | None = None,
        *,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ) -> None:
        self.store = store
        self._key = process_key() if key is None else key
        self.max_record_bytes = max_record_bytes
        self.saved = 0
        self.failed = 0
        self.refused = 0
        """Records read whose signature did not match (planted, altered or moved)."""
        self._sweeper: asyncio.TimerHandle | None = None
        self._writing: dict[str, _Chain] = {}
        """Sessions with a record being written off the event loop."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start_sweeping(self, older_than_s: float) -> None:
        """Remove records not written for ``older_than_s`` seconds, about every 5 minutes
        (jittered: every worker sweeps), in a thread."""
        loop = asyncio.get_running_loop()

        def sweep() -> None:
            loop.run_in_executor(None, self._sweep, older_than_s)
            self._sweeper = loop.call_later(random.uniform(240, 360), sweep)

        self._sweeper = loop.call_later(random.uniform(5, 60), sweep)

    def stop_sweeping(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _sweep(self, older_than_s: float) -> None:
        try:
            removed = self.store.sweep(older_than_s)
        except (OSError, ValueError) as exc:
            log.warning("sweeping the session store failed: %s", exc)
            return
        if removed:
            log.info("removed %d session records older than %.0f s", removed, older_than_s)

    def save(self, record: SessionRecord, written: Callable[[], None] | None = None) -> bool:
        """Write ``record`` signed (atomically, replacing the last), in order with the
        session's other writes; ``True`` when that happens off the event loop and
        ``written`` is called once it is done (failed or not: a failure is counted and
        logged), ``False`` when it was done here.

        A record of :data:`INLINE_BYTES` or less is written at once when none of its
        session's is in flight (microseconds: faster than a thread's round trip); a
        larger one in the store's thread, so that it never stalls the other sessions.
        A record made while its session's last one is being written waits for it; of
        several waiting, only the latest is written.
        """
        sid = record.sid
        chain = self._writing.get(sid)
        if chain is not None:  # the session's last record is being written: this one after
            chain.record = record
            chain.dropped = False
            if written is not None:
                chain.waiting.append(written)
            return written is not None
        if len(record.env) <= INLINE_BYTES:
            self._write(record)
            return False
        chain = self._writing[sid] = _Chain()
        self._submit(sid, chain, record, [] if written is None else [written])
        return written is not None

    def after_writes(self, sid: str, written: Callable[[], None]) -> bool:
        """Call ``written`` once the writes of session ``sid`` in flight are done; ``False``
        (and nothing called) when none is."""
        chain = self._writing.get(sid)
        if chain is None:
            return False
        chain.waiting.append(written)
        return True

    def _submit(
        self, sid: str, chain: _Chain, record: SessionRecord, done: list[Callable[[], None]]
    ) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                WRITER_THREADS, thread_name_prefix="stadium-store"
            )
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._write, record)
        future.add_done_callback(lambda _f: self._chain_next(sid, chain, done))

    def _chain_next(self, sid: str, chain: _Chain, done: list[Callable[[], None]]) -> None:
        for written in done:
            written()
        if chain.record is not None:
            record, chain.record = chain.record, None
            waiting, chain.waiting = chain.waiting, []
            self._submit(sid, chain, record, waiting)
            return
        del self._writing[sid]
        if chain.dropped:
            self._delete(sid)
        for written in chain.waiting:
            written()

    def _write(self, record: SessionRecord) -> bool:
        """Encode, sign and put ``record`` (on the event loop or in the store's thread)."""
        data = _ENCODER.encode(record)
        try:
            self.store.put(record.sid, _SIGNED + _mac(self._key, record.sid, data) + data)
        except OSError as exc:
            self.failed += 1
            log.warning("durable session %s: the store failed: %s", record.sid, exc)
            return False
        self.saved += 1
        return True

    def close(self) -> None:
        """Finish the writes in flight (the worker is stopping) and stop the thread."""
        self.stop_sweeping()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def load(self, sid: str, token: str) -> SessionRecord | ResumeError:
        """The record of session ``sid`` if ``token`` is its resume token and this server's
        key signed it (checked before anything in it is decoded)."""
        try:
            data = self.store.get(sid)
        except (OSError, ValueError) as exc:  # the details (paths) for the log only
            _STORE_ERRORS("durable session %s: reading the session store failed: %s", sid, exc)
            return ResumeError(
                f"session {sid} cannot be restored: the session store could not be read "
                "(the server's log says why); open a new session",
                session=sid,
            )
        if data is None:
            return _not_stored(sid)
        head = len(_SIGNED) + _MAC
        if (
            len(data) < head
            or not data.startswith(_SIGNED)
            or not hmac.compare_digest(data[len(_SIGNED) : head], _mac(self._key, sid, data[head:]))
        ):
            self.refused += 1
            _REFUSED(
                "durable session %s: its record in the session store is not signed with this "
                "server's key (planted, altered, or written under another key): refused, not read",
                sid,
            )
            return ResumeError(
                f"session {sid} cannot be restored: its record in the session store is not "
                "one this server signed (altered, or written under another key); open a new "
                "session",
                session=sid,
            )
        try:
            record = _DECODER.decode(data[head:])
        except msgspec.DecodeError as exc:
            log.warning("durable session %s: unreadable record: %s", sid, exc)
            return _not_stored(sid)
        if (
            record.version != RECORD_VERSION
            or record.sid != sid
            or not hmac.compare_digest(record.token_digest, token_digest(token))
        ):
            return _not_stored(sid)
        return record

    def drop(self, sid: str) -> None:
        """Forget session ``sid`` (it ended), once its writes in flight are done."""
        chain = self._writing.get(sid)
        if chain is not None:
            chain.record = None
            chain.dropped = True
            return
        self._delete(sid)

    def _delete(self, sid: str) -> None:
        try:
            self.store.delete(sid)
        except (OSError, ValueError) as exc:
            log.warning("durable session %s: deleting its record failed: %s", sid, exc)


class _Chain:
    """One session's record writes off the event loop: what waits for the one in flight."""

    __slots__ = ("dropped", "record", "waiting")

    def __init__(self) -> None:
        self.record: SessionRecord | None = None
        """The latest record made meanwhile (written next)."""
        self.waiting: list[Callable[[], None]] = []
        """Called once the next write (or, with none, the one in flight) is done."""
        self.dropped = False
        """The session ended: its record is deleted after the write in flight."""


def _not_stored(sid: str) -> ResumeError:
    return ResumeError(
        f"session {sid} cannot be resumed: no session with that id and token is held here "
        "nor in the session store (it was closed, its grace period passed, or it was never "
        "durable); open a new session",
        session=sid,
    )


__all__ = [
    "INLINE_BYTES",
    "KEY_BYTES",
    "MAX_RECORD_BYTES",
    "RECORD_VERSION",
    "Durable",
    "SessionRecord",
    "process_key",
    "read_key_file",
    "token_digest",
]
