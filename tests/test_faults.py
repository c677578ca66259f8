"""Real Redis faults during real crawls: every request is downloaded exactly once, the domain
keeps the chosen policy's pace during the fault, and shared limits resume after it.

The figures of every fault x policy are in ``./run bench faults``; these tests assert them for
the default policy, and the other policies on one fault each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from redis_faults import (
    FAULTS,
    MAX_RESERVE,
    PROBE_INTERVAL,
    RATE,
    REQUESTS,
    Fault,
    FaultRun,
    Lab,
    fault_settings,
    run_fault,
)
from support import (
    ARRIVAL_JITTER,
    assert_released_paced,
    async_test,
    finish_crawl_workers,
    run_crawl,
    start_crawl_workers,
    wait_until,
)
from tcp_proxy import TcpProxy

from scrapy_redis_throttle.config import DEFAULT_KEY_PREFIX
from scrapy_redis_throttle.control import LiveControl

A = HOSTS[0]


@pytest.fixture
def site() -> Iterator[DemoSite]:
    with DemoSite(HOSTS, pages=REQUESTS) as demo_site:
        yield demo_site


@pytest.fixture
def lab() -> Iterator[Lab]:
    with RedisServer() as server, RedisServer() as spare, TcpProxy(server.port) as proxy:
        yield Lab(server, proxy, spare)


def check_run(run: FaultRun, resumes: bool = True) -> None:
    """What every policy promises, whatever the fault. With *resumes*, requests were left after
    the fault, and shared limits must have come back for them."""
    assert run.lost == [], f"{run.fault.name}: never downloaded: {run.lost}"
    assert run.duplicated == [], f"{run.fault.name}: downloaded twice: {run.duplicated}"
    assert run.stats["test/responses"] == len(run.expected)
    if run.fault.noticed:
        assert run.outages >= 1, f"{run.fault.name} went unnoticed"
        assert run.stats["redis_throttle/fallback_time"] > 0
    if run.fault.noticed is False:
        assert run.outages == 0, f"{run.fault.name}: {run.stats}"
        assert not [key for key in run.stats if key.startswith("redis_throttle/redis_errors/")]
    if resumes:
        assert run.arrivals[-1].wall_time > run.recovered + 2 * PROBE_INTERVAL
        if run.outages:
            assert run.back_at is not None, f"{run.fault.name}: shared limits never resumed"
            assert any(a.wall_time > run.back_at for a in run.arrivals)


@pytest.mark.parametrize("fault", FAULTS, ids=[fault.name for fault in FAULTS])
@async_test
async def test_local_fallback_keeps_the_pace_through_the_fault(
    lab: Lab, site: DemoSite, fault: Fault
) -> None:
    run = await run_fault(lab, site, A, fault, "local")
    check_run(run)
    # One worker: the local pace is the shared one, and the switches (to local, and back to a
    # Redis bucket that forgot or never saw the local requests) line the two up. One token of
    # slack for scheduling noise at the switch.
    assert_released_paced(run.stats, run.arrivals, RATE, 1, A, extra=1)
    if run.outages:
        assert run.stats["redis_throttle/fallback/local"] > 0


@async_test
async def test_a_limit_set_live_holds_while_the_worker_paces_alone(
    lab: Lab, site: DemoSite
) -> None:
    """Set live at half the spider's rate before the crawl: Redis stalls for 8 s, and the
    worker, pacing alone, keeps to the limit set live, not to its own."""
    with redis.Redis.from_url(lab.server.url) as client:
        LiveControl(client, DEFAULT_KEY_PREFIX).set(A, RATE / 2, None)
    run = await run_fault(lab, site, A, FAULTS[1], "local", seconds=8.0)
    assert run.stats["redis_throttle/fallback/local"] > 0
    assert_released_paced(run.stats, run.arrivals, RATE / 2, 1, A, extra=1)
    check_run(run)


@async_test
async def test_open_policy_lets_requests_through_unthrottled(lab: Lab, site: DemoSite) -> None:
    run = await run_fault(lab, site, A, FAULTS[0], "open")
    check_run(run, resumes=False)  # nothing is left to crawl once the fault is over
    assert run.stats["redis_throttle/fallback/open"] > 0
    # Everything not already reserved went at once, well over the limit.
    assert run.busiest_second_during_fault() > 2 * RATE


@async_test
async def test_wait_policy_sends_nothing_new_during_the_fault(lab: Lab, site: DemoSite) -> None:
    run = await run_fault(lab, site, A, FAULTS[1], "wait")
    check_run(run)
    reserved_until = run.injected + MAX_RESERVE + ARRIVAL_JITTER
    assert [a for a in run.arrivals if reserved_until < a.wall_time < run.recovered] == []
    assert_released_paced(run.stats, run.arrivals, RATE, 1, A, extra=1)


def test_two_workers_share_the_limit_through_an_outage(site: DemoSite) -> None:
    """Two OS processes at 4/s together; Redis is killed for 3 s mid-crawl. With
    REDIS_THROTTLE_FALLBACK_WORKERS = 2 each paces itself at 2/s: together still 4/s (at once:
    REDIS_THROTTLE_FALLBACK_AFTER = 0, so that a 3 s outage shows the shares)."""
    rate = 4
    with RedisServer() as server:
        jobs = [
            {
                "settings": fault_settings(
                    server.url,
                    "local",
                    REDIS_THROTTLE_FALLBACK_WORKERS=2,
                    REDIS_THROTTLE_FALLBACK_AFTER=0,
                ),
                "requests": [
                    {"url": site.url(A, f"/page/{n}")} for n in range(20 * index, 20 * index + 20)
                ],
                "spider_attributes": {"redis_throttle_rates": {A: f"{rate}/s"}},
            }
            for index in range(2)
        ]
        workers = start_crawl_workers(server.url, jobs)
        wait_until(lambda: len(site.arrivals(A)) >= 8, 60, "8 arrivals before the outage")
        killed = time.monotonic()
        server.stop()
        wait_until(lambda: time.monotonic() > killed + 3, 10, "3 s of outage")
        restarted = time.monotonic()
        server.start()
        all_stats = finish_crawl_workers(workers, timeout=120)

    for stats in all_stats:
        assert stats["test/responses"] == 20
        assert stats["redis_throttle/outages"] == 1
        assert stats["redis_throttle/fallback/local"] > 0
    arrivals = site.arrivals(A)
    assert sorted(a.path for a in arrivals) == sorted(f"/page/{n}" for n in range(40))
    during = [a.time for a in arrivals if killed <= a.time < restarted]
    assert len(during) >= 2 * rate, "the workers did not keep crawling during the outage"
    # Both workers' local buckets start fresh after a switch: one token each.
    assert_released_paced(all_stats, arrivals, rate, 1, A, extra=2)


@async_test
async def test_scrapy_redis_queue_is_not_touched_by_a_throttle_outage(
    site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """With RedisThrottleScheduler and the throttle on its own Redis, parked requests live
    beside scrapy-redis's queue: killing the throttle's Redis loses none of them."""
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    with RedisServer() as queue_redis, RedisServer() as throttle_redis:
        settings = fault_settings(
            queue_redis.url,
            "local",
            SCHEDULER="scrapy_redis_throttle.RedisThrottleScheduler",
            DUPEFILTER_CLASS="scrapy_redis.dupefilter.RFPDupeFilter",
            REDIS_THROTTLE_URL=throttle_redis.url,
            # One worker alone: it paces locally though it never read the fleet's size.
            REDIS_THROTTLE_FALLBACK_WORKERS=1,
        )
        throttle_redis.stop()
        # 4/s: each request waits 0.25 s more than the one before, less the time the engine took
        # to hand it over (0.05 s in a CI run; at 10/s, the longest wait was 0.82 s there, and
        # none was parked), so that later ones wait over REDIS_THROTTLE_MAX_HOLD (1 s).
        rate = 4
        crawler = await run_crawl(
            settings,
            [{"url": site.url(A, f"/page/{n}")} for n in range(20)],
            redis_throttle_rates={A: f"{rate}/s"},
        )
        with queue_redis.client() as client:
            assert client.exists("url_list:requests:parked") == 0
    assert crawler.stats.get_value("test/responses") == 20
    assert crawler.stats.get_value("redis_throttle/parked") > 0
    assert sorted(a.path for a in site.arrivals(A)) == sorted(f"/page/{n}" for n in range(20))
    assert_released_paced(crawler.stats.get_stats(), site.arrivals(A), rate, 1, A)
