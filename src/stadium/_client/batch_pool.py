"""Batched sessions for :class:`~stadium.SessionPool`: a few batch connections
(:mod:`stadium._client.batch`) carrying the pool's sessions.

:class:`BatchGroup` is what the pool drives when batching: the sessions numbered by
their index, one :class:`BatchSession` each with :class:`~stadium.AsyncClient`'s
request methods. Calls issued in the same event-loop iteration (``asyncio.gather``
over the sessions) are coalesced into one batch frame per connection.

On a server with resume (``--resume-grace`` above 0) the sessions are resumable: each
session's calls are numbered and kept until answered (its
:class:`~stadium._core.resume.ResumeBook`, as an ``AsyncClient``'s), and when a
connection is lost
its sessions are taken back on a new one (``resume`` calls), the replies they missed
answering their calls and the calls the server never got sent again, with backoff,
until the server's grace period is over (then :class:`~stadium.ResumeError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar, Unpack

from stadium._client.batch import (
    MAX_CALLS,
    NOT_RESUMABLE,
    BatchConnection,
    call,
    checked,
    result_of,
)
from stadium._client.options import ConnectKeywords, ConnectOptions, backoff, refusal_wait
from stadium._client.session import _raised, _to_builtins
from stadium._core.client import reset_data, resume_call, resumed_data, state_result
from stadium._core.frames import BatchCall, Reply
from stadium._core.resume import ResumeBook
from stadium._env.contract import StepResult
from stadium._errors import (
    CapacityError,
    ConnectError,
    ResumeError,
    SessionClosedError,
    SessionError,
    StadiumError,
)

ObsT = TypeVar("ObsT")

#: What a batch session's book keeps of a call: the call, and the future of its result.
_Call = tuple[BatchCall[Any], "asyncio.Future[Any]"]
_Book = ResumeBook[_Call]


class _Coalescer:
    """Gathers the calls made on one connection in one loop iteration into one frame;
    on a resumable connection, numbers each session's calls, keeps them until answered,
    and resumes the sessions when the connection is lost."""

    def __init__(self, group: BatchGroup[Any], conn: BatchConnection) -> None:
        self.group = group
        self.conn = conn
        self.generation = 0
        """How many times the connection was replaced (after a loss, by a ``reset``)."""
        self.replacing: asyncio.Future[None] | None = None
        self.resuming: asyncio.Future[None] | None = None
        self.calls: list[BatchCall[Any]] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.sessions: set[int] = set()
        self.scheduled = False
        self.books: dict[int, _Book] = {}
        """The resumable sessions' books, by session number (from their ``reset``)."""
        self.resumes = 0
        self.chain: tuple[float, int, int] | None = None
        """Resumes since the connection was first lost with no reply since: (when lost,
        replies received then, resumes since); see ``AsyncClient._chain``."""
        self.wire(conn)

    def wire(self, conn: BatchConnection) -> None:
        self.conn = conn
        if conn.grace > 0:
            conn.listener.on_opened = self._opened
            conn.listener.on_lost = self._lost

    def call(self, entry: BatchCall[Any]) -> asyncio.Future[Any]:
        session = entry.session
        if session in self.sessions or len(self.calls) >= MAX_CALLS:
            self.flush()  # one call per session per batch: the next goes in the next frame
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self.conn.grace > 0:
            book = self.books.get(session)
            if book is None and entry.type == "reset":
                book = self.books[session] = ResumeBook(grace=self.conn.grace)
            if book is not None:  # numbered in the book only: the server answers in order
                book.keep(book.number(), (entry, fut))
        self.calls.append(entry)
        self.futures.append(fut)
        self.sessions.add(session)
        if not self.scheduled:
            self.scheduled = True
            loop.call_soon(self._tick)
        return fut

    def call_all(self, entries: list[BatchCall[Any]]) -> list[asyncio.Future[Any]]:
        """:meth:`call` for each of ``entries`` (steps of distinct sessions, none of them
        gathered yet: :meth:`BatchGroup.step_all`), with the per-call lookups done once."""
        numbers = [e.session for e in entries]
        if self.calls and not self.sessions.isdisjoint(numbers):
            self.flush()
        if len(self.calls) + len(entries) > MAX_CALLS:
            return [self.call(e) for e in entries]
        create = asyncio.get_running_loop().create_future
        futures = [create() for _ in entries]
        books = self.books if self.conn.grace > 0 else None
        if books:
            get = books.get
            for number, entry, fut in zip(numbers, entries, futures, strict=True):
                book = get(number)
                if book is not None:
                    book.keep_next((entry, fut))
        self.calls.extend(entries)
        self.futures.extend(futures)
        self.sessions.update(numbers)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._tick)
        return futures

    def _tick(self) -> None:
        self.scheduled = False
        self.flush()

    def flush(self) -> None:
        if self.resuming is not None:  # held: sent once the sessions are back
            return
        calls, futures = self.calls, self.futures
        if not calls:
            return
        self.calls, self.futures, self.sessions = [], [], set()
        self._submit(calls, futures)

    def _submit(self, calls: list[BatchCall[Any]], futures: list[asyncio.Future[Any]]) -> None:
        try:
            done = self.conn.submit(calls)
        except SessionClosedError as exc:
            if self.resuming is not None:
                return  # the resume sends them again
            for fut in futures:
                if not fut.done():
                    fut.set_exception(exc)
            return
        done.add_done_callback(partial(self._distribute, calls, futures))

    def _distribute(
        self,
        calls: list[BatchCall[Any]],
        futures: list[asyncio.Future[Any]],
        done: asyncio.Future[list[Any]],
    ) -> None:
        exc = done.exception()
        results = done.result() if exc is None else [None] * len(futures)
        books = self.books if exc is None else None
        for entry, fut, result in zip(calls, futures, results, strict=True):
            book = books.get(entry.session) if books else None
            if book is not None and book.replied_to(entry):
                kind = result.type if isinstance(result, Reply) else None
                if kind == "closed" or entry.type == "close" or book.session_id is None:
                    del self.books[entry.session]  # ended, or refused before it opened
            if fut.done():
                continue
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _opened(self, session: int, sid: str, token: str) -> None:
        book = self.books.get(session)
        if book is not None:
            book.session_id, book.token = sid, token

    def _lost(self) -> None:
        if self.resuming is None:
            received = sum(book.received for book in self.books.values())
            if self.chain is None or self.chain[1] != received:  # a reply since: anew
                self.chain = (asyncio.get_running_loop().time(), received, 0)
            self.resuming = asyncio.ensure_future(self._resume())

    async def _resume(self) -> None:
        """Take the sessions back on a new connection (docs/PROTOCOL.md, "Resumable batch
        sessions"), until the server's grace period is over; then their calls fail."""
        try:
            await self._resume_loop()
        except Exception as exc:  # never leave calls hanging
            self._give_up(ResumeError(f"the batch sessions could not be resumed: {exc!r}"))
        finally:
            self.resuming = None
            self.flush()  # the calls made meanwhile: on the new connection, or failing

    async def _resume_loop(self) -> None:
        loop = asyncio.get_running_loop()
        for number, book in list(self.books.items()):
            if book.session_id is None:  # lost while opening: it may not exist; reset it again
                del self.books[number]
                _fail(book, SessionClosedError("the session was lost while it opened"))
        if not self.books:
            return
        # lost again before any reply since the last resume: the first loss's clock and backoff
        since, _, attempt = self.chain or (loop.time(), 0, 0)
        deadline = next(iter(self.books.values())).deadline(since)
        last: BaseException | None = None
        if attempt:
            delay = backoff(attempt)
            if loop.time() + delay >= deadline:
                self._give_up(
                    ResumeError(
                        f"the batch sessions were lost again after each of {attempt} "
                        "resumes, with no reply"
                    )
                )
                return
            await asyncio.sleep(delay)
        while True:
            numbers = list(self.books)
            first = self.books[numbers[0]]
            try:
                conn = await self.group.reopen(first.session_id, first.token)
                results = await conn.batch([resume_call(n, self.books[n]) for n in numbers])
            except (ConnectError, SessionClosedError, OSError, TimeoutError) as exc:
                last = exc
                attempt += 1
                delay = backoff(attempt)
                if loop.time() + delay >= deadline:
                    self._give_up(
                        ResumeError(
                            f"the batch sessions were not taken back within the server's "
                            f"{first.grace:g} s grace period (last: {last!r})"
                        )
                    )
                    return
                await asyncio.sleep(delay)
                continue
            self.wire(conn)
            self.group.conns[self.group.coalescers.index(self)] = conn
            self.resumes += 1
            again = self._take_back(numbers, results)
            self.chain = (since, sum(b.received for b in self.books.values()), attempt + 1)
            while again:  # one call per session per frame, in each session's order
                batch: list[tuple[BatchCall[Any], asyncio.Future[Any]]] = []
                later: list[tuple[BatchCall[Any], asyncio.Future[Any]]] = []
                seen: set[int] = set()
                for entry, fut in again:
                    (later if entry.session in seen else batch).append((entry, fut))
                    seen.add(entry.session)
                self._submit([e for e, _ in batch], [f for _, f in batch])
                again = later
            return

    def _take_back(self, numbers: list[int], results: list[Any]) -> list[_Call]:
        """Each session's ``resumed`` result: its missed replies answer its calls; the
        calls the server never got are returned, to send again."""
        again: list[_Call] = []
        for number, result in zip(numbers, results, strict=True):
            book = self.books[number]
            data = resumed_data(result)
            if isinstance(data, StadiumError):
                del self.books[number]
                _fail(book, data)
                continue
            back = book.resumed(data)
            for (_entry, fut), reply in back.answered:
                if not fut.done():
                    fut.set_result(reply)
            again.extend(back.resend)
            for index, (_entry, fut) in back.owed:
                if not fut.done():  # the server got it and has no reply: cannot happen
                    fut.set_exception(ResumeError(f"the reply to call {index} was lost"))
        return again

    def _give_up(self, err: SessionClosedError) -> None:
        books, self.books = self.books, {}
        for book in books.values():
            _fail(book, err)
        self.conn.listener.closed = err


