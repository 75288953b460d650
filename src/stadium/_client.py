"""Clients: :class:`AsyncClient`, :class:`Client` (sync) and :class:`SessionPool`.

One client object is one session (one WebSocket). They speak OpenEnv's wire
protocol, so they work against OpenEnv servers too::

    async with stadium.AsyncClient("http://127.0.0.1:8000") as env:
        first = await env.reset(seed=1)
        result = await env.step({"message": "hi"})

    with stadium.Client("http://127.0.0.1:8000") as env:
        env.reset()
        env.step({"message": "hi"})

Requests may be issued concurrently on one session: they are sent at once
(pipelined) and answered in order. A session refused with ``CAPACITY_REACHED``
before it did any work is retried with backoff, honouring ``retry_after_s``.

Several nodes: give a list of URLs, a deployment file (``stadium slurm`` writes one)
or a URL whose host name resolves to several addresses (a Kubernetes headless
Service) and each session opens on the node with the most room, one hop, no proxy
(:mod:`stadium._balance`)::

    async with stadium.SessionPool(["http://node1:8000", "http://node2:8000"], 512) as pool:
        ...

A refused or timed-out connect, or ``CAPACITY_REACHED``, moves the opening session to
another node; ``client.url`` is the node it landed on. A session lost mid-episode is
not moved (its episode lived on that node): it fails as with one server.

Servers started with ``--auth-token`` want ``token=`` (sent as ``Authorization:
Bearer``; by default the ``STADIUM_AUTH_TOKEN`` environment variable). TLS
servers are reached with ``https://`` or ``wss://`` URLs; ``ssl=`` takes an
``ssl.SSLContext`` (e.g. one trusting a self-signed certificate).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import ssl as ssl_module
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar, cast

import msgspec
from picows import (
    WSCloseCode,
    WSFrame,
    WSHandshakeError,
    WSListener,
    WSMsgType,
    WSTransport,
    ws_connect,
)

from stadium._balance import (
    Balancer,
    Endpoint,
    EndpointSpec,
    Lease,
    balancer_for,
    is_plain,
    is_url,
    static_urls,
)
from stadium._env import StepResult
from stadium._errors import (
    CapacityError,
    ConnectError,
    SessionClosedError,
    StadiumError,
    error_from_wire,
)
from stadium._protocol import MSGPACK_SUBPROTOCOL
from stadium._urls import ws_url

T = TypeVar("T")
ObsT = TypeVar("ObsT")

#: The environment variable a client reads its bearer token from when given none
#: (the same one ``stadium serve`` reads).
TOKEN_ENV = "STADIUM_AUTH_TOKEN"


class _Listener(WSListener):
    """Routes reply frames to the waiting futures, in order."""

    def __init__(self, lease: Lease | None = None) -> None:
        self.waiting: collections.deque[asyncio.Future[bytes]] = collections.deque()
        self.early: collections.deque[bytes] = collections.deque()
        self.closed: SessionClosedError | None = None
        self.lease = lease  # balanced sessions: the node's slot, released on disconnect
        self.closing = False  # the client ended the session

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        mtype = frame.msg_type
        if mtype == WSMsgType.TEXT or mtype == WSMsgType.BINARY:
            data = frame.get_payload_as_bytes()
            if self.waiting:
                fut = self.waiting.popleft()
                if not fut.done():
                    fut.set_result(data)
            else:
                self.early.append(data)  # e.g. a capacity refusal before any request
        elif mtype == WSMsgType.CLOSE:
            code = frame.get_close_code()
            reason = frame.get_close_message() or b""
            self.closed = SessionClosedError(
                f"server closed the session ({code.value}: {reason.decode(errors='replace')})",
                close_code=code.value,
            )
            transport.send_close(code)
            transport.disconnect()

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        if self.lease is not None:  # lost without a close frame, or the node going away
            code = None if self.closed is None else self.closed.context.get("close_code")
            self.lease.release(suspect=not self.closing and code in (None, 1001, 1011, 1012))
        err = self.closed or SessionClosedError("connection lost")
        self.closed = err
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(err)


def _answered_before_closing(listener: WSListener | None) -> bool:
    """Whether a session closed at once still said why (e.g. a capacity refusal and 1013:
    the frames are kept for the first request to read)."""
    if not isinstance(listener, _Listener):
        return False
    closed = listener.closed
    return bool(listener.early) or (closed is not None and "close_code" in closed.context)


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
        token: bearer token for a server started with ``--auth-token``, sent as
            ``Authorization: Bearer <token>`` (unless ``headers`` has an
            ``Authorization``); default: ``$STADIUM_AUTH_TOKEN``; ``""``: none.
        ssl: TLS context for ``wss://`` (``https://``) URLs; default: the
            system's trusted certificates.
        action_encoder: turns an action into its wire value (default: dicts as
            they are; msgspec Structs, dataclasses and pydantic models to dicts).
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
    ) -> None:
        plain = is_plain(url)
        #: the nodes to balance over; None for one plain URL (then nothing else happens)
        self.endpoints: EndpointSpec | None = None if plain else url
        #: the session's URL: the node it landed on once a balanced session is open
        self.url = ws_url(url if isinstance(url, str) and is_url(url) else static_urls(url)[0])
        self.endpoint: str | None = None  # the base URL of a balanced session's node
        self._given_url = self.url
        self._balancer: Balancer | None = None
        self._lease: Lease | None = None
        self.ssl = ssl
        self.action_encoder = action_encoder or _to_builtins
        self.observation_type = observation_type
        self.state_type = state_type
        self.msgpack = msgpack
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.max_message_bytes = max_message_bytes
        self.headers = dict(headers or {})
        if token is None:
            token = os.environ.get(TOKEN_ENV)
        if token and not any(k.lower() == "authorization" for k in self.headers):
            self.headers["Authorization"] = f"Bearer {token}"
        if msgpack:
            self.headers["Sec-WebSocket-Protocol"] = MSGPACK_SUBPROTOCOL
            self._encode: Callable[[Any], bytes] = msgspec.msgpack.encode
            self._decode: Callable[[bytes], Any] = msgspec.msgpack.decode
            self._msg_type = WSMsgType.BINARY
        else:
            self._encode = msgspec.json.encode
            self._decode = msgspec.json.decode
            self._msg_type = WSMsgType.TEXT
        self._transport: WSTransport | None = None
        self._listener: _Listener | None = None
        self._answered = 0

    # -- connection -------------------------------------------------------------

    async def connect(self) -> AsyncClient[ObsT]:
        """Open the WebSocket (retrying with backoff while the server is unreachable)."""
        if self._transport is not None and not self._transport.is_disconnected:
            return self
        if self.endpoints is not None:
            balancer = self._balancer
            if balancer is None:
                balancer = self._balancer = balancer_for(self.endpoints, ssl=self.ssl)
            if not await balancer.direct():
                return await self._connect_balanced(balancer)
            self._lease = self.endpoint = None  # one node after all: the URL as given
            self.url = self._given_url
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            try:
                async with asyncio.timeout(self.connect_timeout):  # picows' covers no TCP connect
                    transport, listener = await ws_connect(
                        _Listener,
                        self.url,
                        ssl_context=self.ssl,
                        websocket_handshake_timeout=self.connect_timeout,
                        max_frame_size=self.max_message_bytes,
                        extra_headers=self.headers or None,
                        enable_auto_ping=False,
                        # uvloop's own connect: ~15 % less client CPU per session than
                        # picows' default aiofastnet path (measured in bursts; BENCHMARKS.md)
                        use_aiofastnet=False,
                    )
                if transport.is_disconnected and not _answered_before_closing(listener):
                    # picows returns a dead transport when the peer hangs up in the handshake
                    raise ConnectionResetError("the server closed the connection in the handshake")
            except ssl_module.SSLCertVerificationError as exc:  # not transient
                raise ConnectError(
                    f"cannot open a session at {self.url}: {exc.verify_message or exc}; for a "
                    "private or self-signed certificate pass "
                    "ssl=ssl.create_default_context(cafile='cert.pem')",
                    url=self.url,
                ) from exc
            except (TimeoutError, OSError) as exc:
                last = exc
                if attempt < self.max_retries:
                    await asyncio.sleep(_backoff(attempt))
                continue
            except WSHandshakeError as exc:  # an HTTP answer instead of 101: not transient
                raise _refused(exc, self.url) from exc
            except Exception as exc:  # other picows handshake errors
                raise ConnectError(
                    f"cannot open a session at {self.url}: {exc}", url=self.url
                ) from exc
            self._transport, self._listener = transport, cast(_Listener, listener)
            self._answered = 0
            return self
        hint = ""
        if isinstance(last, ConnectionResetError) and self.url.startswith("ws://"):
            hint = " (a TLS server? use https:// or wss://)"
        raise ConnectError(
            f"cannot reach {self.url} after {self.max_retries + 1} attempts: {last}{hint}",
            url=self.url,
        ) from last

    async def _connect_balanced(self, balancer: Balancer) -> AsyncClient[ObsT]:
        """Open the session on the best node; a node that refuses, times out or hangs up
        is marked down and the next one tried; rounds over all nodes, with backoff between
        them, up to ``max_retries`` + 1 rounds."""
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
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
                    async with asyncio.timeout(self.connect_timeout):
                        transport, listener = await ws_connect(
                            partial(_Listener, lease),
                            ep.ws_url,
                            ssl_context=self.ssl,
                            websocket_handshake_timeout=self.connect_timeout,
                            max_frame_size=self.max_message_bytes,
                            extra_headers=headers or None,
                            enable_auto_ping=False,
                            use_aiofastnet=False,
                            **kwargs,
                        )
                    if transport.is_disconnected and not _answered_before_closing(listener):
                        raise ConnectionResetError(
                            "the server closed the connection in the handshake"
                        )
                except ssl_module.SSLCertVerificationError as exc:  # not transient
                    lease.release()
                    raise ConnectError(
                        f"cannot open a session at {ep.ws_url}: {exc.verify_message or exc}; "
                        "for a private or self-signed certificate pass "
                        "ssl=ssl.create_default_context(cafile='cert.pem')",
                        url=ep.ws_url,
                    ) from exc
                except (TimeoutError, OSError) as exc:
                    lease.failed(repr(exc))
                    last = exc
                    continue
                except WSHandshakeError as exc:
                    refused = _refused(exc, ep.ws_url)
                    if refused.context.get("status", 0) < 500:  # 401, 403...: not transient
                        lease.release()
                        raise refused from exc
                    lease.failed(str(refused))  # 502/503 (e.g. draining): another node
                    last = refused
                    continue
                except BaseException as exc:
                    lease.release()
                    if not isinstance(exc, Exception):
                        raise
                    raise ConnectError(
                        f"cannot open a session at {ep.ws_url}: {exc}", url=ep.ws_url
                    ) from exc
                self._transport, self._listener = transport, cast(_Listener, listener)
                self._lease, self.url, self.endpoint = lease, ep.ws_url, ep.url
                self._answered = 0
                return self
            if attempt < self.max_retries:
                await asyncio.sleep(_backoff(attempt))
        raise ConnectError(
            f"cannot open a session on any of {len(balancer.endpoints)} nodes after "
            f"{self.max_retries + 1} rounds ({balancer.describe()}): {last}",
            url=self.url,
            endpoints=[e.url for e in balancer.endpoints],
        ) from last

    async def close(self) -> None:
        """Send ``close`` and end the session (idempotent)."""
        transport, self._transport = self._transport, None
        if transport is None or transport.is_disconnected:
            return
        if self._listener is not None:
            self._listener.closing = True
        try:
            transport.send(self._msg_type, self._encode({"type": "close"}))
            await asyncio.wait_for(transport.wait_disconnected(), 5.0)
        except (TimeoutError, OSError):
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
        data: dict[str, Any] = dict(options)
        if seed is not None:
            data["seed"] = seed
        if episode_id is not None:
            data["episode_id"] = episode_id
        reply = await self._request({"type": "reset", "data": data}, retry_capacity=True)
        return self._result(reply)

    async def step(self, action: Any) -> StepResult[ObsT]:
        """Apply ``action`` (a dict, msgspec Struct, dataclass or pydantic model)."""
        reply = await self._request({"type": "step", "data": self.action_encoder(action)})
        return self._result(reply)

    async def state(self) -> Any:
        """The session's state (a dict, or ``state_type``)."""
        reply = await self._request({"type": "state"})
        data = reply.get("data", {})
        if self.state_type is not None:
            return msgspec.convert(data, self.state_type, strict=False)
        return data

    async def _request(self, message: dict[str, Any], retry_capacity: bool = False) -> Any:
        payload = self._encode(message)
        listener = self._listener
        if not retry_capacity and listener is not None and not self.connected:
            # The session this client had is gone: a silent reconnect would start a
            # new session with no episode, so say what happened instead.
            raise listener.closed or SessionClosedError(
                "the session is closed; reset to start anew"
            )
        for attempt in range(self.max_retries + 1):
            await self.connect()
            try:
                reply = await self._roundtrip(payload)
            except CapacityError as exc:
                fresh = self._answered == 0
                lease = self._lease
                await self._drop()
                if not (retry_capacity and fresh) or attempt >= self.max_retries:
                    raise
                if lease is not None:  # balanced: that node is full, another may have room
                    lease.refused(exc.retry_after_s)
                    if lease.balancer.any_available():
                        continue
                await asyncio.sleep(exc.retry_after_s * (0.5 + random.random()))
                continue
            self._answered += 1
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def _roundtrip(self, payload: bytes) -> Any:
        transport, listener = self._transport, self._listener
        assert transport is not None
        assert listener is not None
        if listener.early:
            raw = listener.early.popleft()
        else:
            if listener.closed is not None:
                raise listener.closed
            fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            listener.waiting.append(fut)
            transport.send(self._msg_type, payload)
            try:
                raw = await asyncio.wait_for(fut, self.request_timeout)
            except TimeoutError:
                # The reply may still come; a later request would then read it.
                # Drop the session rather than desynchronise it.
                await self._drop()
                raise SessionClosedError(
                    f"no reply within {self.request_timeout:g}s; the session was dropped",
                    timeout_s=self.request_timeout,
                ) from None
        reply = self._decode(raw)
        if not isinstance(reply, dict):
            raise SessionClosedError(f"server sent a non-object frame: {reply!r}")
        if reply.get("type") == "error":
            raise error_from_wire(reply.get("data"))
        return reply

    async def _drop(self) -> None:
        transport, self._transport = self._transport, None
        if self._listener is not None:
            self._listener.closing = True
        if transport is not None and not transport.is_disconnected:
            transport.send_close(WSCloseCode.OK)
            transport.disconnect()

    def _result(self, reply: dict[str, Any]) -> StepResult[ObsT]:
        data = reply.get("data") or {}
        obs = data.get("observation", {})
        if self.observation_type is not None:
            obs = msgspec.convert(obs, self.observation_type, strict=False)
        return StepResult(
            obs,
            data.get("reward"),
            bool(data.get("done", False)),
            truncated=bool(data.get("truncated", False)),
            info=data.get("info") or data.get("metadata"),
        )


