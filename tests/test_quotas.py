"""Several limits per domain and the window algorithms, in a real redis-server and real crawls;
the fleet's activity reported for ``scrapy-redis-throttle status``."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from run_demo import busiest_window
from support import (
    assert_never_early,
    async_test,
    crawl_settings,
    finish_crawl_workers,
    one_domain_jobs,
    pages,
    redis_now_us,
    run_crawl,
    start_crawl_workers,
    token_bucket,
    wait_until,
    wait_until_async,
)

from scrapy_redis_throttle import one_node
from scrapy_redis_throttle.cli import EXIT_BAD_INPUT
from scrapy_redis_throttle.control import FleetActivity, LiveControl
from scrapy_redis_throttle.rates import Limit, parse_limit
from scrapy_redis_throttle.redis_schema import (
    EPOCH,
    LOG_SUFFIX,
    QUOTA_SUFFIX,
    bucket_key,
    parked_counts_key,
)
from scrapy_redis_throttle.scripts import load_script

A, B, _ = HOSTS
KEY = bucket_key("ns", A)
SLIDING = "sliding_window"
FIXED = "fixed_window"
WINDOW_OF_ONE = {"rate": "1/0.1s", "algorithm": FIXED}


def limit(*specs: object) -> Limit:
    parsed = parse_limit(list(specs), default_burst=1, source="test")
    assert parsed is not None
    return parsed


def state(client: redis.Redis, key: str = KEY) -> tuple[Any, ...]:
    """Everything Redis holds of the domain's limits."""
    return (
        client.get(key),
        client.hgetall(key + QUOTA_SUFFIX),
        client.zrange(key + LOG_SUFFIX, 0, -1, withscores=True),
    )


def logged(client: redis.Redis, key: str) -> list[float]:
    """The moments in a domain's log, in order, in µs (whole numbers: no rounding at a window's
    edge)."""
    entries: list[tuple[bytes, float]] = client.zrange(  # type: ignore[assignment]
        key + LOG_SUFFIX, 0, -1, withscores=True
    )
    return [score for _, score in entries]


@async_test
async def test_a_request_goes_when_every_limit_allows_it_and_none_is_charged_otherwise(
    redis_server: RedisServer,
) -> None:
    # The bucket allows 10 at once, the sliding window 2 a minute, the other bucket 2 at once.
    # (Slow rates: no key expires while the test compares them.)
    limits = limit(
        {"rate": "1/m", "burst": 10},
        {"rate": "2/m", "algorithm": SLIDING},
        {"rate": "1/10s", "burst": 2},
    )
    with redis.Redis.from_url(redis_server.url) as client:
        async with token_bucket(redis_server) as bucket:
            started = time.monotonic()
            first = await bucket.acquire(A, limits)
            second = await bucket.acquire(A, limits)
            before = state(client)
            refused = await bucket.acquire(A, limits, reserve=59)
            after = state(client)
            reserved = await bucket.acquire(A, limits, reserve=60)
            elapsed = time.monotonic() - started
            log = logged(client, KEY)

    assert (first.allowed, first.tokens_left) == (True, 1.0)  # 1 left in the window
    assert (second.allowed, second.tokens_left) == (True, 0.0)
    # The longest wait: the window's (60 s after the first), not the second bucket's (10 s).
    assert not refused.allowed
    assert not refused.reserved
    assert 60 - elapsed <= refused.retry_after <= 60
    assert after == before, "a request refused takes nothing from any limit"
    # Within the horizon, the moment is reserved in every limit.
    assert reserved.reserved
    assert 60 - elapsed <= reserved.retry_after <= 60
    assert log[2] == log[0] + 60_000_000, "reserved as the first leaves the window"


@async_test
async def test_a_limit_that_allows_is_not_charged_when_the_bucket_refuses(
    redis_server: RedisServer,
) -> None:
    limits = limit(
        "1/10s", {"rate": "5/m", "algorithm": SLIDING}, {"rate": "5/h", "algorithm": FIXED}
    )
    with redis.Redis.from_url(redis_server.url) as client:
        async with token_bucket(redis_server) as bucket:
            assert (await bucket.acquire(A, limits)).allowed
            before = state(client)
            refused = await bucket.acquire(A, limits)
            assert state(client) == before
    assert not refused.allowed
    assert not refused.reserved
    assert 0 < refused.retry_after <= 10
    assert len(before[2]) == 1
    assert [value.split()[1] for value in before[1].values()] == [b"1"]


