"""Several scopes on a Redis Cluster (#23): a request's buckets are on different primaries of a
real cluster of 3, and scrapy_redis_throttle/across_nodes.py decides for them all: each bucket
counts the request at the same moment or not at all, a moment another worker took meanwhile is
tried again and what was reserved given back, a pause anywhere pauses the request.

The moments are read back from the buckets in Redis (all nodes run on this machine's clock:
moments the nodes agree on are equal, to within how well the worker knows their clocks)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import pytest
import redis
from local_redis import RedisServer
from redis_topologies import UNUSED_URL, LocalCluster
from scrapy.settings import Settings
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.test import get_crawler
from support import WORKER_USER, add_worker_user, async_test, redis_now_us, wait_until_async

from scrapy_redis_throttle.across_nodes import PEEK, AcrossNodes
from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.budgets import Budget
from scrapy_redis_throttle.clock import Clock
from scrapy_redis_throttle.config import ThrottleConfig
from scrapy_redis_throttle.connection import close, connect
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.one_node import OneNode
from scrapy_redis_throttle.rates import FIXED_WINDOW, Limit, parse_limit
from scrapy_redis_throttle.redis_schema import bucket_key
from scrapy_redis_throttle.replies import AcquireResult, Reservation
from scrapy_redis_throttle.resilience import ResilientBucket

PREFIX = "redis_throttle"
# How far apart two buckets' records of one moment may be: how well a worker knows its nodes'
# clocks (the fastest round trip of a TIME call), with room for a loaded machine. A bucket that
# counted the request when it asked, not at its moment, would be a second or more off.
AGREED_US = 20_000


def two_primaries(cluster: LocalCluster) -> tuple[str, str]:
    """A site and a proxy whose buckets are on different primaries."""
    owners: dict[int, str] = {}
    for n in range(100):
        name = f"shop-{n}.example"
        owners.setdefault(cluster.owner(cluster.slot(bucket_key(PREFIX, name))).port, name)
    assert len(owners) == 3, owners
    site, proxy, _ = owners.values()
    return site, proxy


@asynccontextmanager
async def cluster_bucket(cluster: LocalCluster) -> AsyncIterator[TokenBucket]:
    """A worker's view of the shared buckets in *cluster*, as the middleware has it."""
    client = connect(
        ThrottleConfig.from_settings(Settings({"REDIS_URL": UNUSED_URL, **cluster.settings()}))
    )
    bucket = TokenBucket(client, PREFIX)
    try:
        await bucket.read_time()
        yield bucket
    finally:
        await bucket.aclose()
        await close(client)


def bucket_time(cluster: LocalCluster, name: str) -> int | None:
    """*name*'s bucket's time (µs by Redis's clock; None: full)."""
    with cluster.client() as client:
        value = client.get(bucket_key(PREFIX, name))
    return None if value is None else int(value.split()[0])


def cluster_now_us(cluster: LocalCluster) -> int:
    """The nodes' clock (this machine's) as the scripts count it."""
    with cluster.running()[0].client() as client:
        return redis_now_us(client)


Call = tuple[str, float, int]
"""A bucket's call of token_bucket.lua: its name, reserve (seconds) and not_before."""


def counting(
    bucket: TokenBucket, calls: list[Call], before: Callable[[Call], Awaitable[None]] | None = None
) -> AcrossNodes:
    """Decisions across *bucket*'s nodes, each call of the script recorded in *calls* (and
    preceded by *before*)."""

    return AcrossNodes(CountingNode(bucket.node, calls, before), None, Clock())


