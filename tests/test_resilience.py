"""What the shared bucket does around failures of a real Redis: calls held or refused, what is
told to Redis after an outage, the handover, the fleet's size, a Redis restarted empty. The
decisions themselves are driven on a fake clock in tests/unit/test_fallback.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from local_redis import RedisServer
from scrapy import Request
from scrapy.settings import Settings
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.test import get_crawler
from spiders import UrlListSpider
from support import async_test, wait_until_async

from scrapy_redis_throttle.activity import REPORTS_KEPT, Activity
from scrapy_redis_throttle.budgets import Budget, RequestBudget
from scrapy_redis_throttle.clock import Clock
from scrapy_redis_throttle.config import DEFAULT_KEY_PREFIX, ThrottleConfig
from scrapy_redis_throttle.connection import connect_url
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.fallback import Grant, Source
from scrapy_redis_throttle.live_limits import LiveLimits
from scrapy_redis_throttle.metrics import ThrottleMetrics
from scrapy_redis_throttle.pauses import Pauses
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.redis_parking import RedisParking
from scrapy_redis_throttle.redis_schema import fleet_key, penalty_channel
from scrapy_redis_throttle.rejections import Rejections
from scrapy_redis_throttle.replies import Unreserved, Voiding
from scrapy_redis_throttle.resilience import ResilientBucket
from scrapy_redis_throttle.server_clock import ServerClock
from scrapy_redis_throttle.tickets import Ticket
from scrapy_redis_throttle.waiting import Turns


@contextlib.asynccontextmanager
async def own_budget(
    server: RedisServer, stats: MemoryStatsCollector | None = None, **settings: Any
) -> AsyncIterator[ResilientBucket]:
    """A ResilientBucket on *server*, checked, with *settings* (counting in *stats*)."""
    config = ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_URL": server.url, **settings}))
    client = connect_url(server.url, config.redis_params, 2)
    stats = stats or MemoryStatsCollector(get_crawler())
    budget = ResilientBucket(client, config, stats, dict, Clock())
    try:
        await budget.start()
        yield budget
    finally:
        await budget.aclose()
        await client.aclose()


@async_test
async def test_a_call_that_reaches_redis_late_does_not_push_the_bucket_later(
    own_redis: RedisServer,
) -> None:
    """While Redis answers, a call that waited on its way (here: CLIENT PAUSE, 0.3 s; after a
    cluster's failover, the new primary's clock read first) is decided by Redis's state: the
    bucket, full again by then, lets it go at once. (This worker's view of the bucket, sent as
    a duration worked out when the call was made, pushed the bucket that much later: a gap at
    the site, 0.535 s in a CI run of test_cluster's failover.)"""
    limit = Limit(10, 1, "10/s")
    async with own_budget(own_redis) as budget:
        assert (await budget.acquire("a.example", limit, 1)).result.allowed
        with own_redis.client() as admin:
            admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
        late = (await budget.acquire("a.example", limit, 1)).result
    assert late.allowed, late


@async_test
async def test_tokens_taken_locally_are_told_by_every_call(own_redis: RedisServer) -> None:
    """A call refused (its moment beyond REDIS_THROTTLE_MAX_RESERVE) writes nothing, busy_until
    neither: the tokens taken locally are told again by the next call, which Redis refuses too
    (when the first refusal counted as telling them, Redis let the next request go at once,
    among the moments the local fallback had given out: 8 releases in 0.495 s at 10/s)."""
    limit = Limit(10, 1, "10/s")
    async with own_budget(own_redis, REDIS_THROTTLE_MAX_RESERVE=1) as budget:
        for _ in range(30):  # 3 s of tokens, as the fallback gives them out
            budget.fallback.local.acquire("a.example", limit, 1, reserve=5, workers=1)
        first, second = [(await budget.acquire("a.example", limit, 1)).result for _ in range(2)]
    for result in first, second:
        assert not result.allowed, result
        assert not result.reserved, result
        assert 1 < result.retry_after <= 3.1, result


@pytest.mark.parametrize("secret_kept", [True, False], ids=["buckets-lost", "all-lost"])
@async_test
async def test_moments_reserved_before_redis_lost_them_are_told_again_unless_all_was_lost(
    own_redis: RedisServer, secret_kept: bool
) -> None:
    """Redis back without the buckets (*secret_kept*: as a replica that had not caught up
    would be) forgot the moments it had reserved, which requests still hold: once it is back,
    the next call tells it until when this worker saw the bucket busy (although it took
    nothing locally: here the "wait" policy), so that the next request comes after them.
    Restarted empty, secret and all: those requests ask anew (see test below), and the next
    request goes one request's time after the moment that may have gone last, not after the
    moments nobody uses (the new bucket would stand idle until then)."""
    limit = Limit(1, 1, "1/s")
    stats = MemoryStatsCollector(get_crawler())
    async with own_budget(own_redis, stats, REDIS_THROTTLE_ON_REDIS_ERROR="wait") as budget:
        for _ in range(6):  # moments until 5 s from now
            await budget.acquire("a.example", limit, 1)
        with own_redis.client() as admin:
            secret = admin.get(f"{DEFAULT_KEY_PREFIX}:secret")
        own_redis.stop()
        waiting = asyncio.ensure_future(budget.acquire("a.example", limit, 1))
        await wait_until_async(lambda: budget.breaker.open_for() is not None, "the failure")
        own_redis.start()
        if secret_kept:  # before the probe: the loop has not run since
            with own_redis.client() as admin:
                admin.set(f"{DEFAULT_KEY_PREFIX}:secret", secret)
        grant = await waiting
    assert grant.shared, grant
    assert grant.waited_for_redis, grant
    if secret_kept:
        assert grant.result.reserved, grant
        assert 2 < grant.result.retry_after <= 6, grant
        assert stats.get_value("redis_throttle/state_lost") is None
    else:
        assert grant.result.reserved, grant
        assert grant.result.retry_after <= 1, grant
        assert stats.get_value("redis_throttle/state_lost") == 1


def errors(stats: MemoryStatsCollector) -> int:
    return sum(n for key, n in stats.get_stats().items() if "redis_errors/" in key)


@async_test
async def test_a_redis_restarted_is_no_outage_for_a_worker_that_did_not_call_it_meanwhile(
    own_redis: RedisServer,
) -> None:
    """The scripts' connections kept across a restart of Redis are closed by the server: the
    next call goes on a new one, not on them (where it failed: a phantom outage, the worker
    pacing alone for 0.5 s while the others took the same moments from Redis, 429s in 2 of
    10 runs of tests/test_fleet_faults.py)."""
    limit = Limit(10, 1, "10/s")
    stats = MemoryStatsCollector(get_crawler())
    async with own_budget(own_redis, stats) as budget:
        assert (await budget.acquire("a.example", limit, 1)).shared
        own_redis.restart()
        # The end of the connections is there already (the server has gone): the loop reads it
        # within two turns (one finds the socket readable, the next reads it).
        for _ in range(3):
            await asyncio.sleep(0)
        grant = await budget.acquire("a.example", limit, 1)
    assert grant.shared, grant
    assert errors(stats) == 0


@async_test
async def test_the_first_probe_once_redis_is_back_closes_the_breaker(
    own_redis: RedisServer,
) -> None:
    """Another script's call found the outage; the acquires' connection, idle through it, was
    closed by the server: the probe goes on a new one, and the first once Redis is back closes
    the breaker. (On the old one it failed, and the worker paced alone for one more probe
    interval, after the other workers' handover: a fleet over its rates.)"""
    limit = Limit(10, 1, "10/s")
    stats = MemoryStatsCollector(get_crawler())
    async with own_budget(own_redis, stats) as budget:
        assert (await budget.acquire("a.example", limit, 1)).shared
        own_redis.stop()
        assert await budget.penalize("a.example", limit, None) is None  # another script's call
        assert budget.breaker.open_for() is not None
        own_redis.start()
        before = errors(stats)
        await wait_until_async(lambda: budget.breaker.open_for() is None, "the breaker to close")
    assert errors(stats) == before, "a probe failed once Redis was back"


@async_test
async def test_what_redis_knows_better_is_not_told_back(own_redis: RedisServer) -> None:
    """While Redis answers, this worker's view of the buckets is not sent back to them: a proxy
    set live to 1000/s (configured 10/s) paces at 1000/s, although this worker guesses its
    bucket's time at the configured rate (sent back, that guess held the proxy to 10/s: a
    second every 10 requests)."""
    proxy, domain = "proxy.example:8080", "shop.example"
    configured, fast = Limit(10, 1, "10/s"), Limit(10000, 100, "10000/s")
    with own_redis.client() as client:
        LiveControl(client, DEFAULT_KEY_PREFIX).set(proxy, 1000, 1)
    loop = asyncio.get_running_loop()
    async with own_budget(own_redis) as budget:
        moments = []
        started = loop.time()
        for _ in range(30):
            grant = await budget.acquire(domain, fast, 1, others=[Budget(proxy, configured)])
            assert grant.result.moment_us is not None, grant
            moments.append(grant.result.moment_us)
        took_us = (loop.time() - started) * 1e6
    # At 10/s, the 29 steps would take 2.9 s whatever the calls' time.
    span = moments[-1] - moments[0]
    assert span < 29_000 + took_us, f"29 steps of 1 ms, and the calls' own {took_us:.0f} µs"


@async_test
async def test_after_an_outage_a_worker_keeps_to_its_share_while_others_may_pace_alone(
    own_redis: RedisServer,
) -> None:
    """Each worker's breaker closes at its own probe: for REDIS_THROTTLE_PROBE_INTERVAL after
    Redis is back for one worker, another may still pace alone at its share, unknown to Redis.
    The worker back on Redis keeps to its share meanwhile (2 workers at 10/s: a moment every
    0.2 s, not 0.1 s), waiting for it without asking Redis, so that together they stay within
    the rate; then the shared pace."""
    settings = Settings(
        {
            "REDIS_THROTTLE_URL": own_redis.url,
            "REDIS_THROTTLE_FALLBACK_WORKERS": 2,
            "REDIS_THROTTLE_PROBE_INTERVAL": 1,
        }
    )
    config = ThrottleConfig.from_settings(settings)
    client = connect_url(own_redis.url, config.redis_params, 2)
    stats = MemoryStatsCollector(get_crawler())
    bucket = ResilientBucket(client, config, stats, dict, Clock())
    limit = Limit(10, 1, "10/s")
    loop = asyncio.get_running_loop()

    waits: list[bool] = []  # of the grants that were not Redis's: handover waits?

    async def moments(count: int) -> list[float]:
        """The loop times of the next *count* moments this worker is given, one at a time."""
        given: list[float] = []
        while len(given) < count:
            called = loop.time()  # when the share is checked (before any await of acquire)
            grant = await bucket.acquire("a.example", limit, 1)
            result = grant.result
            if grant.shared and result.allowed:
                # The share let it go then (Redis decides a round trip later, or more on a
                # busy machine: a step of 0.1897 s in CI, counted from Redis's decisions).
                given.append(called)
            elif grant.shared:
                # Reserved: its moment, from when Redis decided (a reply read late is no later).
                given.append(result.decided(loop.time()) + result.retry_after)
            else:
                waits.append(grant.source is Source.HANDOVER)
            await asyncio.sleep(grant.result.retry_after)
        return given

    try:
        own_redis.stop()
        assert not (await bucket.acquire("a.example", limit, 1)).shared, "the breaker opened"
        own_redis.start()
        await wait_until_async(lambda: bucket.breaker.open_for() is None, "the probe")
        calls = stats.get_value("redis_throttle/redis_calls")
        handover = await moments(4)
        assert stats.get_value("redis_throttle/redis_calls") == calls + 4, "waits ask no one"
        assert waits, "the share made some requests wait"
        assert all(waits), f"waits told apart as the handover's: {waits}"
        await asyncio.sleep(1.0)  # the handover's length: REDIS_THROTTLE_PROBE_INTERVAL
        shared = await moments(4)
    finally:
        await bucket.aclose()
        await client.aclose()
    steps = [later - earlier for earlier, later in itertools.pairwise(handover)]
    assert all(0.19 < step < 0.3 for step in steps), handover
    steps = [later - earlier for earlier, later in itertools.pairwise(shared)]
    assert steps == pytest.approx([0.1] * 3, abs=0.02), shared


@async_test
async def test_the_fleets_size_outlives_a_redis_that_lost_it(own_redis: RedisServer) -> None:
    """A Redis restarted empty counts the workers again one by one, as each calls: a worker
    that then read 1 would pace an outage at the full rate, alone. Its share stays that of the
    most workers counted over a worker's time in the fleet (3 intervals), until the counts
    after the restart cover that time."""
    interval = 0.1
    client = connect_url(own_redis.url, {}, 2)
    stats = MemoryStatsCollector(get_crawler())
    workers = [Activity(client, "ns", interval, stats, dict, Clock()) for _ in range(3)]
    for worker in workers:
        await worker._count_in()
    first = workers[0]
    await first._count_in()
    assert first.fleet_size == 3

    own_redis.restart()
    # The first call may fail on the connection the restart cut (the size is then kept).
    await first._count_in()
    await first._count_in()
    with own_redis.client() as admin:
        assert admin.zcard(fleet_key("ns")) == 1
    assert first.fleet_size == 3
    await asyncio.sleep(1.5 * REPORTS_KEPT * interval)  # the time passing is the subject
    await first._count_in()
    assert first.fleet_size == 1
    await client.aclose()


class RecordingBucket:
    """A worker's shared bucket (see :class:`.waiting.SharedBucket`) that records the moment
    (µs by Redis's clock) of every grant it gives."""

    def __init__(self, bucket: ResilientBucket) -> None:
        self.bucket = bucket
        self.moments: list[float] = []

    async def acquire(
        self, domain: str, limit: Limit, cost: float, others: Sequence[Budget] = ()
    ) -> Grant:
        grant = await self.bucket.acquire(domain, limit, cost, others)
        result = grant.result
        assert grant.shared, grant
        if result.allowed or result.reserved:
            assert result.moment_us is not None
            self.moments.append(result.moment_us)
        return grant

    def server_clock(self, domain: str) -> ServerClock:
        return self.bucket.server_clock(domain)

    async def last_voiding(
        self, domain: str, listening: bool = False
    ) -> tuple[bool, Voiding | None]:
        return await self.bucket.last_voiding(domain, listening)

    def lost(self, reserved_at: float, elsewhere: bool = False) -> bool:
        return self.bucket.lost(reserved_at, elsewhere)

    def returned_since(self, reserved_at: float, elsewhere: bool = False) -> bool:
        return self.bucket.returned_since(reserved_at, elsewhere)


@pytest.mark.parametrize("listening", [True, False], ids=["listening", "not-listening"])
@async_test
async def test_a_parked_moment_reserved_before_redis_restarted_empty_is_not_given_again(
    own_redis: RedisServer, redis_server: RedisServer, listening: bool
) -> None:
    """Issue #36, step by step. A worker reserves 4 moments of a 1/s domain (0 to 3 s ahead)
    and parks the last request in scrapy-redis's Redis; the throttle's Redis restarts empty.
    That worker makes no call since, so nothing tells the new bucket of the moment its parked
    request holds. Another worker, which knew the fleet's secret before the restart, takes 4
    moments of the new bucket, then unparks the request and gives it its turn. Its moment is
    lost: the new Redis has a new secret, which the other worker reads when its pauses'
    listener subscribes again (*listening*: the ticket's seal is then the old secret's), or
    else before the request goes (it reads the domain's voidings, and the secret with them). No
    two requests of the domain may be under 1 s apart by Redis's clock. (Before the secret
    told, the parked request went at its moment: 0.034 s after another's.)"""
    domain, limit = "a.example", Limit(1, 1, "1/s")
    spider = UrlListSpider()
    stats = MemoryStatsCollector(get_crawler())
    config = ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_URL": own_redis.url}))
    async with own_budget(own_redis) as parker, own_budget(own_redis, stats) as other:
        grants = [await parker.acquire(domain, limit, 1) for _ in range(4)]
        held = grants[-1].result
        assert held.reserved
        assert held.moment_us is not None
        now, wall = asyncio.get_running_loop().time(), time.time()
        ticket = Ticket(
            domain=domain,
            due=now + held.retry_after,
            reserved=True,
            locally=False,
            reserved_at=wall,
            waiting_since=wall,
            moment_us=held.moment_us,
            reservation=held.reservation,
        )
        recording = RecordingBucket(other)
        client = connect_url(own_redis.url, config.redis_params, 1)
        pauses = Pauses(
            client,
            penalty_channel(config.key_prefix),
            stats,
            dict,
            other.fallback.local,
            longest=60,
            clock=Clock(),
            state=other.guard,
        )
        activity = Activity(client, "ns", 0, stats, dict, Clock())
        turns = Turns(
            config,
            recording,
            pauses,
            activity,
            LiveLimits(dict),
            stats,
            ThrottleMetrics(on=False),
            dict,
            Clock(),
        )
        stores = [
            RedisParking(
                connect_url(redis_server.url, {}, 1),
                "restart:parked",
                spider,
                Rejections(stats, dict),
                Clock(),
                seals=bucket.lost_state.seals,
            )
            for bucket in (parker, other)
        ]
        try:
            if listening:
                await pauses.start()
            await stores[0].park(Request(f"http://{domain}/parked"), ticket)
            own_redis.restart()
            if listening:
                await wait_until_async(
                    lambda: stats.get_value("redis_throttle/state_lost"),
                    "the listener to read the new secret",
                )
            budget = RequestBudget(domain, limit)
            for _ in range(4):
                await recording.acquire(domain, limit, 1)
            [(request, back)] = (await stores[1].unpark(ahead=10, limit=10))[0]
            asked = len(recording.moments)
            assert await turns.take(request, budget, back, may_park=False) is None
            # Nor is the lost moment given back to the new bucket (a moment reserved there is).
            assert held.reservation is not None
            assert await other.unreserve(domain, [held.reservation]) == Unreserved(0, 0)
            fresh = (await other.acquire(domain, limit, 1)).result.reservation
            assert fresh is not None
            assert await other.unreserve(domain, [fresh]) == Unreserved(1, 0)
        finally:
            await pauses.stop()
            await client.aclose()
            for store in stores:
                await store.close(keep=False)
    honoured = len(recording.moments) == asked
    going = sorted([*recording.moments, *([held.moment_us] if honoured else [])])
    gaps = [later - earlier for earlier, later in itertools.pairwise(going)]
    assert min(gaps) >= 1e6, f"moments {min(gaps) / 1e6:.3f} s apart (limit 1/s)"
    assert not honoured
    assert stats.get_value("redis_throttle/lost_reservations") == 1
    assert stats.get_value("redis_throttle/rejected/parked_ticket") is None
