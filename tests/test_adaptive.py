"""The adaptive rate: lowered for the fleet on 429/503 pauses and timeouts, climbing back."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from support import (
    assert_never_early,
    assert_paced,
    assert_released_paced,
    async_test,
    crawl_settings,
    finish_crawl_workers,
    one_domain_jobs,
    pages,
    redis_now_us,
    released,
    run_crawl,
    start_crawl_workers,
    token_bucket,
)

from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.config import Adaptive
from scrapy_redis_throttle.pauses import Message, parse_message
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.redis_schema import penalty_channel, rate_key
from scrapy_redis_throttle.scripts import load_script

A, B, _ = HOSTS
LIMIT = Limit(10, 1, "10/s")
# Slow to climb back: the rate stays where a test lowered it while the test runs.
ADAPTIVE = Adaptive(min_rate=1, decrease=0.5, recovery=3600)


def about(rate: object) -> object:
    """*rate*, give or take what it climbs (0.0025/s a second) between two calls of a test."""
    return pytest.approx(rate, abs=1e-3)


async def spacing(bucket: TokenBucket, domain: str) -> float:
    """How long the second of two requests sent at once waits: one token's refill time."""
    assert (await bucket.acquire(domain, LIMIT, reserve=10)).allowed
    second = await bucket.acquire(domain, LIMIT, reserve=10)
    assert second.reserved
    return second.retry_after


@async_test
async def test_a_failure_halves_the_rate_for_every_acquire(redis_server: RedisServer) -> None:
    async with token_bucket(redis_server, adaptive=True) as bucket:
        slowdown = await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=0)
        assert (slowdown.lowered, slowdown.rate) == (True, 5.0)
        # From 5/s back to 10/s, at (10 - 1) / 3600 requests per second per second.
        assert slowdown.back_in == pytest.approx(5 / 9 * 3600)
        assert 0.1 < await spacing(bucket, "a.example") <= 0.2, "5/s: 0.2 s apart"
        assert await spacing(bucket, "b.example") <= 0.1, "other domains keep 10/s"
        await bucket.slow_down("c.example", LIMIT, ADAPTIVE, age=0)
    async with token_bucket(redis_server) as bucket:
        assert await spacing(bucket, "c.example") <= 0.1, "adaptive rate off: 10/s"


@async_test
async def test_a_decrease_voids_the_moments_reserved_before(redis_server: RedisServer) -> None:
    async with token_bucket(redis_server, adaptive=True) as bucket:
        start = time.monotonic()
        reserved = [await bucket.acquire("a.example", LIMIT, reserve=10) for _ in range(5)]
        assert reserved[-1].retry_after == pytest.approx(0.4, abs=0.05)
        with redis_server.client() as client, client.pubsub() as pubsub:
            pubsub.subscribe(penalty_channel("ns"))
            slowdown = await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=0)
            took = time.monotonic() - start
            messages = [pubsub.get_message(timeout=5) for _ in range(2)]
        # Moments were reserved until 0.5 s after the first acquire (the bucket's "full again"
        # time): what was left of that when the decrease came (0.42 s once, under load).
        assert 0.5 - took < slowdown.void <= 0.5
        assert messages[1] is not None
        assert parse_message(messages[1]["data"]) == Message(
            "a.example", round(slowdown.void * 1e6), int(slowdown.at_us), holds=False
        ), "when, by Redis's clock, as the reply says; a change of rate, no pause"
        # The bucket forgot them: the requests that held them ask again, at 5/s from now.
        assert 0.1 < await spacing(bucket, "a.example") <= 0.2


@async_test
async def test_failures_of_requests_sent_before_the_last_decrease_are_ignored(
    redis_server: RedisServer,
) -> None:
    async with token_bucket(redis_server, adaptive=True) as bucket:
        assert (await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=0)).rate == 5
        # Sent 10 s ago, before the decrease: the same trouble, already counted.
        late = await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=10)
        assert (late.lowered, late.rate, late.back_in) == (False, about(5), 0)
        # Sent after it: the lowered rate is too fast still.
        assert (await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=0)).rate == about(2.5)