class CountingNode:
    """*node*'s calls, each acquire recorded in *calls* (and preceded by *before*)."""

    def __init__(
        self,
        node: OneNode,
        calls: list[Call],
        before: Callable[[Call], Awaitable[None]] | None,
    ) -> None:
        self._node = node
        self._calls = calls
        self._before = before

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        reserve: float,
        busy_until: float,
        not_before: int,
        alone: bool = False,
    ) -> AcquireResult:
        call = (domain, reserve, not_before)
        self._calls.append(call)
        if self._before is not None:
            await self._before(call)
        return await self._node.acquire(domain, limit, cost, reserve, busy_until, not_before, alone)

    async def unreserve(self, domain: str, reservations: Sequence[Reservation]) -> object:
        return await self._node.unreserve(domain, reservations)


@async_test
async def test_every_bucket_counts_a_request_at_one_moment_or_none(
    redis_cluster: LocalCluster,
) -> None:
    site, proxy = two_primaries(redis_cluster)
    # The site's bucket holds two requests (one every 5 s), the proxy's one (every 10 s).
    site_limit = Limit(rate=0.2, burst=2, text="1 every 5 s, burst 2")
    proxy_limit = Limit(rate=0.1, burst=1, text="1 every 10 s")
    others = [(proxy, proxy_limit, 0.0)]
    async with cluster_bucket(redis_cluster) as bucket:
        before_first = cluster_now_us(redis_cluster)
        first = await bucket.acquire(site, site_limit, others=others)
        after_first = cluster_now_us(redis_cluster)
        assert first.allowed
        site_after_first = bucket_time(redis_cluster, site)
        # The proxy's bucket is empty for 10 s: refused, though the site's has a token.
        second = await bucket.acquire(site, site_limit, others=others)
        assert not second.allowed
        assert not second.reserved
        assert second.moment_us is not None
        # When it could go: the proxy's next moment, 10 s after the first request.
        assert before_first + 10e6 - AGREED_US <= second.moment_us <= after_first + 10e6 + AGREED_US
        assert bucket_time(redis_cluster, site) == site_after_first, "nothing taken"
        # Allowed to reserve: at the proxy's moment, which the site's bucket counts too.
        third = await bucket.acquire(site, site_limit, reserve=15, others=others)
        assert third.reserved
        assert third.moment_us is not None
        proxy_moment = bucket_time(redis_cluster, proxy)
        site_moment = bucket_time(redis_cluster, site)
        assert proxy_moment is not None
        assert site_moment is not None
        proxy_moment, site_moment = proxy_moment - 10_000_000, site_moment - 5_000_000
        assert abs(site_moment - proxy_moment) <= AGREED_US, (site_moment, proxy_moment)
        assert site_moment == third.moment_us, "the request goes when the site's bucket says"
        assert before_first + 10e6 - AGREED_US <= site_moment <= after_first + 10e6 + AGREED_US


@async_test
async def test_a_moment_taken_meanwhile_is_tried_again_and_the_reserved_given_back(
    redis_cluster: LocalCluster,
) -> None:
    """Between the request's peek and its reservations, another worker takes the proxy's next
    three seconds: the site's bucket, which had reserved the request's first moment, gets it
    back, and both count the request at the proxy's next moment."""
    site, proxy = two_primaries(redis_cluster)
    site_limit = Limit(rate=0.5, burst=1, text="1 every 2 s")
    proxy_limit = Limit(rate=1, burst=1, text="1/s")
    calls: list[Call] = []
    async with cluster_bucket(redis_cluster) as bucket, cluster_bucket(redis_cluster) as other:

        async def race(call: Call) -> None:
            if call[0] == proxy and call[1] == 0 and not raced:
                raced.append(call)
                taken = [await other.acquire(proxy, proxy_limit, reserve=10) for _ in range(3)]
                assert all(result.allowed or result.reserved for result in taken)

        raced: list[Call] = []
        across = counting(bucket, calls, race)
        assert (await bucket.acquire(site, site_limit)).allowed  # the site's next moment: +2 s
        before = cluster_now_us(redis_cluster)
        result = await across.acquire(site, site_limit, 1, 10, 0, [(proxy, proxy_limit, 0)])
        after = cluster_now_us(redis_cluster)
    assert raced, "the other worker took the proxy's moments in between"
    assert result.reserved
    assert result.moment_us is not None
    # The proxy's next moment, 3 s after the race.
    assert before + 3e6 - AGREED_US <= result.moment_us <= after + 3e6 + AGREED_US
    site_time, proxy_time = bucket_time(redis_cluster, site), bucket_time(redis_cluster, proxy)
    assert site_time is not None
    assert proxy_time is not None
    assert site_time - 2_000_000 == result.moment_us, "the site's first moment was given back"
    assert abs(proxy_time - 1_000_000 - result.moment_us) <= AGREED_US
    names = [(name, reserve) for name, reserve, _ in calls]
    assert names == [
        (site, PEEK),
        (proxy, PEEK),
        (site, 0),  # its moment, +2 s, is the latest
        (proxy, 0),  # refused: taken meanwhile (the site's given back)
        (proxy, 0),  # its moment, now the latest
        (site, 0),
    ], calls


