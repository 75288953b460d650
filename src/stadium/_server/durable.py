"""Durable sessions (``stadium serve --durable``): what a session writes to the store, and when.

A durable session is a resumable one (:mod:`stadium._core.resume`) whose state is also
in a :class:`~stadium._server.store.SessionStore`: before each reply is sent, the
session writes a :class:`SessionRecord` — the env's snapshot
(:func:`~stadium._env.snapshot.snapshot_env`), the protocol's counters (episode id,
step count) and the replies a resuming client may have missed, the one being
sent included. So when the worker holding it dies (``kill -9``, OOM, a crash in
native env code) or its node does, the next resume restores the session from
its last reply, on any worker that reaches the store — after a restart, on
another worker or, with a shared directory, on another node — and the client
goes on with no step lost or run twice.

The record holds a digest of the resume token, not the token. The store must be
trusted like the server's code (snapshots are pickles, see ``snapshot``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random

import msgspec

from stadium._errors import ResumeError
from stadium._server.store import SessionStore

log = logging.getLogger("stadium.session")

RECORD_VERSION = 1


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


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SessionRecord)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Durable:
    """A worker's durable sessions: records in ``store``, kept until the session ends."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.saved = 0
        self.failed = 0
        self._sweeper: asyncio.TimerHandle | None = None

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

    def save(self, record: SessionRecord) -> bool:
        """Write ``record`` (atomically, replacing the last); ``False`` if the store failed."""
        try:
            self.store.put(record.sid, _ENCODER.encode(record))
        except OSError as exc:
            self.failed += 1
            log.warning("durable session %s: the store failed: %s", record.sid, exc)
            return False
        self.saved += 1
        return True

    def load(self, sid: str, token: str) -> SessionRecord | ResumeError:
        """The record of session ``sid`` if ``token`` is its resume token."""
        try:
            data = self.store.get(sid)
        except (OSError, ValueError) as exc:
            return ResumeError(f"session {sid}: the session store failed: {exc}", session=sid)
        if data is None:
            return _not_stored(sid)
        try:
            record = _DECODER.decode(data)
        except msgspec.DecodeError as exc:
            log.warning("durable session %s: unreadable record: %s", sid, exc)
            return _not_stored(sid)
        if record.version != RECORD_VERSION or not hmac.compare_digest(
            record.token_digest, token_digest(token)
        ):
            return _not_stored(sid)
        return record

    def drop(self, sid: str) -> None:
        """Forget session ``sid`` (it ended)."""
        try:
            self.store.delete(sid)
        except (OSError, ValueError) as exc:
            log.warning("durable session %s: deleting its record failed: %s", sid, exc)


def _not_stored(sid: str) -> ResumeError:
    return ResumeError(
        f"session {sid} cannot be resumed: no session with that id and token is held here "
        "nor in the session store (it was closed, its grace period passed, or it was never "
        "durable); open a new session",
        session=sid,
    )


__all__ = ["RECORD_VERSION", "Durable", "SessionRecord", "token_digest"]
