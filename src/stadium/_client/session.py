"""Clients: :class:`AsyncClient`, :class:`Client` (sync) and :class:`SessionPool`.

One client object is one session (one WebSocket). They speak OpenEnv's wire
protocol, so they work against OpenEnv servers too::

    async with stadium.AsyncClient("http://127.0.0.1:8000") as env:
        first = await env.reset(seed=1)
        result = await env.step({"message": "hi"})

    with stadium.Client("http://127.0.0.1:8000") as env:
        env.reset()
        env.step({"message": "hi"})

The frames are the core's: each client drives a sans-I/O
:class:`~stadium._core.client.ClientProtocol` (requests to frames, frames to results or
errors, the resume book), and does the I/O around it.

Requests may be issued concurrently on one session: they are sent at once
(pipelined) and answered in order. A session refused with ``CAPACITY_REACHED``
before it did any work is retried with backoff, honouring ``retry_after_s`` (at most
``connect_timeout``). A server that answers what no request asked, or opens another
WebSocket than the one offered, gets the session dropped (tests/test_client_hostile.py).

Several nodes: give a list of URLs, a deployment file (``stadium slurm`` writes one)
or a URL whose host name resolves to several addresses (a Kubernetes headless
Service) and each session opens on the node with the most room, one hop, no proxy
(:mod:`stadium._client.balance`)::

    async with stadium.SessionPool(["http://node1:8000", "http://node2:8000"], 512) as pool:
        ...

A refused or timed-out connect, or ``CAPACITY_REACHED``, moves the opening session to
another node; ``client.url`` is the node it landed on. A session lost mid-episode is
not moved (its episode lived on that node): it fails as with one server.

Servers started with a bearer token want ``token=`` (sent as ``Authorization:
Bearer``; by default the ``STADIUM_AUTH_TOKEN`` environment variable). TLS
servers are reached with ``https://`` or ``wss://`` URLs; ``ssl=`` takes an
``ssl.SSLContext`` (e.g. one trusting a self-signed certificate).
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar, cast

import msgspec
from picows import WSCloseCode, WSError, WSHandshakeError, WSMsgType, WSTransport

from stadium._client.balance import (
    Balancer,
    Endpoint,
    EndpointSpec,
    Lease,
    balancer_for,
    is_plain,
    is_url,
    static_urls,
)
from stadium._client.options import (
    TOKEN_ENV,
    ConnectOptions,
    backoff,
    refusal_wait,
    refused,
    unnegotiated,
    unreachable,
    untrusted,
    with_query,
)
from stadium._client.replies import Listener, answered_before_closing
from stadium._core.client import NO_DATA, ClientProtocol, reset_data, state_result, step_result
from stadium._core.frames import Reply
from stadium._core.protocol import MSGPACK_SUBPROTOCOL
from stadium._core.resume import ResumeAsk, ResumeBook, grace_from
from stadium._core.urls import ws_url
from stadium._env.contract import StepResult
from stadium._errors import (
    CapacityError,
    ConnectError,
    ResumeError,
    SessionClosedError,
    SessionError,
    StadiumError,
)

T = TypeVar("T")
ObsT = TypeVar("ObsT")


class AsyncClient(Generic[ObsT]):
    """One session against a Stadium (or OpenEnv) server, for asyncio code.

    Args:
        url: ``http://host:port``, ``ws://host:port`` or the full ``ws://…/ws``; or
            several nodes: a list of URLs, a deployment file's path, or a URL whose
            host name resolves to several addresses — the session opens on the node
            with the most free capacity (see the module docstring). After
            :meth:`connect`, :attr:`url` is the node's session URL and
            :attr:`endpoint` its base URL.
        observation_type: convert observations to this type (msgspec/dataclass);
            by default they are plain dicts.
        state_type: likewise for ``state()``.
        msgpack: negotiate MessagePack frames (binary observations stay compact).
        connect_timeout: seconds for the TCP + WebSocket handshake.
        request_timeout: seconds to wait for each reply (``None``: no limit).
        max_retries: attempts when the server is unreachable or at capacity (with
            several nodes: rounds over them, each trying every node once).
        max_message_bytes: largest reply accepted.
        headers: extra HTTP headers of the WebSocket handshake.
        token: bearer token for a server started with one, sent as
            ``Authorization: Bearer <token>`` (unless ``headers`` has an
            ``Authorization``); default: ``$STADIUM_AUTH_TOKEN``; ``""``: none.
        ssl: TLS context for ``wss://`` (``https://``) URLs; default: the
            system's trusted certificates.
        action_encoder: turns an action into its wire value (default: dicts as
            they are; msgspec Structs, dataclasses and pydantic models to dicts).
        resume: ask the server for a resumable session (Stadium servers grant it;
            others ignore the ask): when the connection is lost, the client
            reconnects and resumes the same session, its in-flight request answered
            once; it raises only when the server's grace period is over.
        options: the connection options above as one :class:`ConnectOptions` (then
            leave their keywords out), e.g. to share them between clients.
    """

    def __init__(
        self,
        url: EndpointSpec,
        *,
        observation_type: type[ObsT] | None = None,
        state_type: Any = None,
        msgpack: bool = False,
        connect_timeout: float = 10.0,
        request_timeout: float | None = 600.0,
        max_retries: int = 8,
        max_message_bytes: int = 64 * 1024 * 1024,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        ssl: ssl_module.SSLContext | None = None,
        action_encoder: Callable[[Any], Any] | None = None,
        resume: bool = True,
        options: ConnectOptions | None = None,
    ) -> None:
        #: The connection options (the keywords above, resolved).
        self.options = ConnectOptions.given(
            options,
            msgpack=msgpack,
            connect_timeout=connect_timeout,
            request_timeout=request_timeout,
            max_retries=max_retries,
            max_message_bytes=max_message_bytes,
            headers=headers,
            token=token,
            ssl=ssl,
            resume=resume,
        )
        plain = is_plain(url)
        #: the nodes to balance over; None for one plain URL (then nothing else happens)
        self.endpoints: EndpointSpec | None = None if plain else url
        #: the session's URL: the node it landed on once a balanced session is open
        self.url = ws_url(url if isinstance(url, str) and is_url(url) else static_urls(url)[0])
        self.endpoint: str | None = None  # the base URL of a balanced session's node
        self._given_url = self.url
        self._balancer: Balancer | None = None
        self._lease: Lease | None = None
        self.action_encoder = action_encoder or _to_builtins
        self.observation_type = observation_type
        self.state_type = state_type
        self.headers = dict(self.options.headers)
        """The handshake's headers (the options' and the MessagePack subprotocol)."""
        if self.options.msgpack:
            self.headers["Sec-WebSocket-Protocol"] = MSGPACK_SUBPROTOCOL
        self._offered = next(
            (v for k, v in self.headers.items() if k.lower() == "sec-websocket-protocol"), None
        )
        """The subprotocols the handshake offers (the 101 must pick one of them, or none)."""
        self._protocol = ClientProtocol(self.options.msgpack)
        """The session's protocol: its frames, and its resume book when resumable."""
        self._msg_type = WSMsgType.BINARY if self.options.msgpack else WSMsgType.TEXT
        self._transport: WSTransport | None = None
        self._listener: Listener | None = None
        self._answered = 0
        self.resumes = 0
        """How many times the session was resumed after losing its connection."""
        self._resuming: asyncio.Task[None] | None = None
        self._chain: tuple[float, int, int] | None = None
        """Resumes since the connection was first lost with no reply since: (when lost,
        replies received then, resumes since)."""
        self._host_headers: dict[str, str] = {}
        self._connect_kwargs: dict[str, Any] = {}

    @property
    def session_id(self) -> str | None:
        """The server's id of this session, when it is resumable."""
        book = self._protocol.book
        return None if book is None else book.session_id

    # The connection options, read as attributes (as before ConnectOptions).

    @property
    def msgpack(self) -> bool:
        return self.options.msgpack

    @property
    def connect_timeout(self) -> float:
        return self.options.connect_timeout

    @property
    def request_timeout(self) -> float | None:
        return self.options.request_timeout

    @property
    def max_retries(self) -> int:
        return self.options.max_retries

    @property
    def max_message_bytes(self) -> int:
        return self.options.max_message_bytes

    @property
    def ssl(self) -> ssl_module.SSLContext | None:
        return self.options.ssl

    @property
    def resume(self) -> bool:
        return self.options.resume

    # -- connection -------------------------------------------------------------

    async def connect(self) -> AsyncClient[ObsT]:
        """Open the WebSocket (retrying with backoff while the server is unreachable)."""
        if self._transport is not None and not self._transport.is_disconnected:
            return self
        if self.endpoints is not None:
            balancer = self._balancer
            if balancer is None:
                balancer = self._balancer = balancer_for(self.endpoints, ssl=self.options.ssl)
            if not await balancer.direct():
                return await self._connect_balanced(balancer)
            self._lease = self.endpoint = None  # one node after all: the URL as given
            self.url = self._given_url
        last: Exception | None = None
        for attempt in range(self.options.max_retries + 1):
            try:
                # picows' handshake timeout covers no TCP connect: this one does
                async with asyncio.timeout(self.options.connect_timeout):
                    transport, listener = await self.options.handshake(
                        partial(Listener, None, None, self.options.max_message_bytes),
                        self._asking(self.url),
                        self.headers,
                    )
                if transport.is_disconnected and not answered_before_closing(listener):
                    # picows returns a dead transport when the peer hangs up in the handshake
                    raise ConnectionResetError("the server closed the connection in the handshake")
            except ssl_module.SSLCertVerificationError as exc:  # not transient
                raise untrusted(exc, self.url, "a session") from exc
            except (TimeoutError, OSError) as exc:
                last = exc
                if attempt < self.options.max_retries:
                    await asyncio.sleep(backoff(attempt))
                continue
            except WSHandshakeError as exc:  # an HTTP answer instead of 101: not transient
                raise refused(exc, self.url) from exc
            except Exception as exc:  # other picows handshake errors
                raise ConnectError(
                    f"cannot open a session at {self.url}: {exc}", url=self.url
                ) from exc
            if (odd := unnegotiated(transport, self._offered, self.url)) is not None:
                raise odd
            self._opened(transport, cast(Listener, listener), {})
            return self
        raise unreachable(self.url, self.options.max_retries + 1, last) from last

    async def _connect_balanced(self, balancer: Balancer) -> AsyncClient[ObsT]:
        """Open the session on the best node; a node that refuses, times out or hangs up
        is marked down and the next one tried; rounds over all nodes, with backoff between
        them, up to ``max_retries`` + 1 rounds."""
        last: Exception | None = None
        for attempt in range(self.options.max_retries + 1):
            tried: list[Endpoint] = []
            while (lease := await balancer.acquire(tried)) is not None:
                ep = lease.endpoint
                tried.append(ep)
                headers = self.headers
                kwargs: dict[str, Any] = {}
                if ep.host is not None:  # an address of a DNS name: keep the name for Host/SNI
                    headers = {"Host": f"{ep.host}:{ep.url.rsplit(':', 1)[1]}", **headers}
                    if ep.url.startswith("https"):
                        kwargs["server_hostname"] = ep.host
                try:
                    async with asyncio.timeout(self.options.connect_timeout):
                        transport, listener = await self.options.handshake(
                            partial(Listener, lease, None, self.options.max_message_bytes),
                            self._asking(ep.ws_url),
                            headers,
                            **kwargs,
                        )
                    if transport.is_disconnected and not answered_before_closing(listener):
                        raise ConnectionResetError(
                            "the server closed the connection in the handshake"
                        )
                except ssl_module.SSLCertVerificationError as exc:  # not transient
                    lease.release()
                    raise untrusted(exc, ep.ws_url, "a session") from exc
                except (TimeoutError, OSError) as exc:
                    lease.failed(repr(exc))
                    last = exc
                    continue
                except WSHandshakeError as exc:
                    answer = refused(exc, ep.ws_url)
                    if answer.context.get("status", 0) < 500:  # 401, 403...: not transient
                        lease.release()
                        raise answer from exc
                    lease.failed(str(answer))  # 502/503 (e.g. draining): another node
                    last = answer
                    continue
                except BaseException as exc:
                    lease.release()
                    if not isinstance(exc, Exception):
                        raise
                    raise ConnectError(
                        f"cannot open a session at {ep.ws_url}: {exc}", url=ep.ws_url
                    ) from exc
                if (odd := unnegotiated(transport, self._offered, ep.ws_url)) is not None:
                    lease.release(suspect=True)
                    raise odd
                self._lease, self.url, self.endpoint = lease, ep.ws_url, ep.url
                self._opened(transport, cast(Listener, listener), kwargs)
                if ep.host is not None:
                    self._host_headers = {"Host": headers["Host"]}
                return self
            if attempt < self.options.max_retries:
                await asyncio.sleep(backoff(attempt))
        raise ConnectError(
            f"cannot open a session on any of {len(balancer.endpoints)} nodes after "
            f"{self.options.max_retries + 1} rounds ({balancer.describe()}): {last}",
            url=self.url,
            endpoints=[e.url for e in balancer.endpoints],
        ) from last

    async def close(self) -> None:
        """Send ``close`` and end the session (idempotent)."""
        self._stop_resuming(SessionClosedError("the session was closed while resuming"))
        transport, self._transport = self._transport, None
        if transport is None or transport.is_disconnected:
            return
        if self._listener is not None:
            self._listener.closing = True
        try:
            transport.send(self._msg_type, self._protocol.request("close")[0])
            await asyncio.wait_for(transport.wait_disconnected(), 5.0)
        except Exception:  # no answer, or one breaking the WebSocket's rules: it is over
            transport.disconnect(graceful=False)

    async def __aenter__(self) -> AsyncClient[ObsT]:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._transport is not None and not self._transport.is_disconnected

    # -- requests ---------------------------------------------------------------

    async def reset(
        self, *, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> StepResult[ObsT]:
        """Start an episode; extra keyword arguments are reset options."""
        data = reset_data(seed, episode_id, options)
        return _raised(step_result(await self._request("reset", data, True), self.observation_type))

    async def step(self, action: Any) -> StepResult[ObsT]:
        """Apply ``action`` (a dict, msgspec Struct, dataclass or pydantic model)."""
        result = step_result(
            await self._request("step", self.action_encoder(action)), self.observation_type
        )
        if isinstance(result, StadiumError):
            raise result
        return result

    async def state(self) -> Any:
        """The session's state (a dict, or ``state_type``)."""
        return _raised(state_result(await self._request("state"), self.state_type))

    async def fork(self) -> AsyncClient[ObsT]:
        """A new session starting from this one's snapshot: the same env state, episode and
        step count, on the same server; the two go on independently (tree search, GRPO
        groups sharing a prefix). Needs a resumable session (a Stadium server). The new
        client is connected; close it as any other.
        """
        if self._protocol.book is None:
            await self.connect()
        book = self._protocol.book
        if book is None:
            raise SessionError(
                "fork needs a resumable session: this server did not grant one (not a "
                "Stadium server, or it runs with --resume-grace 0)"
            )
        forked = _raised(self._protocol.forked(await self._request("fork")))
        child: AsyncClient[ObsT] = AsyncClient(
            self.url,
            observation_type=self.observation_type,
            state_type=self.state_type,
            action_encoder=self.action_encoder,
            options=self.options,
        )
        child._protocol.book = ResumeBook(
            forked.session,
            forked.token,
            node=book.node,
            address=book.address,
            grace=grace_from(forked.grace) or book.grace,
        )
        child._connect_kwargs, child._host_headers = self._connect_kwargs, self._host_headers
        child.endpoint = self.endpoint
        detached = Listener(None, None)
        detached.book = child._protocol.book
        await child._resume_session(detached)  # attach to it as to a lost session
        if child._transport is None:
            raise detached.closed or SessionClosedError("the forked session could not be opened")
        return child

    async def _request(self, kind: str, data: Any = NO_DATA, retry_capacity: bool = False) -> Reply:
        if self._resuming is not None:  # the connection was lost: wait for the resume
            await self._resumed()
        listener = self._listener
        if not retry_capacity and listener is not None and not self.connected:
            # The session this client had is gone: a silent reconnect would start a
            # new session with no episode, so say what happened instead.
            raise listener.closed or SessionClosedError(
                "the session is closed; reset to start anew"
            )
        for attempt in range(self.options.max_retries + 1):
            await self.connect()
            try:
                reply = await self._roundtrip(kind, data)
            except CapacityError as exc:
                fresh = self._answered == 0
                if not fresh:  # a request refused (a fork with no free slot): the session goes on
                    self._answered += 1
                    raise
                lease = self._lease
                await self._drop()
                if not (retry_capacity and fresh) or attempt >= self.options.max_retries:
                    raise
                if lease is not None:  # balanced: that node is full, another may have room
                    lease.refused(exc.retry_after_s)
                    if lease.balancer.any_available():
                        continue
                await asyncio.sleep(refusal_wait(exc, self.options.connect_timeout))
                continue
            self._answered += 1
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def _roundtrip(self, kind: str, data: Any) -> Reply:
        transport, listener = self._transport, self._listener
        assert transport is not None
        assert listener is not None
        protocol = self._protocol
        rid = None
        if listener.early:
            raw = listener.early.popleft()
        else:
            if listener.closed is not None:
                raise listener.closed
            fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            listener.waiting.append(fut)
            listener.asked = True  # from now on every frame answers a request
            payload, rid = protocol.request(kind, data)  # resumable: numbered, kept
            transport.send(self._msg_type, payload)
            try:
                raw = await asyncio.wait_for(fut, self.options.request_timeout)
            except TimeoutError:
                # The reply may still come; a later request would then read it.
                # Drop the session rather than desynchronise it.
                await self._drop()
                raise SessionClosedError(
                    f"no reply within {self.options.request_timeout:g}s; the session was dropped",
                    timeout_s=self.options.request_timeout,
                ) from None
        reply = protocol.reply(raw, rid)
        if isinstance(reply, StadiumError):
            if not protocol.in_sync:
                await self._drop()
            raise reply
        return reply

    async def _drop(self) -> None:
        self._stop_resuming(SessionClosedError("the session was dropped while resuming"))
        transport, self._transport = self._transport, None
        if self._listener is not None:
            self._listener.closing = True
        if transport is not None and not transport.is_disconnected:
            transport.send_close(WSCloseCode.OK)
            transport.disconnect()

    # -- resume (see stadium._core.resume) ---------------------------------------------

    def _asking(self, url: str) -> str:
        """The URL that opens a session: asking for a resumable one when ``resume``."""
        return with_query(url, ResumeAsk(None).query()) if self.options.resume else url

    def _opened(self, transport: WSTransport, listener: Listener, kwargs: dict[str, Any]) -> None:
        """A new session is open: note whether it is resumable (the server said so)."""
        self._transport, self._listener = transport, listener
        self._answered = 0
        self._connect_kwargs = kwargs
        protocol = self._protocol
        book = protocol.granted(transport.response.headers.get) if self.options.resume else None
        protocol.book = listener.book = book
        if book is not None:
            listener.on_lost = self._lost

    def _lost(self, listener: Listener) -> None:
        """The connection of a resumable session is gone: resume it in the background;
        requests wait for it."""
        if self._resuming is None:
            loop = asyncio.get_running_loop()
            received = listener.book.received if listener.book is not None else 0
            if self._chain is None or self._chain[1] != received:  # a reply since: anew
                self._chain = (loop.time(), received, 0)
            self._resuming = loop.create_task(self._resume_session(listener))

    async def _resumed(self) -> None:
        """Wait for the resume under way, at most ``request_timeout`` (a request's wait:
        a server that says a long grace period and never takes the session back cannot
        park its requests for longer)."""
        resuming = self._resuming
        if resuming is None:
            return
        timeout = self.options.request_timeout
        try:
            await asyncio.wait_for(asyncio.shield(resuming), timeout)
        except TimeoutError:
            raise ResumeError(
                f"session {self.session_id} lost its connection and was not resumed within "
                f"{timeout:g}s (request_timeout); it is still being resumed, within the "
                "server's grace period: try again, or close it",
                session=self.session_id,
                timeout_s=timeout,
            ) from None

    def _stop_resuming(self, err: SessionClosedError) -> None:
        task, self._resuming = self._resuming, None
        if task is not None and not task.done():
            task.cancel()
            if self._listener is not None:
                self._fail_session(self._listener, err)

    async def _resume_session(self, lost: Listener) -> None:
        """Reconnect and resume until the server's grace period is over (then fail the
        session's requests with :class:`ResumeError`)."""
        try:
            await self._resume_loop(lost)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or an unforeseen error: never leave requests hanging
            self._fail_session(lost, _resume_failed(self.session_id, repr(exc)))

    async def _resume_loop(self, lost: Listener) -> None:
        loop = asyncio.get_running_loop()
        book = lost.book
        assert book is not None
        # A resume lost again before any reply goes on the first loss's clock and backoff:
        # a server that takes the session back and drops it at once cannot loop it for ever.
        since, _, attempt = self._chain or (loop.time(), 0, 0)
        deadline = book.deadline(since)
        last: BaseException | None = None
        if attempt:
            delay = backoff(attempt)
            if loop.time() + delay >= deadline:
                why = f"it was lost again after each of {attempt} resumes, with no reply"
                self._fail_session(lost, _resume_failed(book.session_id, why))
                return
            await asyncio.sleep(delay)
        while True:
            base, host_headers, kwargs = self.url, self._host_headers, self._connect_kwargs
            lease = None
            balancer = self._balancer
            if attempt % 2 == 1 and balancer is not None:
                # Every other attempt on another node: the session's may be gone for good, and
                # another node sharing its store restores a durable session.
                lease = await balancer.acquire([])
                if lease is not None:
                    ep = lease.endpoint
                    base, host_headers, kwargs = ep.ws_url, {}, {}
                    if ep.host is not None:
                        host_headers = {"Host": f"{ep.host}:{ep.url.rsplit(':', 1)[1]}"}
                        if ep.url.startswith("https"):
                            kwargs = {"server_hostname": ep.host}
            ask = book.ask()
            url = with_query(base, ask.query())
            headers = {**self.headers, **host_headers, **ask.headers()}
            try:
                async with asyncio.timeout(
                    max(0.05, min(self.options.connect_timeout, deadline - loop.time()))
                ):
                    transport, resumed = await self.options.handshake(
                        partial(Listener, lease, lost, self.options.max_message_bytes),
                        url,
                        headers,
                        **kwargs,
                    )
                    listener = cast(Listener, resumed)
                    try:
                        if (
                            listener is None
                            or listener.greeting is None
                            or transport.is_disconnected
                        ):
                            raise ConnectionResetError("the connection closed in the handshake")
                        if (odd := unnegotiated(transport, self._offered, url)) is not None:
                            raise odd
                        hello = await listener.greeting
                    except BaseException:  # no answer to the resume: never leave it open
                        transport.disconnect(graceful=False)
                        raise
            except WSHandshakeError as exc:
                answer = refused(exc, url)
                if answer.context.get("status", 0) < 500 and lease is None:  # 400, 401, 403
                    self._fail_session(lost, _resume_failed(book.session_id, str(answer)))
                    return
                last = answer
            except (TimeoutError, OSError, SessionClosedError, WSError, ConnectError) as exc:
                last = exc
            else:
                self._protocol.book = book
                back = self._protocol.resumed(hello)
                if not isinstance(back, StadiumError):
                    # A durable session restored elsewhere has a new id, node and address.
                    if lease is not None:  # on another node from now on
                        if lost.lease is not None and lost.lease is not lease:
                            lost.lease.release()
                        self._lease, self.url, self.endpoint = lease, base, lease.endpoint.url
                        self._host_headers, self._connect_kwargs = host_headers, kwargs
                    for payload in back.resend:  # lost on the way in: send again
                        transport.send(self._msg_type, payload)
                    listener.on_lost = self._lost
                    listener.adopted = True
                    self._transport, self._listener = transport, listener
                    self._resuming = None
                    self.resumes += 1
                    self._chain = (since, book.received, attempt + 1)
                    return
                transport.disconnect()
                err = back if isinstance(back, ResumeError) else None
                if err is None:
                    err = _resume_failed(book.session_id, str(back))
                if lease is None:  # the session's own node says it is gone: it is
                    self._fail_session(lost, err)
                    return
                last = err  # another node does not have it: its own may still come back
            if lease is not None and self._lease is not lease:
                lease.release()
            attempt += 1
            delay = backoff(attempt)
            if loop.time() + delay >= deadline:
                self._fail_session(
                    lost,
                    _resume_failed(
                        book.session_id,
                        f"no server took it back within its {book.grace:g} s grace "
                        f"period (last: {last!r})",
                    ),
                )
                return
            await asyncio.sleep(delay)

    def _fail_session(self, lost: Listener, err: SessionClosedError) -> None:
        """The session cannot be resumed: its requests fail with ``err``."""
        self._resuming = None
        self._transport = None
        lost.on_lost = None
        lost.closed = err
        if lost.lease is not None:
            lost.lease.release(suspect=True)
            lost.lease = None
        while lost.waiting:
            fut = lost.waiting.popleft()
            if not fut.done():
                fut.set_exception(err)


def _resume_failed(sid: str | None, why: str) -> ResumeError:
    return ResumeError(f"session {sid} could not be resumed: {why}", session=sid)


def _raised(result: T | StadiumError) -> T:
    """``result``, or the error the protocol returned in its place raised."""
    if isinstance(result, StadiumError):
        raise result
    return result


def _to_builtins(action: Any) -> Any:
    if isinstance(action, dict):
        return action
    dump = getattr(action, "model_dump", None)
    if callable(dump):
        return dump()
    return msgspec.to_builtins(action)


__all__ = ["TOKEN_ENV", "AsyncClient", "StadiumError", "ws_url"]