@async_test
async def test_tokens_taken_during_an_outage_keep_one_end_in_every_call(
    redis_cluster: LocalCluster,
) -> None:
    """Back from its local fallback, a worker says until when its local tokens keep each bucket
    busy (busy_until, a moment): the peek and the reservation count to the same end, so that
    the request is reserved at once, at that end (a duration counted again from each call
    would move the moment later each time, and every round would be refused)."""
    site, proxy = two_primaries(redis_cluster)
    limit = Limit(rate=10, burst=1, text="10/s")
    calls: list[Call] = []
    async with cluster_bucket(redis_cluster) as bucket:
        asked = cluster_now_us(redis_cluster)
        now = asyncio.get_running_loop().time()
        result = await counting(bucket, calls).acquire(
            site, limit, 1, 10, now + 2.0, [(proxy, limit, now + 0.5)]
        )
        answered = cluster_now_us(redis_cluster)
    assert result.reserved
    assert result.moment_us is not None
    assert asked + 2e6 <= result.moment_us <= answered + 2e6, "the site's local tokens end"
    assert len(calls) == 4, calls
    assert bucket_time(redis_cluster, site) == result.moment_us + 100_000


@async_test
async def test_a_pause_of_any_bucket_pauses_the_request_and_takes_nothing(
    redis_cluster: LocalCluster,
) -> None:
    site, proxy = two_primaries(redis_cluster)
    limit = Limit(rate=10, burst=1, text="10/s")
    with redis_cluster.client() as client:
        LiveControl(client, PREFIX).pause(proxy)
    async with cluster_bucket(redis_cluster) as bucket:
        result = await bucket.acquire(site, limit, reserve=5, others=[(proxy, limit, 0)])
    assert result.paused
    assert not result.allowed
    assert bucket_time(redis_cluster, site) is None, "nothing taken"


@async_test
async def test_another_budget_s_bucket_is_read_as_in_one_call(
    redis_cluster: LocalCluster,
) -> None:
    """As on one Redis: a limit set live on another budget's name applies its rate and burst,
    not its quotas (which count where it is a request's domain), and a key of another type in
    its bucket (written by hand) counts as an empty bucket and is replaced, instead of failing
    every request under that budget."""
    site, proxy = two_primaries(redis_cluster)
    fast = Limit(rate=100, burst=10, text="100/s")
    hourly = parse_limit(
        [{"rate": "1/h", "algorithm": FIXED_WINDOW}], default_burst=1, source="test"
    )
    assert hourly is not None
    with redis_cluster.client() as client:
        LiveControl(client, PREFIX).set(proxy, 0.1, 1, hourly.quotas)
    async with cluster_bucket(redis_cluster) as bucket:
        before_first = cluster_now_us(redis_cluster)
        first = await bucket.acquire(site, fast, others=[(proxy, fast, 0)])
        after_first = cluster_now_us(redis_cluster)
        second = await bucket.acquire(site, fast, others=[(proxy, fast, 0)])
        with redis_cluster.client() as client:
            client.delete(bucket_key(PREFIX, proxy))
            client.hset(bucket_key(PREFIX, proxy), "written", "by hand")
        slow = Limit(rate=0.1, burst=1, text="1 every 10 s")  # (its bucket lives 10 s)
        third = await bucket.acquire(site, fast, others=[(proxy, slow, 0)])
        with redis_cluster.client() as client:
            replaced = client.type(bucket_key(PREFIX, proxy))
    assert first.allowed
    assert not second.allowed
    assert second.moment_us is not None
    # The live 1 every 10 s, not the hour's quota.
    assert before_first + 10e6 - AGREED_US <= second.moment_us <= after_first + 10e6 + AGREED_US
    assert third.allowed
    assert replaced == b"string"


