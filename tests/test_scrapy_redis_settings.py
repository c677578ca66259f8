"""scrapy-redis's scheduler settings, with parking: each one behaves as without the throttle,
in real crawls of a slow domain (whose requests are parked) beside a free one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

import pytest
import redis.asyncio
from demo_site import HOSTS, Arrival, DemoSite
from local_redis import RedisServer
from scrapy import Request, signals
from scrapy.utils.httpobj import urlparse_cached
from spiders import RedisUrlSpider
from support import (
    SCRAPY_REDIS,
    assert_released_paced,
    async_test,
    crawl_settings,
    pages,
    run_crawl,
)

SLOW, FREE, _ = HOSTS
RATES = {SLOW: "2/s"}  # each request after the first waits more than REDIS_THROTTLE_MAX_HOLD
SETTINGS = {**SCRAPY_REDIS, "REDIS_THROTTLE_MAX_HOLD": 0.2, "REDIS_THROTTLE_DEFAULT_RATE": None}


def crawled_once(site: DemoSite, host: str, count: int) -> list[Arrival]:
    """The arrivals of *host*'s pages 0 to count - 1, each fetched exactly once."""
    paths = Counter(a.path for a in site.arrivals(host))
    assert paths == {f"/page/{n}": 1 for n in range(count)}, f"{host}: {paths}"
    return site.arrivals(host)


@async_test
async def test_flush_on_start_empties_the_parked_requests_with_the_queue(
    redis_server: RedisServer, site: DemoSite
) -> None:
    settings = crawl_settings(redis_server.url, SCHEDULER_PERSIST=True, **SETTINGS)
    first = await run_crawl(
        {**settings, "CLOSESPIDER_TIMEOUT": 1}, pages(site, SLOW, 4), redis_throttle_rates=RATES
    )
    assert first.stats.get_value("redis_throttle/parked") >= 1
    with redis_server.client() as client:
        parked = client.zcard("url_list:requests:parked")
        assert parked >= 1, "kept, with SCHEDULER_PERSIST"
    crawled_before = len(site.arrivals(SLOW))

    second = await run_crawl(
        {**settings, "SCHEDULER_FLUSH_ON_START": True}, [], redis_throttle_rates=RATES
    )
    assert len(site.arrivals(SLOW)) == crawled_before, "the flushed requests are not crawled"
    assert "redis_throttle/parked_not_crawled" not in second.stats.get_stats()
    with redis_server.client() as client:
        assert client.keys("url_list:requests*") == [], "neither the queue nor the parked"


@async_test
async def test_parked_requests_wait_beside_a_queue_key_of_the_projects_own(
    redis_server: RedisServer, site: DemoSite
) -> None:
    parked_keys: set[bytes | str] = set()

    async def look() -> None:
        """The parked set's name, while the crawl runs: it exists while requests are parked
        (0.5 s and 1 s here), which responses alone may miss (one CI run saw none then)."""
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            while True:
                parked_keys.update(key for key in await client.keys("*parked*"))
                await asyncio.sleep(0.02)
        finally:
            await client.aclose()

    looking = asyncio.ensure_future(look())
    try:
        crawler = await run_crawl(
            crawl_settings(
                redis_server.url, SCHEDULER_QUEUE_KEY="shop:%(spider)s:todo", **SETTINGS
            ),
            pages(site, SLOW, 3) + pages(site, FREE, 10),
            redis_throttle_rates=RATES,
        )
    finally:
        looking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await looking
    stats = crawler.stats.get_stats()
    # Two, and again each one whose worker was too busy to send it at its moment.
    assert 2 <= stats["redis_throttle/parked"] <= 2 + stats.get("redis_throttle/missed_moments", 0)
    assert parked_keys >= {b"shop:url_list:todo:parked"}, parked_keys
    assert_released_paced(stats, crawled_once(site, SLOW, 3), 2, 1, SLOW)
    crawled_once(site, FREE, 10)


