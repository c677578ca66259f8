"""robots.txt Crawl-delay as a host's shared limit, measured where the requests arrive."""

from __future__ import annotations

import asyncio
import logging
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import pytest
from demo_site import HOSTS, Arrival, DemoSite
from local_redis import RedisServer
from scrapy import Request, Spider, signals
from scrapy.downloadermiddlewares.robotstxt import RobotsTxtMiddleware
from scrapy.robotstxt import ProtegoRobotParser
from scrapy.utils.httpobj import urlparse_cached
from support import (
    ARRIVAL_JITTER,
    assert_never_early,
    assert_released_paced,
    async_test,
    crawl_settings,
    finish_crawl_workers,
    one_domain_jobs,
    pages,
    released,
    run_crawl,
    start_crawl_workers,
)

from scrapy_redis_throttle import Limit, RedisThrottleMiddleware, crawl_delay
from scrapy_redis_throttle.crawl_delay import MAX_HOSTS, with_crawl_delay
from scrapy_redis_throttle.throttle import Throttle

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

A, B, C = HOSTS
HAS_ROBOTS_SIGNAL = hasattr(signals, "robots_parsed")
needs_robots_signal = pytest.mark.skipif(
    not HAS_ROBOTS_SIGNAL, reason="Scrapy < 2.18 has no robots_parsed signal"
)


def robots(delay: float) -> str:
    return f"User-agent: *\nCrawl-delay: {delay:g}\nAllow: /\n"


def page_arrivals(site: DemoSite, host: str) -> list[Arrival]:
    """The arrivals of *host*'s pages (robots.txt left out), in order."""
    return [a for a in site.arrivals(host) if a.path != "/robots.txt"]


def page_times(site: DemoSite, host: str) -> list[float]:
    return sorted(a.time for a in page_arrivals(site, host))


def gaps(times: list[float]) -> list[float]:
    return [later - earlier for earlier, later in pairwise(times)]


@pytest.mark.parametrize(
    ("configured", "delay", "expected"),
    [
        (None, 2.0, Limit(0.5, 1, "")),  # unlimited: one request per delay
        (Limit(5, 3, "5/s"), 2.0, Limit(0.5, 1, "")),  # faster than the delay: slowed down
        (Limit(0.1, 3, "1/10s"), 2.0, Limit(0.1, 1, "")),  # stricter: its rate, burst 1
        (Limit(0.5, 1, "1/2s"), 2.0, Limit(0.5, 1, "")),
    ],
)
def test_crawl_delay_never_raises_a_stricter_limit(
    configured: Limit | None, delay: float, expected: Limit
) -> None:
    assert with_crawl_delay(configured, delay) == expected


@needs_robots_signal
@async_test
async def test_crawl_delay_becomes_the_hosts_limit(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    # A asks for 0.5 s; B for 60 s, capped at 1 s; C has no robots.txt (404: allow all).
    with DemoSite(HOSTS, pages=10, robots={A: robots(0.5), B: robots(60)}) as site:
        crawler = await run_crawl(
            crawl_settings(redis_server.url, ROBOTSTXT_OBEY=True, REDIS_THROTTLE_MAX_CRAWL_DELAY=1),
            pages(site, A, 4) + pages(site, B, 3) + pages(site, C, 6),
            redis_throttle_rates={A: "5/s", B: "5/s", C: "5/s"},
        )
        stats = crawler.stats.get_stats()
        for host, delay in ((A, 0.5), (B, 1)):
            went = released(stats, host)
            assert min(gaps(went)) >= delay - ARRIVAL_JITTER, f"{host}, as released: {went}"
            assert_never_early([a.wall_time for a in page_arrivals(site, host)], went, host)
        assert_released_paced(stats, page_arrivals(site, C), 5, 1, C)
        assert min(gaps(page_times(site, C))) < 0.5, "C has no Crawl-delay: it goes at its 5/s"
        assert {a.path for a in site.arrivals(A)} >= {"/robots.txt"}

    assert stats["test/responses"] == 13
    assert stats["redis_throttle/crawl_delay/applied"] == 2
    assert stats["redis_throttle/crawl_delay/capped"] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        f"Crawl-delay of 0.5 s in the robots.txt of '{A}': the limit of '{A}' is now 1/0.5s" in m
        for m in messages
    ), messages
    assert any(f"'{B}' asks for a Crawl-delay of 60 s; honouring 1 s" in m for m in messages)
    assert any(f"Crawl-delay of 1 s in the robots.txt of '{B}'" in m for m in messages)