@async_test
async def test_the_requests_of_one_worker_take_turns(redis_cluster: LocalCluster) -> None:
    """Twenty requests of one worker ask at once: each one peeks once and reserves once in
    each bucket (asking together, they would peek the same moment and all but one be refused,
    again and again), and they go one proxy interval apart."""
    site, proxy = two_primaries(redis_cluster)
    site_limit = Limit(rate=100, burst=1, text="100/s")
    proxy_limit = Limit(rate=20, burst=1, text="20/s")
    calls: list[Call] = []
    async with cluster_bucket(redis_cluster) as bucket:
        across = counting(bucket, calls)
        results = await asyncio.gather(
            *(
                across.acquire(site, site_limit, 1, 5, 0, [(proxy, proxy_limit, 0)])
                for _ in range(20)
            )
        )
        left = len(across.locks)
    assert all(result.allowed or result.reserved for result in results)
    moments = sorted(result.moment_us or 0 for result in results)
    gaps = [later - earlier for earlier, later in itertools.pairwise(moments)]
    assert min(gaps) >= 50_000 - AGREED_US, gaps
    assert len(calls) == 20 * 4, calls
    assert left == 0, "the locks are forgotten"


def refused_calls(node: RedisServer) -> int:
    """Commands *node* refused for want of rights."""
    with node.client() as client:
        return int(client.info("errorstats").get("errorstat_NOPERM", {}).get("count", 0))


@async_test
async def test_the_breaker_s_probe_asks_every_budget_s_primary(redis_cluster: LocalCluster) -> None:
    """A request's call failed on its proxy's primary (which refuses the worker's scripts here):
    the breaker's probe asks that primary too, not only the site's, which answers (closing the
    breaker on the site's answer alone would switch back and forth); once the proxy's primary
    answers, the breaker closes."""
    site, proxy = two_primaries(redis_cluster)
    proxy_primary = redis_cluster.owner(redis_cluster.slot(bucket_key(PREFIX, proxy)))
    settings = {
        "REDIS_URL": add_worker_user(redis_cluster),
        "REDIS_THROTTLE_FALLBACK_WORKERS": 1,
        "REDIS_THROTTLE_PROBE_INTERVAL": 0.1,
        **redis_cluster.settings(),
    }
    config = ThrottleConfig.from_settings(Settings(settings))
    client = connect(config)
    budget = ResilientBucket(client, config, MemoryStatsCollector(get_crawler()), dict, Clock())
    limit = Limit(rate=10, burst=1, text="10/s")
    try:
        await budget.start()
        assert budget.breaker.open_for() is None
        with proxy_primary.client() as admin:
            admin.execute_command("ACL", "SETUSER", WORKER_USER, "-evalsha", "-eval")
        refused = refused_calls(proxy_primary)
        grant = await budget.acquire(site, limit, 1, [Budget(proxy, limit)])
        assert not grant.shared, "paced by this worker alone"
        await wait_until_async(
            lambda: refused_calls(proxy_primary) >= refused + 3, "two probes at the proxy's"
        )
        assert budget.breaker.open_for() is not None, "still open: the proxy's primary refuses"
        with proxy_primary.client() as admin:
            admin.execute_command("ACL", "SETUSER", WORKER_USER, "+evalsha", "+eval")
        await wait_until_async(lambda: budget.breaker.open_for() is None, "the breaker closed")
    finally:
        await budget.aclose()
        await close(client)