@async_test
async def test_parked_requests_come_back_past_scrapy_redis_dupefilter(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """Requests that the dupefilter sees (dont_filter=False), with its own key and debug log:
    a parked request comes back without meeting the dupefilter again; a duplicate is still
    filtered, once."""
    caplog.set_level(logging.DEBUG, logger="scrapy_redis")
    requests = [{**spec, "dont_filter": False} for spec in pages(site, SLOW, 3)]
    crawler = await run_crawl(
        crawl_settings(
            redis_server.url,
            SCHEDULER_DUPEFILTER_KEY="shop:%(spider)s:seen",
            DUPEFILTER_DEBUG=True,
            SCHEDULER_PERSIST=True,  # (else the close empties the dupefilter)
            **SETTINGS,
        ),
        [*requests, requests[1]],
        redis_throttle_rates=RATES,
    )
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/parked"] == 2
    filtered = [r.getMessage() for r in caplog.records if "Filtered duplicate" in r.getMessage()]
    assert filtered == [f"Filtered duplicate request: <GET {requests[1]['url']}>"]
    assert_released_paced(stats, crawled_once(site, SLOW, 3), 2, 1, SLOW)
    with redis_server.client() as client:
        assert client.scard("shop:url_list:seen") == 3


@async_test
async def test_parked_requests_come_back_with_a_blocking_fifo_queue(
    redis_server: RedisServer, site: DemoSite
) -> None:
    """SCHEDULER_IDLE_BEFORE_CLOSE: the queue waits that long for a request when it has none
    (a blocking pop, BRPOP, which blocks the reactor): never while requests wait in the throttle
    or are parked (held ones would wake late, parked ones come back late and miss their
    moments). Redis counts the blocking pops: none until the slow domain's last request went
    (without the guard, 26 to 31 in a crawl that took 30 s instead of 5)."""
    blocking_pops: list[int] = []
    with redis_server.client() as client:
        client.config_resetstat()

        def reached(request: Request) -> None:
            if urlparse_cached(request).hostname == SLOW:
                brpop = client.info("commandstats").get("cmdstat_brpop", {})
                blocking_pops.append(brpop.get("calls", 0))

        crawler = await run_crawl(
            crawl_settings(
                redis_server.url,
                SCHEDULER_QUEUE_CLASS="scrapy_redis.queue.FifoQueue",
                SCHEDULER_IDLE_BEFORE_CLOSE=1,
                **SETTINGS,
            ),
            pages(site, SLOW, 4) + pages(site, FREE, 10),
            handlers={signals.request_reached_downloader: reached},
            redis_throttle_rates=RATES,
        )
    assert blocking_pops == [0, 0, 0, 0]
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/parked"] >= 3
    assert_released_paced(stats, crawled_once(site, SLOW, 4), 2, 1, SLOW)
    crawled_once(site, FREE, 10)


@async_test
async def test_a_redis_spider_fed_from_redis_keeps_its_parked_requests(
    redis_server: RedisServer, site: DemoSite
) -> None:
    """scrapy-redis's RedisSpider takes its URLs from Redis two at a time, whenever it idles;
    the spider does not idle (nor close, after MAX_IDLE_TIME_BEFORE_CLOSE) while requests are
    parked, and each is crawled once, paced."""
    urls = [spec["url"] for spec in pages(site, SLOW, 4) + pages(site, FREE, 4)]
    with redis_server.client() as client:
        client.rpush("redis_urls:start_urls", *urls)
    crawler = await run_crawl(
        crawl_settings(
            redis_server.url,
            REDIS_START_URLS_BATCH_SIZE=2,
            MAX_IDLE_TIME_BEFORE_CLOSE=1,
            **SETTINGS,
        ),
        [],
        spider=RedisUrlSpider,
        redis_throttle_rates=RATES,
    )
    assert crawler.stats.get_value("test/responses") == 8
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/parked"] >= 1
    assert_released_paced(stats, crawled_once(site, SLOW, 4), 2, 1, SLOW)
    crawled_once(site, FREE, 4)