@async_test
async def test_a_fixed_window_counts_until_its_end_then_starts_again(
    redis_server: RedisServer,
) -> None:
    limits = limit({"rate": "3/s", "algorithm": FIXED})
    # Windows follow one another from the scripts' epoch, in Redis's clock: one starts at each
    # whole second. Starting in a window's first half, the first 3 are in one window.
    with redis.Redis.from_url(redis_server.url) as client:
        await wait_until_async(
            lambda: redis_now_us(client) % 1_000_000 < 400_000, "the start of a window"
        )
        async with token_bucket(redis_server) as bucket:
            allowed = [await bucket.acquire(A, limits) for _ in range(3)]
            before = redis_now_us(client)
            refused = await bucket.acquire(A, limits)
            after = redis_now_us(client)
            await asyncio.sleep(refused.retry_after)
            again = [await bucket.acquire(A, limits) for _ in range(4)]
    assert [result.allowed for result in allowed] == [True] * 3
    assert not refused.allowed
    # It may go at the end of the window it asked in: a whole second, in Redis's clock.
    wait_us = round(refused.retry_after * 1e6)
    assert 0 < wait_us <= 1_000_000
    assert (after + wait_us) // 1_000_000 * 1_000_000 >= before + wait_us
    assert [result.allowed for result in again] == [True] * 3 + [False]
    assert [result.tokens_left for result in again[:3]] == [2, 1, 0]


@async_test
async def test_a_fixed_window_lets_twice_its_count_go_across_its_end(
    redis_server: RedisServer,
) -> None:
    """The documented boundary burst: 3 now, 3 reserved for the next window's start, less than
    a window later; the next 3 would be in the window after, beyond the horizon of 1 s."""
    limits = limit({"rate": "3/s", "algorithm": FIXED})
    with redis.Redis.from_url(redis_server.url) as client:
        # The 7 calls (a few ms) within one window.
        await wait_until_async(
            lambda: redis_now_us(client) % 1_000_000 < 900_000, "the start of a window"
        )
    async with token_bucket(redis_server) as bucket:
        results = [await bucket.acquire(A, limits, reserve=1) for _ in range(7)]
    assert [(r.allowed, r.reserved) for r in results] == [(True, False)] * 3 + [
        (False, True)
    ] * 3 + [(False, False)]
    waits = [result.retry_after for result in results[3:6]]
    assert 0 < min(waits) <= max(waits) <= 1
    assert max(waits) - min(waits) < 0.1, "the same moment: the next window's start"
    assert 1 < results[6].retry_after <= 2