@async_test
async def test_a_failed_or_cancelled_decision_gives_back_what_it_reserved(
    redis_cluster: LocalCluster,
) -> None:
    """The site's bucket reserved the request's moment, 5 s ahead; then its call to the proxy's
    bucket fails (a ConnectionError), or the request is cancelled (a close) while it waits
    for it: the site's moment is given back, not left spent for a request that does not go."""
    site, proxy = two_primaries(redis_cluster)
    site_limit = Limit(rate=0.2, burst=1, text="1 every 5 s")
    proxy_limit = Limit(rate=1, burst=1, text="1/s")
    others = [(proxy, proxy_limit, 0.0)]
    never = asyncio.Event()

    async def fail(call: Call) -> None:
        if call[:2] == (proxy, 0):
            raise redis.ConnectionError("the proxy's primary went away")

    async def hang(call: Call) -> None:
        if call[:2] == (proxy, 0):
            await never.wait()

    async with cluster_bucket(redis_cluster) as bucket:
        assert (await bucket.acquire(site, site_limit)).allowed
        site_time = bucket_time(redis_cluster, site)
        with pytest.raises(redis.ConnectionError):
            await counting(bucket, [], fail).acquire(site, site_limit, 1, 10, 0, others)
        assert bucket_time(redis_cluster, site) == site_time, "given back after the error"
        across = counting(bucket, [], hang)
        task = asyncio.ensure_future(across.acquire(site, site_limit, 1, 10, 0, others))
        await wait_until_async(lambda: bucket_time(redis_cluster, site) != site_time, "reserved")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bucket_time(redis_cluster, site) == site_time, "given back at the cancel"
        assert len(across.locks) == 0


@async_test
async def test_requests_waiting_for_a_node_that_stalls_do_not_call_it_again(
    redis_cluster: LocalCluster,
) -> None:
    """The proxy's primary stops answering (CLIENT PAUSE) while ten requests through it wait
    for their turn: the first one's call times out and opens the breaker; the nine others are
    paced by this worker alone at once, instead of calling that node in turn, a timeout each."""
    site, proxy = two_primaries(redis_cluster)
    proxy_primary = redis_cluster.owner(redis_cluster.slot(bucket_key(PREFIX, proxy)))
    settings = {
        "REDIS_URL": UNUSED_URL,
        "REDIS_THROTTLE_FALLBACK_WORKERS": 1,
        "REDIS_THROTTLE_PROBE_INTERVAL": 60,
        **redis_cluster.settings(),
    }
    config = ThrottleConfig.from_settings(Settings(settings))
    client = connect(config)
    stats = MemoryStatsCollector(get_crawler())
    budget = ResilientBucket(client, config, stats, dict, Clock())
    limit = Limit(rate=100, burst=1, text="100/s")
    # Longer than a call's timeout (1 s): unpaused only when it ends (CLIENT UNPAUSE waits too).
    pause_ms = 2500
    try:
        await budget.start()
        with proxy_primary.client() as admin:
            admin.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")
        grants = await asyncio.gather(
            *(budget.acquire(f"{n}.{site}", limit, 1, [Budget(proxy, limit)]) for n in range(10))
        )
    finally:
        await budget.aclose()
        await close(client)
        with proxy_primary.client() as admin:
            admin.ping()  # answered once the pause is over: the next test finds it well
    assert [grant.shared for grant in grants] == [False] * 10, "paced by this worker alone"
    errors = {
        name: count
        for name, count in stats.get_stats().items()
        if name.startswith("redis_throttle/redis_errors/")
    }
    assert sum(errors.values()) == 1, errors