def _fail(book: _Book, err: BaseException) -> None:
    for _entry, fut in book.drain():
        if not fut.done():
            fut.set_exception(err)


class BatchSession(Generic[ObsT]):
    """One session of a :class:`BatchGroup`, with :class:`AsyncClient`'s request methods.

    Its calls go into the next batch frame of its connection. ``reset`` opens the session
    on the server when it has none (a refused admission, ``CAPACITY_REACHED``, is retried
    with backoff around ``retry_after_s``, up to ``max_retries`` times). When the connection
    is lost its sessions are gone (not resumable): their calls raise
    :class:`SessionClosedError` until a ``reset``, which opens a new connection for them.
    """

    session_id: str | None = None

    def __init__(self, group: BatchGroup[Any], number: int) -> None:
        self.group = group
        self.number = number
        self.coalescer = group.coalescers[number // group.per_connection]
        self.generation = 0  # the coalescer's connection this session's episode lives on
        self.lost: SessionClosedError | None = None

    @property
    def resumes(self) -> int:
        """How many times this session's connection was lost and its sessions resumed."""
        return self.coalescer.resumes

    @property
    def url(self) -> str:
        return self.coalescer.conn.url

    @property
    def endpoint(self) -> str | None:
        return None

    @property
    def connected(self) -> bool:
        return not self.coalescer.conn.closed

    async def _call(self, kind: str, data: Any = None, **extra: Any) -> Reply:
        coalescer = self.coalescer
        if coalescer.resuming is not None:  # the connection was lost: wait for the resume
            await asyncio.shield(coalescer.resuming)
        if kind == "reset":
            if coalescer.conn.closed:  # a new episode may start on a new connection
                await self.group.replace(coalescer)
            self.generation = coalescer.generation
        elif self.generation != coalescer.generation or coalescer.conn.closed:
            # the episode died with its connection
            why = self.lost or coalescer.conn.listener.closed
            raise SessionClosedError(
                f"{why or 'the batch connection was lost; ' + NOT_RESUMABLE}; reset to start anew"
            )
        try:
            return checked(await coalescer.call(call(self.number, kind, data, **extra)))
        except SessionClosedError as exc:
            self.lost = exc
            raise

    async def reset(
        self, *, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> StepResult[ObsT]:
        """Start an episode (opening the session if it has none); options as
        :meth:`AsyncClient.reset`."""
        data = reset_data(seed, episode_id, options)
        retries = self.group.max_retries
        for attempt in range(retries + 1):
            try:
                entry = await self._call("reset", data)
            except CapacityError as exc:
                if attempt >= retries:
                    raise
                await asyncio.sleep(refusal_wait(exc, self.group.wait_cap))
                continue
            return result_of(entry, self.group.observation_type)
        raise AssertionError("unreachable")  # pragma: no cover

    async def step(self, action: Any) -> StepResult[ObsT]:
        """Apply ``action`` (encoded as :class:`AsyncClient` encodes it)."""
        entry = await self._call("step", self.group.action_encoder(action))
        return result_of(entry, self.group.observation_type)

    async def state(self) -> Any:
        """The session's state (a dict, or ``state_type``)."""
        return _raised(state_result(await self._call("state"), self.group.state_type))

    async def close(self) -> None:
        """End the session (its number is free again; a later ``reset`` opens a new one).
        Idempotent: a session that is not open, or a lost connection, is not an error."""
        with contextlib.suppress(SessionClosedError, SessionError):
            await self._call("close")


class BatchGroup(Generic[ObsT]):
    """``size`` sessions over ``ceil(size / per_connection)`` batch connections; session
    ``i`` is number ``i`` on connection ``i // per_connection``."""

    def __init__(
        self,
        conns: Sequence[BatchConnection],
        size: int,
        per_connection: int,
        *,
        observation_type: Any = None,
        state_type: Any = None,
        action_encoder: Callable[[Any], Any] | None = None,
        max_retries: int = 8,
        opening: Callable[[], Awaitable[BatchConnection]] | None = None,
        reopening: Callable[..., Awaitable[BatchConnection]] | None = None,
        wait_cap: float = 10.0,
    ) -> None:
        self.conns = list(conns)
        self.opening = opening
        self.reopening = reopening
        self.per_connection = per_connection
        self.observation_type = observation_type
        self.state_type = state_type
        self.action_encoder = action_encoder or _to_builtins
        self.max_retries = max_retries
        self.wait_cap = wait_cap
        """The longest wait before a refused session's retry (the options' ``connect_timeout``)."""
        self.coalescers = [_Coalescer(self, c) for c in self.conns]
        self.sessions: list[BatchSession[ObsT]] = [BatchSession(self, i) for i in range(size)]

    @classmethod
    async def open(
        cls,
        url: str,
        size: int,
        per_connection: int,
        *,
        observation_type: Any = None,
        state_type: Any = None,
        action_encoder: Callable[[Any], Any] | None = None,
        options: ConnectOptions | None = None,
        **keywords: Unpack[ConnectKeywords],
    ) -> BatchGroup[ObsT] | None:
        """Open the connections; None when the server does not speak batches (the first
        connection's ``101`` did not pick the subprotocol; it is closed again).

        The connection keywords are :class:`~stadium.AsyncClient`'s, or ``options``: them
        as one :class:`ConnectOptions`. ``resume`` (default true) asks for resumable
        sessions (the server grants them when its ``--resume-grace`` is above 0).
        """
        opts = ConnectOptions.given(options, **keywords)
        opening = partial(BatchConnection.open, url, options=opts)
        # a resume: one attempt (the resume loop retries, within the grace period)
        reopening = partial(
            BatchConnection.open, url, options=dataclasses.replace(opts, max_retries=0)
        )
        if opts.resume:
            opening = partial(opening, resume="1")
        first = await opening()
        if not first.accepted:
            await first.close()
            return None
        count = -(-size // per_connection)
        conns = [first]
        try:
            for _ in range(count - 1):  # one at a time: a few connections, no burst
                conns.append(await opening())
        except BaseException:
            await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
            raise
        return cls(
            conns,
            size,
            per_connection,
            observation_type=observation_type,
            state_type=state_type,
            action_encoder=action_encoder,
            max_retries=opts.max_retries,
            opening=opening,
            reopening=reopening,
            wait_cap=opts.connect_timeout,
        )

    async def reopen(self, sid: str | None, token: str) -> BatchConnection:
        """A connection resuming sessions, one of which is ``sid`` (``token``): it reaches
        the worker that holds them. One attempt (the resume loop retries)."""
        if self.reopening is None:
            raise SessionClosedError(f"the batch connection was lost; {NOT_RESUMABLE}")
        return await self.reopening(resume=sid, resume_token=token)

    async def replace(self, coalescer: _Coalescer) -> None:
        """A new connection for ``coalescer``'s sessions, whose connection was lost (once,
        however many of its sessions ask)."""
        if coalescer.replacing is None:
            coalescer.replacing = asyncio.ensure_future(self._replace(coalescer))
        await asyncio.shield(coalescer.replacing)

    async def _replace(self, coalescer: _Coalescer) -> None:
        try:
            if self.opening is None:
                raise coalescer.conn.listener.closed or SessionClosedError(
                    f"the batch connection was lost; {NOT_RESUMABLE}"
                )
            conn = await self.opening()
            if not conn.accepted:  # the server changed under us
                await conn.close()
                raise SessionClosedError(
                    f"the server at {conn.url} no longer speaks batches; open a new pool"
                )
            coalescer.flush()  # calls gathered for the lost connection fail with it
            self.conns[self.coalescers.index(coalescer)] = conn
            coalescer.wire(conn)
            coalescer.generation += 1
        finally:
            coalescer.replacing = None

    def step_all(self, actions: Sequence[Any]) -> list[asyncio.Future[Any]] | None:
        """A ``step`` call for every session (``actions[i]`` for session ``i``), put in
        its connection's frame and sent at once: :meth:`SessionPool.step`'s batched path,
        without a task and a coroutine per session. The futures get the result entries.
        ``None``, nothing sent, when a session cannot be stepped that way now (a resume
        under way, a lost connection, an episode that died with its connection): the
        caller steps the sessions one by one, which waits or raises as each must."""
        for c in self.coalescers:
            if c.resuming is not None or c.conn.closed:
                return None
        sessions = self.sessions
        for s in sessions:
            if s.generation != s.coalescer.generation:
                return None
        if len(actions) != len(sessions):
            raise ValueError(f"{len(sessions)} sessions, {len(actions)} actions: one each")
        encode = self.action_encoder
        per = self.per_connection
        futures: list[asyncio.Future[Any]] = []
        for i, c in enumerate(self.coalescers):  # a connection's sessions are consecutive
            futures += c.call_all(
                [
                    BatchCall("step", encode(a), session=s.number)
                    for s, a in zip(
                        sessions[i * per : (i + 1) * per],
                        actions[i * per : (i + 1) * per],
                        strict=True,
                    )
                ]
            )
        self.flush()
        return futures

    async def results(
        self, futures: Sequence[asyncio.Future[Any]], return_exceptions: bool
    ) -> list[Any]:
        """The :class:`StepResult` of each of :meth:`step_all`'s futures, in session order
        (an error entry raised as :meth:`BatchSession.step` raises it, or returned with
        ``return_exceptions``; without it the first failure, in session order, is raised
        once every result is in)."""
        try:
            for fut in futures:  # a frame's results all come at once: one wait per frame
                if not fut.done():
                    await asyncio.wait((fut,))
        except asyncio.CancelledError:  # as gather cancels its steps: nobody reads these
            for fut in futures:
                fut.cancel()
            raise
        out: list[Any] = []
        failed: BaseException | None = None
        obs_type = self.observation_type
        for session, fut in zip(self.sessions, futures, strict=True):
            try:
                entry = fut.result()
                out.append(result_of(entry, obs_type))  # raises what an error stands for
            except Exception as exc:
                if isinstance(exc, SessionClosedError):
                    session.lost = exc
                out.append(exc)
                if failed is None:
                    failed = exc
        if failed is not None and not return_exceptions:
            raise failed
        return out

    def flush(self) -> None:
        """Send the calls gathered so far now (before a frame sent directly)."""
        for c in self.coalescers:
            c.flush()

    async def close(self) -> None:
        """Close every session (one batch frame per connection), then the connections."""
        await asyncio.gather(
            *(s.close() for s in self.sessions if s.connected), return_exceptions=True
        )
        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)


__all__ = ["BatchGroup", "BatchSession"]