@needs_robots_signal
@async_test
async def test_crawl_delay_can_be_switched_off(redis_server: RedisServer) -> None:
    with DemoSite(HOSTS, pages=10, robots={A: robots(1)}) as site:
        crawler = await run_crawl(
            crawl_settings(
                redis_server.url, ROBOTSTXT_OBEY=True, REDIS_THROTTLE_CRAWL_DELAY_ENABLED=False
            ),
            pages(site, A, 6),
            redis_throttle_rates={A: "5/s"},
        )
        times = page_times(site, A)
        assert_released_paced(crawler.stats.get_stats(), page_arrivals(site, A), 5, 1, A)
    assert len(times) == 6
    assert max(gaps(times)) < 1, "paced at its configured 5/s, not by the Crawl-delay"
    assert "redis_throttle/crawl_delay/applied" not in crawler.stats.get_stats()


@pytest.mark.skipif(HAS_ROBOTS_SIGNAL, reason="Scrapy 2.18+ honours Crawl-delay")
@async_test
async def test_old_scrapy_says_crawl_delay_is_not_honoured(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    with DemoSite(HOSTS, pages=10, robots={A: robots(1)}) as site:
        await run_crawl(
            crawl_settings(redis_server.url, ROBOTSTXT_OBEY=True),
            pages(site, A, 2),
            redis_throttle_rates={A: "5/s"},
        )
    assert any(
        "robots.txt Crawl-delay is NOT honoured: that needs Scrapy 2.18" in r.getMessage()
        for r in caplog.records
    )


@needs_robots_signal
def test_a_fleet_keeps_the_crawl_delay_between_all_its_requests(
    redis_server: RedisServer,
) -> None:
    """Three worker processes, one host whose robots.txt asks for 2 s: its pages arrive at
    least 2 s apart, whichever worker sent them."""
    workers_count, pages_each = 3, 2
    with DemoSite(HOSTS, pages=10, robots={A: robots(2)}) as site:
        jobs = one_domain_jobs(
            site,
            A,
            crawl_settings(redis_server.url, ROBOTSTXT_OBEY=True),
            {A: "5/s"},
            workers_count,
            pages_each,
        )
        all_stats = finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 90)
        times = page_times(site, A)
        robots_fetches = [a for a in site.arrivals(A) if a.path == "/robots.txt"]

    assert len(times) == workers_count * pages_each
    went = released(all_stats, A)
    assert min(gaps(went)) >= 2 - ARRIVAL_JITTER, f"as released: {gaps(went)}"
    assert_never_early([a.wall_time for a in page_arrivals(site, A)], went, A)
    assert len(robots_fetches) == workers_count, "each worker reads robots.txt once"
    for stats in all_stats:
        assert stats["test/responses"] == pages_each
        assert stats["redis_throttle/crawl_delay/applied"] == 1


def throttle_of(crawler: Crawler) -> Throttle:
    [middleware] = [
        m
        for m in crawler.engine.downloader.middleware.middlewares
        if isinstance(m, RedisThrottleMiddleware)
    ]
    return middleware.throttle