@async_test
async def test_the_rate_stops_at_the_floor(redis_server: RedisServer) -> None:
    async with token_bucket(redis_server, adaptive=True) as bucket:
        rates = [
            (await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=0)).rate for _ in range(6)
        ]
        assert rates == about([5, 2.5, 1.25, 1, 1, 1])
        slow = Limit(0.5, 1, "1/2s")  # configured below the floor: nothing to lower
        slowdown = await bucket.slow_down("b.example", slow, ADAPTIVE, age=0)
        assert (slowdown.lowered, slowdown.rate) == (False, 0.5)
    with redis_server.client() as client:
        assert client.exists(rate_key("ns", "b.example")) == 0


@async_test
async def test_the_rate_climbs_back_linearly_then_its_key_expires(
    redis_server: RedisServer,
) -> None:
    key = rate_key("ns", "a.example")
    with redis_server.client() as client:
        started = time.monotonic()
        now = redis_now_us(client)
        # Lowered to 4/s half a second ago; it climbs by 6/s per second: 7/s now.
        client.set(key, f"4 {now - 500_000} 6e-06 {now - 500_000}")
        async with token_bucket(redis_server, adaptive=True) as bucket:
            gap = await spacing(bucket, "a.example")
            # A failure now halves the rate it has climbed to.
            slowdown = await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=0)
        elapsed = time.monotonic() - started  # the rate climbed by 6/s per second meanwhile
        assert 1 / (7 + 6 * elapsed) - elapsed <= gap <= 1 / 7
        assert 3.5 <= slowdown.rate <= 3.5 + 3 * elapsed
        # Its key lives as long as the climb back to 10/s takes, then the rate is the limit's.
        expected_ms = (10 - slowdown.rate) / 9 * 3600 * 1000
        assert expected_ms - 100 < client.pttl(key) <= expected_ms + 1  # rounded up to a ms


@async_test
async def test_after_a_pause_the_rate_climbs_from_its_end(redis_server: RedisServer) -> None:
    async with token_bucket(redis_server, adaptive=True) as bucket:
        slowdown = await bucket.slow_down("a.example", LIMIT, ADAPTIVE, age=0, hold=30)
    assert slowdown.back_in == pytest.approx(30 + 5 / 9 * 3600)
    with redis_server.client() as client:
        key = rate_key("ns", "a.example")
        rate, since, _, lowered_at = client.get(key).split()
        assert (float(rate), int(since) - int(lowered_at)) == (5, 30_000_000)
        assert slowdown.back_in * 1000 - 100 < client.pttl(key) <= slowdown.back_in * 1000 + 1


@pytest.mark.parametrize(
    "args",
    [
        ["0", "1", "0.5", "1e6", "0", "0", "1", "ch", "k"],
        ["10", "-1", "0.5", "1e6", "0", "0", "1", "ch", "k"],
        ["10", "1", "1", "1e6", "0", "0", "1", "ch", "k"],
        ["10", "1", "0", "1e6", "0", "0", "1", "ch", "k"],
        ["10", "1", "0.5", "0", "0", "0", "1", "ch", "k"],
        ["10", "1", "0.5", "1e6", "-1", "0", "1", "ch", "k"],
        ["10", "1", "0.5", "1e6", "0", "nan", "1", "ch", "k"],
        ["10", "1", "0.5", "inf", "0", "0", "1", "ch", "k"],
        ["10", "1", "0.5", "1e6", "0", "0", "0.5", "ch", "k"],
        ["10", "1", "0.5"],
    ],
)
def test_slow_down_script_validates_its_arguments(
    redis_server: RedisServer, args: list[str]
) -> None:
    with redis_server.client() as client:
        script = client.register_script(load_script("slow_down.lua"))
        with pytest.raises(redis.ResponseError, match="slow_down takes finite numbers rate > 0"):
            script(keys=["ns:{k}", "ns:{k}:rate"], args=args)
        assert client.keys("*") == []


