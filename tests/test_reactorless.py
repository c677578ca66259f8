"""Scrapy without a Twisted reactor (``TWISTED_REACTOR_ENABLED = False``, Scrapy 2.15 and later):
the throttle waits with asyncio's sleeps there, where importing the reactor is forbidden.

Each crawl runs in OS processes of their own (``crawl_worker.py``, with Scrapy's
``AsyncCrawlerProcess``): the test process runs a reactor, which that mode refuses.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from metrics_scrape import REQUESTS, WAITS, samples, value
from support import (
    achieved_rate,
    assert_released_paced,
    crawl_settings,
    finish_crawl_workers,
    missed_moments,
    pages,
    start_crawl_workers,
)

A = HOSTS[0]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("scrapy.utils.reactorless") is None,
    reason="this Scrapy has no reactorless mode (TWISTED_REACTOR_ENABLED, Scrapy 2.15+)",
)

SCHEDULERS = {
    "Scrapy's scheduler": {},
    "scrapy-redis's scheduler": {
        "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
    },
}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_two_reactorless_workers_share_one_budget_and_park(
    redis_server: RedisServer, site: DemoSite, scheduler: str
) -> None:
    """Two workers without a reactor, 10 requests each to A at 4/s: together at 4/s, the
    requests that must wait long parked (REDIS_THROTTLE_MAX_HOLD 1 s) and back at their
    moments."""
    settings: dict[str, Any] = crawl_settings(
        redis_server.url,
        TWISTED_REACTOR_ENABLED=False,
        LOG_LEVEL="INFO",
        REDIS_THROTTLE_MAX_HOLD=1.0,
        REDIS_THROTTLE_METRICS_PORT=0,
        **SCHEDULERS[scheduler],
    )
    jobs = [
        {
            "settings": settings,
            "requests": pages(site, A, 10, first=10 * index),
            "spider_attributes": {"redis_throttle_rates": {A: "4/s"}},
            "scrape_metrics": True,
        }
        for index in range(2)
    ]
    logs: list[str] = []
    all_stats = finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 60, logs)

    for log in logs:
        assert "Traceback" not in log, log[-3000:]
    assert sum(stats.get("test/responses", 0) for stats in all_stats) == 20
    assert not [key for stats in all_stats for key in stats if key.startswith("test/failures")]
    assert sum(stats.get("redis_throttle/parked", 0) for stats in all_stats) > 0, "none parked"
    assert len(site.arrivals(A)) == 20
    assert_released_paced(all_stats, site.arrivals(A), 4, 1, A)
    times = [arrival.time for arrival in site.arrivals(A)]
    assert achieved_rate(times, 1, missed_moments(all_stats, A)) >= 0.9 * 4
    # Each worker served its /metrics without a reactor: together, what the site saw.
    scraped = [samples(stats["worker/metrics"]) for stats in all_stats]
    assert sum(value(s, REQUESTS, domain=A, result="acquired") for s in scraped) == 20
    assert sum(value(s, WAITS, domain=A) for s in scraped) == 20