@needs_robots_signal
@async_test
async def test_the_crawl_delays_of_100000_hosts_keep_a_bounded_memory(
    redis_server: RedisServer,
) -> None:
    """100,000 hosts' robots.txt ask for a Crawl-delay, as RobotsTxtMiddleware reports them (its
    signal, its cache): the worker keeps the last MAX_HOSTS, and the robots.txt of the hosts it
    forgot leave Scrapy's cache too (their next request fetches it again)."""
    kept: dict[str, Any] = {}
    parser = ProtegoRobotParser(robots(2).encode(), None)

    def opened(spider: Spider) -> None:
        crawler = spider.crawler
        [robots_middleware] = [
            m
            for m in crawler.engine.downloader.middleware.middlewares
            if isinstance(m, RobotsTxtMiddleware)
        ]
        for n in range(100_000):
            netloc = f"host{n}.example"
            crawler.signals.send_catch_log(
                signal=signals.robots_parsed,
                robotparser=parser,
                request=Request(f"http://{netloc}/page"),
            )
            robots_middleware._parsers[netloc] = parser  # as Scrapy keeps it, after the signal
        kept.update(throttle=throttle_of(crawler), robots=robots_middleware._parsers)

    crawler = await run_crawl(
        crawl_settings(redis_server.url, ROBOTSTXT_OBEY=True), [], {signals.spider_opened: opened}
    )
    delays = kept["throttle"].crawl_delays
    assert len(delays._limits) == MAX_HOSTS
    assert len(kept["robots"]) == MAX_HOSTS
    assert crawler.stats.get_value("redis_throttle/crawl_delay/forgotten") == 100_000 - MAX_HOSTS
    assert delays.limit("host99999.example", None).rate == 0.5, "the latest are kept"
    assert delays.limit("host0.example", None) is None, "the first forgotten"
    assert "host0.example" not in kept["robots"], "and fetched again at its next request"


def alternating(site: DemoSite) -> list[dict[str, Any]]:
    return [
        spec for pair in zip(pages(site, A, 5), pages(site, B, 5), strict=True) for spec in pair
    ]


@needs_robots_signal
@async_test
async def test_a_forgotten_crawl_delay_comes_back_with_its_robots_txt(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for one host's delay, two hosts whose requests alternate, one at a time: each
    robots.txt of one forgets the other's delay, whose next request fetches robots.txt again;
    both keep theirs. (Two robots.txt parsed at once are both kept: see the next test.)"""
    monkeypatch.setattr(crawl_delay, "MAX_HOSTS", 1)
    with DemoSite(HOSTS, pages=10, robots={A: robots(0.5), B: robots(0.5)}) as site:
        crawler = await run_crawl(
            crawl_settings(
                redis_server.url,
                ROBOTSTXT_OBEY=True,
                REDIS_THROTTLE_DEFAULT_RATE=None,
                CONCURRENT_REQUESTS=1,
            ),
            alternating(site),
        )
        robots_fetches = {
            host: sum(a.path == "/robots.txt" for a in site.arrivals(host)) for host in (A, B)
        }
        arrivals = {host: page_arrivals(site, host) for host in (A, B)}
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/crawl_delay/forgotten"] >= 2
    assert min(robots_fetches.values()) >= 2, robots_fetches
    for host in (A, B):
        assert len(arrivals[host]) == 5
        assert_released_paced(stats, arrivals[host], 2, 1, host)


@needs_robots_signal
@async_test
async def test_a_host_whose_robots_txt_scrapy_has_not_stored_yet_is_not_forgotten(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scrapy sends robots_parsed (and waits for its handlers) before it stores the robots.txt
    parsed: a host forgotten then would keep it stored, and never have its delay again. With
    room for one host, each robots.txt is held in its signal (by a handler of this test) until
    the other's is parsed, whichever comes first: both keep their delays."""
    monkeypatch.setattr(crawl_delay, "MAX_HOSTS", 1)
    parsed = {A: asyncio.Event(), B: asyncio.Event()}

    async def hold_each_until_the_other(robotparser: object, request: Request) -> None:
        host = urlparse_cached(request).hostname
        parsed[host or ""].set()
        await asyncio.wait_for(parsed[B if host == A else A].wait(), 10)

    with DemoSite(HOSTS, pages=10, robots={A: robots(0.5), B: robots(0.5)}) as site:
        crawler = await run_crawl(
            crawl_settings(redis_server.url, ROBOTSTXT_OBEY=True, REDIS_THROTTLE_DEFAULT_RATE=None),
            alternating(site),
            {signals.robots_parsed: hold_each_until_the_other},
        )
        arrivals = {host: page_arrivals(site, host) for host in (A, B)}
    stats = crawler.stats.get_stats()
    assert "redis_throttle/crawl_delay/forgotten" not in stats, "neither was stored yet"
    assert "log_count/ERROR" not in stats, "RobotsTxtMiddleware lost a robots.txt"
    for host in (A, B):
        assert len(arrivals[host]) == 5
        assert_released_paced(stats, arrivals[host], 2, 1, host)
