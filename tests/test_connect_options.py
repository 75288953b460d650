"""One ConnectOptions for every client, against a real server with ``--auth-token``:
an AsyncClient, its fork and a batched SessionPool all connect with the same object
(the token in it is what lets them in), and the keywords still work as before."""

from __future__ import annotations

from typing import Any

import pytest

import stadium
from stadium._client.batch import BatchConnection
from tests.conftest import serve

TOKEN = "options-token-0123456789"


async def test_one_options_object_opens_a_client_its_fork_and_a_batched_pool() -> None:
    opts = stadium.ConnectOptions.create(token=TOKEN, request_timeout=30.0, msgpack=True)
    async with serve("wordguess", auth_token=TOKEN) as server:
        async with stadium.AsyncClient(server.url, options=opts) as parent:
            await parent.reset(seed=5)
            await parent.step({"word": "crane"})
            child = await parent.fork()
            try:
                assert child.options is opts  # handed on as it is, not copied keyword by keyword
                assert child.headers == parent.headers  # the token, the MessagePack subprotocol
                result = await child.step({"word": "plant"})
                assert result.observation["guesses"] == ["crane", "plant"]
            finally:
                await child.close()
        async with stadium.SessionPool(server.url, 4, batch=True, options=opts) as pool:
            assert pool.batching
            firsts = await pool.reset(seeds=range(4))
            assert len(firsts) == 4
        conn = await BatchConnection.open(server.url, options=opts)
        try:
            assert conn.accepted
            assert conn.msgpack
        finally:
            await conn.close()


async def test_a_pool_of_single_connections_shares_one_options_object() -> None:
    async with serve("echo", auth_token=TOKEN) as server:
        pool: stadium.SessionPool[Any] = stadium.SessionPool(
            server.url, 3, batch=False, token=TOKEN, request_timeout=30.0
        )
        async with pool:
            assert {id(c.options) for c in pool.clients} == {id(pool.options)}  # type: ignore[union-attr]
            assert pool.options.request_timeout == 30.0
            assert len(await pool.reset()) == 3


async def test_without_the_token_every_client_is_refused_the_same_way() -> None:
    bare = stadium.ConnectOptions.create(token="", max_retries=0)
    async with serve("echo", auth_token=TOKEN) as server:
        opens: list[Any] = [
            stadium.AsyncClient(server.url, options=bare).connect(),
            BatchConnection.open(server.url, options=bare),
            stadium.SessionPool(server.url, 2, batch=True, options=bare).open(),
        ]
        for opening in opens:
            with pytest.raises(stadium.ConnectError, match="requires a bearer token") as info:
                await opening
            assert info.value.context["status"] == 401
        # The keywords, as before: the same options.
        async with stadium.AsyncClient(server.url, token=TOKEN, max_retries=0) as env:
            assert env.options == stadium.ConnectOptions.create(token=TOKEN, max_retries=0)
            await env.reset()
