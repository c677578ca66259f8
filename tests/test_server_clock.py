"""Redis's clock as a worker sees it (scrapy_redis_throttle/server_clock.py), on given times:
when Redis decided a reply, by the bounds of the recent replies, never before it did."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio
from local_redis import RedisServer
from support import async_test

from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.connection import ClusterClient
from scrapy_redis_throttle.server_clock import FIRST_READS, GENERATION, ServerClock

# Redis's clock (µs) runs 1,000 s ahead of the loop's (s) in these cases.
AHEAD = 1000.0


def approx(expected: float) -> object:
    return pytest.approx(expected, abs=1e-6)


def server_us(loop_time: float) -> float:
    """The server time (µs) of a decision at *loop_time*."""
    return (loop_time + AHEAD) * 1e6


def test_a_reply_read_late_counts_from_when_it_was_decided() -> None:
    clock = ServerClock()
    # The first reply is all the clock knows: its times count from when it was read.
    assert clock.decided_at(10.0, 10.001, server_us(10.0005)) == approx(10.001)
    # Read 150 ms after it was decided: it counts from its decision (plus the fastest way back).
    decided = clock.decided_at(11.0, 11.15, server_us(11.0005))
    assert decided == approx(11.001)
    # A faster reply lowers the estimate for the next ones.
    assert clock.decided_at(12.0, 12.0002, server_us(12.0001)) == approx(12.0002)
    assert clock.decided_at(13.0, 13.2, server_us(13.0001)) == approx(13.0002)


def test_a_clock_that_steps_back_is_followed_from_the_next_reply() -> None:
    """Redis's clock steps back by a second (or another server answers): the reply is out of
    the bounds the earlier ones gave (Redis would have decided before the call was sent), so
    they start again from it alone: it counts from when it was read, the next ones from their
    decisions again."""
    clock = ServerClock()
    clock.decided_at(10.0, 10.001, server_us(10.0005))
    assert clock.decided_at(11.0, 11.15, server_us(11.0005) - 1e6) == approx(11.15)
    clock.decided_at(12.0, 12.001, server_us(12.0005) - 1e6)
    assert clock.decided_at(13.0, 13.15, server_us(13.0005) - 1e6) == approx(13.001)


def test_old_bounds_are_forgotten() -> None:
    """Bounds over two generations old are not used: a late reply after a long idle counts
    from when it was read, and Redis's time is unknown until a reply tells it again."""
    clock = ServerClock()
    clock.decided_at(10.0, 10.001, server_us(10.0005))
    assert clock.server_us(10.5) == approx(server_us(10.5005))
    later = 10.001 + 2 * GENERATION
    assert clock.server_us(later) is None
    assert clock.decided_at(later, later + 0.15, server_us(later + 0.0005)) == approx(later + 0.15)


def test_a_clock_that_steps_forward_is_followed_at_once() -> None:
    """Redis's clock jumps a second ahead: the sample is lower than every earlier one, and the
    estimate follows it from that reply on (the decisions are never put after the reads)."""
    clock = ServerClock()
    clock.decided_at(10.0, 10.001, server_us(10.0005))
    assert clock.decided_at(11.0, 11.001, server_us(11.0005) + 1e6) == approx(11.001)
    assert clock.decided_at(12.0, 12.2, server_us(12.0005) + 1e6) == approx(12.001)


@async_test
async def test_a_moment_placed_late_is_placed_again_by_later_bounds() -> None:
    """The first reply, read 190 ms late, placed its moment 190 ms late; a faster reply since
    tells when it really is, which a request that held it must know (it missed it). Bounds
    never place a moment later than before, nor does an unknown clock move it."""
    now = asyncio.get_running_loop().time()
    clock = ServerClock()
    decided = clock.decided_at(now - 0.2, now - 0.01, server_us(now - 0.2))
    moment, moment_us = decided + 0.25, server_us(now - 0.2 + 0.25)
    assert moment == approx(now + 0.24)
    assert clock.placed(moment, moment_us) == approx(moment)
    clock.decided_at(now - 0.001, now, server_us(now - 0.0005))
    assert clock.placed(moment, moment_us) == approx(now + 0.0505)
    assert clock.placed(now + 0.01, moment_us) == approx(now + 0.01), "never later"
    assert clock.placed(moment, None) == moment
    assert ServerClock().placed(moment, moment_us) == moment


@async_test
async def test_a_moment_told_to_redis_is_never_earlier_there_than_here() -> None:
    """moment_us places a moment (a worker's own, such as the end of its local tokens) as late
    as the bounds allow, so that Redis gives no moment before it: exactly, where a reply's sent
    time is Redis's. A moment of a reply told back comes back later by the bounds' width (0.19
    s here, a reply read that late; a round trip once bounds are narrow), never earlier.
    Unknown without bounds."""
    now = asyncio.get_running_loop().time()
    clock = ServerClock()
    assert clock.moment_us(now) is None
    decided = clock.decided_at(now - 0.2, now - 0.01, server_us(now - 0.2))
    assert clock.moment_us(now + 5) == pytest.approx(server_us(now + 5), abs=1e-3)
    given_us = server_us(now - 0.2) + 300_000
    assert clock.moment_us(decided + 0.3) == pytest.approx(given_us + 190_000, abs=1e-3)
    told_back = clock.moment_us(clock.loop_time(given_us) or 0)
    assert told_back == pytest.approx(given_us + 190_000, abs=1e-3)


def test_a_redis_cluster_is_not_asked_for_clocks_it_has_not_told_of() -> None:
    """Each primary of a Redis Cluster has a clock of its own (see test_cluster.py); before the
    cluster told where a bucket is, its clock is unknown (no connection is made here)."""
    cluster = TokenBucket(ClusterClient(host="127.0.0.1", port=1), "redis_throttle")
    assert cluster.server_clock("a.example").server_us(0.0) is None
    assert cluster.server_clock("a.example") is not cluster.server_clock("a.example")
    one = TokenBucket(redis.asyncio.Redis(port=1), "redis_throttle")
    assert one.server_clock("a.example") is one.server_clock("b.example")


@async_test
async def test_calls_that_come_while_the_clock_is_read_wait_for_that_reading_in_turn(
    redis_server: RedisServer,
) -> None:
    """The first call reads Redis's TIME (a few times); those that come meanwhile wait for that
    one reading instead of reading again, and go on in the order they came: a call that came
    later does not overtake them (the first requests of a crawl keep their order)."""
    client = redis.asyncio.Redis(port=redis_server.port)
    await client.config_resetstat()  # the server's TIME calls count this test's alone
    clock, went = ServerClock(), []

    async def call(n: int) -> None:
        await clock.follow(client.time)
        went.append(n)

    try:
        calls = [asyncio.ensure_future(call(n)) for n in range(5)]
        await asyncio.sleep(0)  # they all wait for the first one's reading
        calls.append(asyncio.ensure_future(call(5)))
        await asyncio.gather(*calls)
        await clock.follow(client.time)  # known now: no reading
    finally:
        await client.aclose()
    assert went == list(range(6))
    with redis_server.client() as sync_client:
        assert sync_client.info("commandstats")["cmdstat_time"]["calls"] == FIRST_READS
