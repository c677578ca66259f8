"""How the Lua scripts are called: one connection per script, concurrent calls pipelined."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis
from local_redis import RedisServer
from redis.asyncio import Redis
from support import async_test

from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.connection import connect_url
from scrapy_redis_throttle.one_node import parse_reply, script_args
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.redis_schema import bucket_key
from scrapy_redis_throttle.replies import AcquireResult
from scrapy_redis_throttle.scripts import LuaScript, lua_script

LIMIT = Limit(rate=10, burst=50, text="10/s (burst 50)")
KEY = bucket_key("ns", "shop.example")


def throttle_connections(server: RedisServer) -> int:
    """The connections open to *server*, a server of the test's own (another test's clients,
    such as scrapy-redis's, which never closes its own, may outlive that test)."""
    with server.client() as client:
        return sum(1 for c in client.client_list() if c["cmd"] != "client|list")


@asynccontextmanager
async def token_bucket_script(server: RedisServer) -> AsyncIterator[LuaScript]:
    client = connect_url(server.url, {}, 1)
    script = lua_script(client, "token_bucket.lua")
    assert isinstance(script, LuaScript)
    try:
        yield script
    finally:
        await script.aclose()
        await client.aclose()


async def call_together(script: LuaScript, calls: list[list[bytes]]) -> list[Any]:
    """Start every call in the same turn of the loop; return each one's reply or exception."""
    return list(
        await asyncio.gather(*(script([KEY], args) for args in calls), return_exceptions=True)
    )


@async_test
async def test_concurrent_calls_share_one_connection_and_keep_their_order(
    own_redis: RedisServer,
) -> None:
    # A token back in 100 s: the calls may run spread over the loop's turns (a busy machine
    # split their pipeline, 22 ms apart), none refills the bucket measurably.
    limit = Limit(rate=0.01, burst=50, text="1/100s (burst 50)")
    async with token_bucket_script(own_redis) as script:
        replies = await call_together(script, [script_args(limit, 1)] * 60)
        assert throttle_connections(own_redis) == 1
        results = [parse_reply(reply, limit) for reply in replies]
        # In the order they were made: the burst of 50 first, then 10 refused (no reserve).
        assert [r.allowed for r in results] == [True] * 50 + [False] * 10
        assert [r.tokens_left for r in results[:50]] == pytest.approx(
            [49 - n for n in range(50)], abs=0.1
        )


@async_test
async def test_a_call_that_fails_fails_alone(redis_server: RedisServer) -> None:
    async with token_bucket_script(redis_server) as script:
        bad = [b"100000", b"1", b"2"]  # cost 2 > burst 1
        replies = await call_together(script, [script_args(LIMIT, 1), bad, script_args(LIMIT, 1)])
        assert isinstance(replies[1], redis.ResponseError)
        assert "cost 2 exceeds burst 1" in str(replies[1])
        assert [parse_reply(replies[n], LIMIT).allowed for n in (0, 2)] == [True, True]


@async_test
async def test_a_script_lost_by_redis_is_loaded_again(redis_server: RedisServer) -> None:
    async with token_bucket_script(redis_server) as script:
        await script([KEY], script_args(LIMIT, 1))
        with redis_server.client() as admin:
            admin.script_flush()
        replies = await call_together(script, [script_args(LIMIT, 1)] * 5)
        assert [parse_reply(r, LIMIT).allowed for r in replies] == [True] * 5
        with redis_server.client() as admin:
            assert admin.get(KEY) is not None


@async_test
async def test_a_lost_connection_fails_its_call_and_the_next_batch_reconnects(
    own_redis: RedisServer,
) -> None:
    client = connect_url(own_redis.url, {"socket_timeout": 1.0}, 1)
    bucket = TokenBucket(client, "ns")
    try:
        assert (await bucket.acquire("shop.example", LIMIT)).allowed
        own_redis.restart()  # the script's connection is now dead
        first, *then = await asyncio.gather(
            *(bucket.acquire("shop.example", LIMIT) for _ in range(3)), return_exceptions=True
        )
        assert isinstance(first, redis.ConnectionError), first
        # Made while the first was under way, they go next, on a new connection, to a new
        # Redis that lost the script: loaded again.
        assert [r.allowed for r in then if isinstance(r, AcquireResult)] == [True, True], then
    finally:
        await bucket.aclose()
        await client.aclose()


@async_test
async def test_a_connection_failing_in_a_way_redis_py_does_not_wrap_is_a_connection_error(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.13's asyncio raised AttributeError writing to a transport a reset had closed,
    through redis-py unwrapped: the request that made the call failed (the breaker, which
    hears only of Redis's errors, never did). It is a ConnectionError, and the next call gets a
    new connection. (The failure is injected: a reset at that instant cannot be made on
    purpose.)"""
    async with token_bucket_script(redis_server) as script:
        await script([KEY], script_args(LIMIT, 1))
        connection = script._connection

        async def closed_transport(*args: object, **kwargs: object) -> None:
            raise AttributeError("'NoneType' object has no attribute '_add_writer'")

        monkeypatch.setattr(connection, "send_packed_command", closed_transport)
        with pytest.raises(redis.ConnectionError, match="AttributeError: 'NoneType'"):
            await script([KEY], script_args(LIMIT, 1))
        assert not connection.is_connected, "disconnected: in no known state"
        monkeypatch.undo()
        assert (await script([KEY], script_args(LIMIT, 1)))[0] in (1, 2), "the next call reconnects"


@async_test
async def test_a_cancelled_call_leaves_the_others_of_its_batch_alone(
    redis_server: RedisServer,
) -> None:
    async with token_bucket_script(redis_server) as script:
        calls = [asyncio.ensure_future(script([KEY], script_args(LIMIT, 1))) for _ in range(3)]
        await asyncio.sleep(0)  # queued, not yet answered
        calls[1].cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        assert calls[1].cancelled()
        assert [parse_reply(calls[n].result(), LIMIT).allowed for n in (0, 2)] == [True, True]


@async_test
async def test_bucket_state_is_one_integer(redis_server: RedisServer) -> None:
    """An integer is stored inside the key's own object: less memory per domain (bench/scale.py)."""
    client = Redis.from_url(redis_server.url)
    bucket = TokenBucket(client, "ns")
    await bucket.acquire("shop.example", LIMIT)
    await bucket.aclose()
    await client.aclose()
    with redis_server.client() as admin:
        assert admin.object("encoding", KEY) == b"int"
        assert 0 < admin.pttl(KEY) <= 100, "full again after one token: 0.1 s"


@async_test
async def test_closing_cancels_the_calls_still_waiting(redis_server: RedisServer) -> None:
    async with token_bucket_script(redis_server) as script:
        calls = [asyncio.ensure_future(script([KEY], script_args(LIMIT, 1))) for _ in range(3)]
        await asyncio.sleep(0)  # queued
        await script.aclose()  # once more on the way out: closing twice is harmless
        await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=5)
        # The first went at once and ended either way (answered, or its connection closed
        # under it); the others were waiting for it, and waited no more.
        assert not calls[0].cancelled()
        assert all(call.cancelled() for call in calls[1:])