@async_test
async def test_reserved_moments_keep_every_window(redis_server: RedisServer) -> None:
    """12 requests at once reserve their moments: 3 in any 1 s, and 5 in each fixed 2 s."""
    limits = limit(
        {"rate": "100/s", "burst": 10},
        {"rate": "3/s", "algorithm": SLIDING},
        {"rate": "5/2s", "algorithm": FIXED},
    )
    with redis.Redis.from_url(redis_server.url) as client:
        # All in one fixed window's time: the hash keeps the windows from the current one on.
        await wait_until_async(
            lambda: redis_now_us(client) % 2_000_000 < 1_500_000, "the start of a window"
        )
        async with token_bucket(redis_server) as bucket:
            results = [await bucket.acquire(A, limits, reserve=10) for _ in range(12)]
            moments = logged(client, KEY)
            windows = client.hget(KEY + QUOTA_SUFFIX, "f5/2000000").split()
    assert [result.allowed for result in results] == [True] * 3 + [False] * 9
    assert all(result.reserved for result in results[3:])
    assert [result.tokens_left for result in results[:3]] == [2, 1, 0]
    assert len(moments) == 12
    assert busiest_window(moments, 1_000_000) == 3
    by_window = {
        int(start): int(count) for start, count in zip(windows[::2], windows[1::2], strict=True)
    }
    assert sum(by_window.values()) == 12
    assert max(by_window.values()) == 5
    assert by_window == {
        window: sum(1 for moment in moments if moment // 2_000_000 == window)
        for window in by_window
    }


@async_test
async def test_a_sliding_window_never_allows_more_than_its_count_in_any_window(
    redis_server: RedisServer,
) -> None:
    """Four callers on two connections ask as fast as they may for 3 s, two of them reserving
    their moments as the middleware does: 5 per 0.5 s."""
    # A second, loose window keeps the log of every request for a minute: the moments they
    # went, in Redis's clock, to the microsecond.
    limits = limit(
        {"rate": "5/0.5s", "algorithm": SLIDING}, {"rate": "1000/m", "algorithm": SLIDING}
    )
    granted = 0

    async def caller(bucket: Any, until: float, reserve: float) -> None:
        nonlocal granted
        while time.monotonic() < until:
            result = await bucket.acquire(A, limits, reserve=reserve)
            if result.allowed or result.reserved:
                granted += 1
            await asyncio.sleep(result.retry_after)

    until = time.monotonic() + 3
    async with token_bucket(redis_server) as one, token_bucket(redis_server) as other:
        await asyncio.gather(
            *(caller(bucket, until, reserve) for bucket in (one, other) for reserve in (0, 5))
        )
    with redis.Redis.from_url(redis_server.url) as client:
        moments = logged(client, KEY)
    assert len(moments) == granted >= 10
    assert busiest_window(moments, 500_000) == 5


@async_test
async def test_tokens_taken_while_redis_failed_count_in_the_bucket_not_in_its_quotas(
    redis_server: RedisServer,
) -> None:
    """``busy_until`` (the bucket is not full before then) is the domain's own bucket's."""
    limits = limit({"rate": "100/h", "burst": 100}, "1/s")
    async with token_bucket(redis_server) as bucket:
        assert (await bucket.acquire(A, limits)).allowed
        loop = asyncio.get_running_loop()
        second = await bucket.acquire(A, limits, reserve=60, busy_until=loop.time() + 36)
    assert second.reserved
    assert second.retry_after <= 1, "the quota's 1/s, not the bucket's 36 s"


def test_the_script_checks_each_limit(redis_server: RedisServer) -> None:
    keys = [KEY, KEY + ":rate", KEY + QUOTA_SUFFIX, KEY + LOG_SUFFIX]
    with redis.Redis.from_url(redis_server.url) as client:
        script = client.register_script(load_script("token_bucket.lua"))
        base = ["100000", "5", "1", "0", "0", "0", "0"]  # ... busy_until, not_before, alone
        for extra, message in [
            (["x", "5", "1000000"], "limit 1 must be t, f or s"),
            (["s", "0", "1000000"], "limit 1 must be t, f or s"),
            (["f", "1.5", "1000000"], "whole count"),
            (["t", "1.5", "1000000"], "whole count"),
            (["s", "1", "28941164.74"], "whole for windows"),
            (["s", "5", "-1"], "a period > 0"),
            (["s", "5"], "got s 5 nil"),
            (["s", "10001", "1000000"], "at most 10000 for s"),
            (["t", "1", "1000000"] * 17, "at most 16 more limits, got 17"),
        ]:
            with pytest.raises(redis.ResponseError, match=message):
                script(keys=keys, args=base + extra)
        with pytest.raises(redis.ResponseError, match="cost 3 exceeds limit 2's count 2"):
            script(keys=keys, args=[*base[:2], "3", *base[3:], "t", "5", "1", "s", "2", "1e6"])
        assert client.keys("*") == [], "nothing written"


@async_test
async def test_a_request_costs_at_most_a_live_quota_count(redis_server: RedisServer) -> None:
    """As a live burst does: the workers' own limit allowed the cost, so it goes."""
    with redis.Redis.from_url(redis_server.url) as client:
        LiveControl(client, "ns").set(
            A, 10, None, limit({"rate": "3/s", "algorithm": FIXED}).quotas
        )
        async with token_bucket(redis_server) as bucket:
            result = await bucket.acquire(A, limit({"rate": "10/s", "burst": 10}), cost=5)
        assert result.allowed
        assert client.hget(KEY + QUOTA_SUFFIX, "f3/1000000").split()[1] == b"3"


@async_test
async def test_quotas_set_live_apply_to_workers_that_have_none(redis_server: RedisServer) -> None:
    plain = limit("10/s")
    with redis.Redis.from_url(redis_server.url) as client:
        control = LiveControl(client, "ns")
        window = limit({"rate": "2/m", "algorithm": SLIDING})
        change = control.set(A, 100, 5, window.quotas)
        assert str(change.live) == "100/s (burst 5) and 2/60s (sliding window)"

        async def three() -> list[Any]:
            async with token_bucket(redis_server) as bucket:
                return [await bucket.acquire(A, plain) for _ in range(3)]

        results = await three()
        assert [r.allowed for r in results] == [True, True, False]
        assert 59 <= results[2].retry_after <= 60
        assert client.zcard(KEY + LOG_SUFFIX) == 2

        control.delete(A)
        back = await three()
        assert back[0].allowed, "the workers' own limit again: no window"
        assert client.zcard(KEY + LOG_SUFFIX) == 2


def tool(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scrapy_redis_throttle.cli", "--redis-url", redis_url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@async_test
async def test_the_tool_sets_several_limits(redis_server: RedisServer) -> None:
    url = redis_server.url
    done = tool(url, "--key-prefix", "ns", "set", A, "5/s", "fixed_window:1000/h", "--burst", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{A}: 5/s (burst 2) and 1000/3600s (fixed window)\n"
    done = tool(url, "--key-prefix", "ns", "set", B, "sliding_window:10/2s")
    assert done.stdout == f"{B}: 5/s (burst 10) and 10/2s (sliding window)\n"
    with redis.Redis.from_url(url) as client:
        assert client.get(bucket_key("ns", A)).endswith(b" 5.0 2 0 f1000/3600000000")

        async with token_bucket(redis_server) as bucket:
            results = [await bucket.acquire(B, limit("1/s")) for _ in range(11)]
    assert [r.allowed for r in results] == [True] * 10 + [False]

    for args, message in [
        (["set", A, "hourly:5/s"], "LIMIT[0]: unknown algorithm 'hourly'"),
        (["set", A, "sliding_window:2.5/s"], "counts whole requests"),
        (["set", A, "sliding_window:10/2s", "--burst", "3"], "only a token bucket has a burst"),
    ]:
        done = tool(url, *args)
        assert done.returncode == EXIT_BAD_INPUT
        assert message in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["set", "1", "-", "ch", "n", "f1.5/10"],
        ["set", "1", "-", "ch", "n", "t1.5/10"],
        ["set", "1", "-", "ch", "n", "f1/10.5"],
        ["set", "1", "-", "ch", "n", "t 5/2e5"],
        ["set", "1", "-", "ch", "n", "t1/10,x"],
        ["set", "1", "-", "ch", "n", "s0/10"],
        ["set", "1", "-", "ch", "n", "s10001/10"],
        ["set", "1", "-", "ch", "n", ",".join(["t1/10"] * 17)],
        ["set", "-", "-", "ch", "n", "t1/10"],  # quotas come with a rate
    ],
)
def test_set_limit_checks_the_quotas(redis_server: RedisServer, args: list[str]) -> None:
    with redis.Redis.from_url(redis_server.url) as client:
        script = client.register_script(load_script("set_limit.lua"))
        with pytest.raises(redis.ResponseError, match="more limits with a rate"):
            script(keys=[KEY, KEY + ":penalty"], args=args)


def test_a_fleet_keeps_to_a_sliding_window(redis_server: RedisServer) -> None:
    """Three worker processes crawl A limited to 10 per 2 s (sliding): 60 pages take 10 s."""
    # The loose second window keeps the log of a minute: the moments every request went.
    rates = {A: [{"rate": "10/2s", "algorithm": SLIDING}, {"rate": "1000/m", "algorithm": SLIDING}]}
    with DemoSite(HOSTS, pages=60) as site:
        jobs = one_domain_jobs(site, A, crawl_settings(redis_server.url), rates, 3, 20)
        finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 120)
        arrivals = [arrival.wall_time for arrival in site.arrivals(A)]
    with redis.Redis.from_url(redis_server.url) as client:
        moments = logged(client, bucket_key("redis_throttle", A))

    assert len(arrivals) == 60
    # The log also keeps the moment of a request whose busy worker missed it and asked anew.
    assert len(moments) >= 60
    assert max(moments) - min(moments) > 10_000_000, "60 at 10 per 2 s: over 10 s"
    # Exact in Redis's clock: no 2 s window holds more than 10...
    assert busiest_window(moments, 2_000_000) == 10
    # ...and the site saw none before its moment.
    assert_never_early(arrivals, [EPOCH + moment / 1e6 for moment in moments], A)