def adaptive_settings(redis_url: str, **overrides: Any) -> dict[str, Any]:
    return crawl_settings(
        redis_url,
        REDIS_THROTTLE_ADAPTIVE_ENABLED=True,
        REDIS_THROTTLE_ADAPTIVE_MIN_RATE="1/s",
        REDIS_THROTTLE_ADAPTIVE_RECOVERY=3600,
        **overrides,
    )


def test_the_fleet_slows_down_after_a_429_and_remembers_it_across_restarts(
    redis_server: RedisServer,
) -> None:
    """Two worker processes crawl A at 10/s; one request gets a 429 (Retry-After: 1): the rate
    halves for both. Two new workers (a restart) start at the lowered rate."""
    errors = {(A, "/page/0"): [(429, {"Retry-After": "1"})]}
    with DemoSite(HOSTS, pages=40, errors=errors) as site:

        def crawl(first_page: int) -> list[dict[str, Any]]:
            jobs = one_domain_jobs(
                site, A, adaptive_settings(redis_server.url), {A: "10/s"}, 2, 10, first=first_page
            )
            return finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 90)

        first = crawl(0)
        first_arrivals = site.arrivals(A)
        second = crawl(20)
        restarted = site.arrivals(A)[len(first_arrivals) :]

    assert sorted(a.path for a in first_arrivals if a.status == 200) == sorted(
        f"/page/{n}" for n in range(20)
    ), "every page of the first crawl, the refused one retried"
    [refused] = [a.wall_time for a in first_arrivals if a.status == 429]
    after_pause = [t for t in released(first, A) if t > refused]
    assert_paced(after_pause, rate=5, burst=1, what="A after the 429, as released")
    assert_never_early([a.wall_time for a in first_arrivals], released(first, A), A)
    assert sum(s.get("redis_throttle/adaptive/lowered", 0) for s in first) == 1
    # The moments both workers reserved at 10/s were void: their requests asked again.
    assert sum(s.get("redis_throttle/paused_reservations", 0) for s in first) >= 10
    assert sum(s.get("redis_throttle/adaptive/lowered", 0) for s in second) == 0
    assert len(restarted) == 20
    assert_released_paced(second, restarted, 5, 1, A)
    with redis_server.client() as client:
        assert float(client.get(rate_key("redis_throttle", A)).split()[0]) == 5


@async_test
async def test_download_timeouts_lower_the_rate_once_per_incident(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two requests to A, sent 0.1 s apart, both time out: the first halves A's rate, the
    second was sent before that decrease and changes nothing."""
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    stalls = {(A, "/page/1"): 5.0, (A, "/page/2"): 5.0}
    with DemoSite(HOSTS, pages=20, stalls=stalls) as site:
        crawler = await run_crawl(
            adaptive_settings(redis_server.url, DOWNLOAD_TIMEOUT=1),
            pages(site, A, 12) + pages(site, B, 4),
            redis_throttle_rates={A: "10/s", B: "10/s"},
        )
        arrivals = site.arrivals(A)
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/adaptive/timeouts"] == 2
    assert stats["redis_throttle/adaptive/lowered"] == 1
    with redis_server.client() as client:
        assert float(client.get(rate_key("redis_throttle", A)).split()[0]) == 5
        assert client.exists(rate_key("redis_throttle", B)) == 0
    # Judged by the releases (an arrival comes later by its connection's time, which is the
    # machine's): from the retried request's (the last before it arrived) on, at the lowered
    # rate; the other timed-out request's retry among them.
    retried = [a.wall_time for a in arrivals if a.path == "/page/1"][1]
    times = released(stats, A)
    after = [t for t in times if t >= max(t for t in times if t <= retried)]
    assert len(after) >= 2, after
    assert_paced(after, rate=5, burst=1, what="A after the decrease, as released")
    assert_never_early([a.wall_time for a in arrivals], released(stats, A), A)
    assert any(
        f"download timeout at '{A}': its rate for the fleet is now 5/s (configured: 10/s "
        "(burst 1)); without failures it is back in 2000 s" in r.getMessage()
        for r in caplog.records
    )