def _refused(exc: WSHandshakeError, url: str) -> ConnectError:
    """A :class:`ConnectError` for an upgrade answered with an HTTP error, saying what to do."""
    response = exc.response
    status = int(response.status) if response is not None else 0
    detail = ""
    try:
        body = msgspec.json.decode(exc.raw_body or b"{}")
        if isinstance(body, dict):
            detail = str(body.get("message") or body.get("detail") or "")
    except msgspec.DecodeError:
        detail = (exc.raw_body or b"").decode(errors="replace")[:200]
    if status == 401:
        hint = (
            "the server requires a bearer token: pass token=... (or set "
            f"{TOKEN_ENV}) with the server's --auth-token"
        )
    elif status == 403:
        hint = "the server refused this client's Origin or Host header"
    else:
        hint = f"the server answered HTTP {status or '?'} instead of opening a WebSocket"
    message = f"cannot open a session at {url}: {hint}"
    return ConnectError(f"{message} ({detail})" if detail else message, url=url, status=status)


def _backoff(attempt: int) -> float:
    """Exponential backoff with full jitter: up to 0.05 · 2^attempt s, capped at 2 s."""
    return float(random.uniform(0, min(2.0, 0.05 * 2**attempt)))


def _to_builtins(action: Any) -> Any:
    if isinstance(action, dict):
        return action
    dump = getattr(action, "model_dump", None)
    if callable(dump):
        return dump()
    return msgspec.to_builtins(action)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the background loop every sync client shares; block for its result."""
    return _LoopThread.run(coro)


class _LoopThread:
    """One background event loop shared by every sync :class:`Client` in the process."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coro: Coroutine[Any, Any, T]) -> T:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="stadium-client", daemon=True
                ).start()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()