@async_test
async def test_the_workers_report_what_they_do(redis_server: RedisServer, site: DemoSite) -> None:
    """While a crawl waits for A's turns, its report counts the requests that went in the last
    minute and those waiting; the report goes when the crawl ends."""
    client = redis.Redis.from_url(redis_server.url)
    control = LiveControl(client, "redis_throttle")
    seen: list[dict[str, FleetActivity]] = []

    def busy() -> bool:
        seen.append(control.activity())
        activity = seen[-1].get(A, FleetActivity(0, 0, 0))
        return activity.went >= 2 and activity.waiting >= 2

    crawl = asyncio.ensure_future(
        run_crawl(
            crawl_settings(redis_server.url, REDIS_THROTTLE_REPORT_INTERVAL=0.1),
            pages(site, A, 10),
            redis_throttle_rates={A: "5/s"},
        )
    )
    await wait_until_async(busy, "a report of A's requests going and waiting")
    await crawl
    assert control.activity() == {}, "a worker that stops takes its report away"
    client.close()


@async_test
async def test_parked_requests_count_as_waiting_until_they_come_back(
    redis_server: RedisServer, site: DemoSite
) -> None:
    parked = parked_counts_key("redis_throttle")
    client = redis.Redis.from_url(redis_server.url)
    control = LiveControl(client, "redis_throttle")

    def some_parked() -> bool:
        activity = control.activity().get(A, FleetActivity(0, 0, 0))
        return int(client.hget(parked, A) or 0) >= 2 and activity.parked >= 2

    settings = crawl_settings(
        redis_server.url,
        SCHEDULER="scrapy_redis_throttle.ThrottleScheduler",
        REDIS_THROTTLE_MAX_HOLD=0,
        REDIS_THROTTLE_REPORT_INTERVAL=0.1,
    )
    crawl = asyncio.ensure_future(
        run_crawl(settings, pages(site, A, 8), redis_throttle_rates={A: "4/s"})
    )
    await wait_until_async(some_parked, "2 of A's requests reported parked")
    crawler = await crawl
    assert crawler.stats.get_value("redis_throttle/parked") >= 2
    assert not client.exists(parked), "each came back: their counts left the hash"
    client.close()


def test_parked_counts_leave_the_hash_at_zero(redis_server: RedisServer) -> None:
    key = parked_counts_key("ns")
    with redis.Redis.from_url(redis_server.url) as client:
        script = client.register_script(load_script("parked.lua"))
        assert script(keys=[key], args=[60_000, A, 2, B, -1]) == 2
        assert client.hgetall(key) == {A.encode(): b"2", B.encode(): b"-1"}
        assert 0 < client.pttl(key) <= 60_000
        script(keys=[key], args=[60_000, A, -2, B, 1])
        assert not client.exists(key)
        for args in ([0], [60_000, A], [60_000, A, 1.5], ["soon", A, 1]):
            with pytest.raises(redis.ResponseError, match="parked takes an expiry"):
                script(keys=[key], args=args)
        assert not client.exists(key)


def test_status_shows_the_fleets_activity(redis_server: RedisServer) -> None:
    """Two worker processes crawl A at 2/s: ``status`` shows both live, and the requests of
    the last minute and those waiting, added up. (A worker counts live for three report
    intervals after its last report, 0.6 s here: one stalled longer on a loaded machine is
    not, for that look.)"""
    with DemoSite(HOSTS, pages=20) as site:
        settings = crawl_settings(redis_server.url, REDIS_THROTTLE_REPORT_INTERVAL=0.2)
        # 8 pages each: at 2/s, the fleet has requests gone and waiting for some 6 s, several
        # of the tool's looks even under load.
        jobs = one_domain_jobs(site, A, settings, {A: "2/s"}, 2, 8)
        workers = start_crawl_workers(redis_server.url, jobs)
        lines: list[str] = []

        def shown() -> bool:
            lines[:] = tool(redis_server.url, "status").stdout.splitlines()
            rows = [line for line in lines if line.startswith(A)]
            # domain, limit..., tokens left, full in ("x.x s"), last minute, achieved, waiting,
            match = re.search(r" s\s+(\d+)\s+(\S+)\s+(\d+)\s", rows[0]) if rows else None
            return (
                lines[:1] == ["2 workers live"]
                and match is not None
                and int(match[1]) >= 2
                and int(match[3]) >= 4
            )

        wait_until(shown, 60, "a status of 2 workers live, A's row with requests gone and waiting")
        finish_crawl_workers(workers, 60)
    assert "full in  last minute  achieved  waiting  penalty pause" in lines[1]