class Client(Generic[ObsT]):
    """A blocking session client; same arguments and methods as :class:`AsyncClient`.

    All sync clients of a process share one background event loop thread. ``url`` may
    name several nodes (a list, a deployment file, a DNS name for many addresses).
    """

    def __init__(self, url: EndpointSpec, **kwargs: Any) -> None:
        self._client: AsyncClient[ObsT] = AsyncClient(url, **kwargs)

    @property
    def url(self) -> str:
        """The session's URL (the node it landed on, once open)."""
        return self._client.url

    @property
    def endpoint(self) -> str | None:
        """The base URL of a balanced session's node (None for one plain URL)."""
        return self._client.endpoint

    def connect(self) -> Client[ObsT]:
        _LoopThread.run(self._client.connect())
        return self

    def close(self) -> None:
        _LoopThread.run(self._client.close())

    def __enter__(self) -> Client[ObsT]:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(
        self, *, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> StepResult[ObsT]:
        return _LoopThread.run(self._client.reset(seed=seed, episode_id=episode_id, **options))

    def step(self, action: Any) -> StepResult[ObsT]:
        return _LoopThread.run(self._client.step(action))

    def state(self) -> Any:
        return _LoopThread.run(self._client.state())


class SessionPool(Generic[ObsT]):
    """N sessions driven together, the way a trainer steps a batch of episodes.

    ``reset``/``step`` take one argument per session and return results in
    session order; a failed session raises unless ``return_exceptions=True``.

    At most ``connect_concurrency`` sessions connect at once: a server's accept
    queue is finite (``somaxconn``, 4,096 by default on Linux), and a burst
    beyond it loses SYNs that the kernel retries only after 1 s, then 3 s.

    ``url`` may name several nodes (a list of URLs, a deployment file, a DNS name for
    many addresses): the sessions spread over them by free capacity, all the pool's
    clients sharing one balancer.

    Example::

        async with SessionPool(url, size=256) as pool:
            firsts = await pool.reset(seeds=range(256))
            results = await pool.step([{"wait_seconds": 0.0}] * 256)
    """

    def __init__(
        self,
        url: EndpointSpec,
        size: int,
        *,
        connect_concurrency: int = 1024,
        **client_kwargs: Any,
    ) -> None:
        if size < 1:
            raise ValueError("a SessionPool needs at least one session")
        if connect_concurrency < 1:
            raise ValueError("connect_concurrency must be at least 1")
        self.connect_concurrency = connect_concurrency
        self.clients: list[AsyncClient[ObsT]] = [
            AsyncClient(url, **client_kwargs) for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.clients)

    async def __aenter__(self) -> SessionPool[ObsT]:
        window = asyncio.Semaphore(self.connect_concurrency)

        async def connect(client: AsyncClient[ObsT]) -> None:
            async with window:
                await client.connect()

        await self._gather(connect(c) for c in self.clients)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def reset(
        self,
        seeds: Iterable[int | None] | None = None,
        *,
        return_exceptions: bool = False,
        **options: Any,
    ) -> list[StepResult[ObsT]]:
        seed_list: Sequence[int | None] = list(seeds) if seeds is not None else [None] * len(self)
        if len(seed_list) != len(self):
            raise ValueError(f"got {len(seed_list)} seeds for {len(self)} sessions")
        return await self._gather(
            (c.reset(seed=s, **options) for c, s in zip(self.clients, seed_list, strict=True)),
            return_exceptions,
        )

    async def step(
        self, actions: Sequence[Any], *, return_exceptions: bool = False
    ) -> list[StepResult[ObsT]]:
        if len(actions) != len(self):
            raise ValueError(f"got {len(actions)} actions for {len(self)} sessions")
        return await self._gather(
            (c.step(a) for c, a in zip(self.clients, actions, strict=True)), return_exceptions
        )

    @staticmethod
    async def _gather(coros: Iterable[Awaitable[T]], return_exceptions: bool = False) -> list[T]:
        results = await asyncio.gather(*coros, return_exceptions=return_exceptions)
        return list(results)  # type: ignore[arg-type]


__all__ = ["AsyncClient", "Client", "SessionPool", "StadiumError", "run_sync", "ws_url"]