@async_test
async def test_domains_with_live_quotas_are_remembered_within_a_bound(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past LIVE_QUOTAS_KEPT domains (a hostile Redis may set quotas on every one), the worker
    forgets them all: each one's next call is one more, and its quotas still apply."""
    monkeypatch.setattr(one_node, "LIVE_QUOTAS_KEPT", 3)
    window = limit({"rate": "1/m", "algorithm": SLIDING})
    domains = [f"d{n}.example" for n in range(7)]
    with redis.Redis.from_url(redis_server.url) as client:
        control = LiveControl(client, "ns")
        for domain in domains:
            control.set(domain, 100, 5, window.quotas)
        async with token_bucket(redis_server) as bucket:
            for domain in domains:
                assert (await bucket.acquire(domain, limit("10/s"))).allowed
                assert len(bucket.node._live_quotas) <= 3
            for domain in domains:
                assert not (await bucket.acquire(domain, limit("10/s"))).allowed, "1 a minute"
                assert len(bucket.node._live_quotas) <= 3


@async_test
async def test_a_request_of_a_sliding_windows_whole_count_is_logged_in_batches(
    redis_server: RedisServer,
) -> None:
    """A cost of 10,000 (the most a sliding window counts) adds 10,000 moments to the log, in
    ZADDs of 1,000: the window is full for the next request."""
    limits = limit({"rate": "10000/s", "burst": 10_000}, {"rate": "10000/h", "algorithm": SLIDING})
    with redis.Redis.from_url(redis_server.url) as client:
        async with token_bucket(redis_server) as bucket:
            first = await bucket.acquire(A, limits, cost=10_000)
            second = await bucket.acquire(A, limits)
        moments = logged(client, KEY)
    assert first.allowed
    assert not second.allowed, "the window holds the first request's 10,000"
    assert len(moments) == 10_000
    assert len(set(moments)) == 1, "all at the first request's moment"
    assert 3599 < second.retry_after <= 3600


@async_test
async def test_fixed_windows_reserve_at_most_64_windows_ahead(redis_server: RedisServer) -> None:
    """A window's state stays at most 65 windows long: a request due further ahead reserves
    nothing (and takes nothing) and asks again; of a hostile state of 100,000 windows, 65
    entries are read and the windows past 64 ahead dropped."""
    limits = limit("1000/s", {"rate": "1/0.1s", "algorithm": FIXED})
    field = "f1/100000"
    with redis.Redis.from_url(redis_server.url) as client:
        async with token_bucket(redis_server) as bucket:
            results = [await bucket.acquire(A, limits, reserve=60) for _ in range(70)]
            windows = client.hget(KEY + QUOTA_SUFFIX, field).split()[::2]
            current = redis_now_us(client) // 100_000
            far = " ".join(f"{current + 1000 + n} 1" for n in range(100_000))
            client.hset(KEY + QUOTA_SUFFIX, field, f"{current} 1 {far}")
            after_garbage = await bucket.acquire(A, limits, reserve=60)
            rewritten = client.hget(KEY + QUOTA_SUFFIX, field).split()[::2]
    reserved = [r for r in results if r.allowed or r.reserved]
    # One per window as far as 64 windows after the current one (which may move meanwhile).
    assert 65 <= len(reserved) < 70, "some are due too far ahead to reserve"
    assert all(not (r.allowed or r.reserved) for r in results[len(reserved) :])
    assert all(r.retry_after > 6.3 for r in results[len(reserved) :]), "they ask again then"
    assert len(windows) <= 65, "the current window and 64 after it, at most"
    assert after_garbage.allowed or after_garbage.reserved
    assert len(rewritten) <= 2, "the far windows are gone"


@async_test
async def test_a_request_due_too_many_windows_ahead_waits_for_its_window(
    redis_server: RedisServer,
) -> None:
    """70 requests to a domain with a fixed window of 1 per 0.1 s: those due over 64 windows
    ahead (about 6.5 s, within REDIS_THROTTLE_MAX_RESERVE) reserve nothing; each waits until
    then (parked) and asks again once, instead of asking again at once, and again (it did: a
    wait counted from REDIS_THROTTLE_MAX_RESERVE before it was over)."""
    with DemoSite([A], pages=70) as site:
        crawler = await run_crawl(
            crawl_settings(redis_server.url),
            pages(site, A, 70),
            redis_throttle_rates={A: [{"rate": "1000/s", "burst": 1000}, WINDOW_OF_ONE]},
        )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 70
    calls = stats["redis_throttle/redis_calls"]
    print(f"{calls} Redis calls for 70 requests")
    assert calls <= 70 + 2 * 10, f"{calls} Redis calls for 70 requests"
