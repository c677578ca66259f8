"""Test support: async tests, server-side pacing checks, in-process crawls; and, from
:mod:`processes`, bounded waits and crawls in worker processes."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest_twisted
from processes import WORKER, finish_crawl_workers, start_crawl_workers, wait_until
from redis.asyncio import Redis
from scrapy.crawler import CrawlerRunner
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from spiders import BASE_SETTINGS, UrlListSpider
from twisted.internet.defer import Deferred

from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.control import SCRIPT_EPOCH

if TYPE_CHECKING:
    import redis
    from demo_site import DemoSite
    from local_redis import RedisServer
    from scrapy.crawler import Crawler


def redis_now_us(client: redis.Redis) -> int:
    """Redis's time as the scripts count it."""
    seconds, micros = client.time()
    return int((seconds - SCRIPT_EPOCH) * 1_000_000 + micros)


@asynccontextmanager
async def token_bucket(
    server: RedisServer, prefix: str = "ns", adaptive: bool = False
) -> AsyncIterator[TokenBucket]:
    """A worker's view of the shared buckets in *server*, as the middleware has it."""
    client = Redis.from_url(server.url)
    bucket = TokenBucket(client, prefix, adaptive=adaptive)
    try:
        yield bucket
    finally:
        await bucket.aclose()
        await client.aclose()


async def wait_until_async(
    predicate: Callable[[], object], message: str, timeout: float = 30
) -> None:
    """:func:`wait_until` for async tests: the reactor's loop goes on meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        await asyncio.sleep(0.02)


def async_test(func: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., Deferred[None]]:
    """Run an ``async def`` test as an asyncio task on the reactor's loop, the way Scrapy runs
    coroutines (pytest-twisted's own decorator cannot await asyncio futures)."""

    @pytest_twisted.inlineCallbacks  # type: ignore[untyped-decorator]
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Generator[Deferred[None], None, None]:
        yield deferred_from_coro(func(*args, **kwargs))

    return wrapper  # type: ignore[no-any-return]


# Server-side arrival times may be squeezed by this much by uneven network and thread latency.
ARRIVAL_JITTER = 0.1


def assert_paced(
    times: list[float],
    rate: float,
    burst: int,
    what: str,
    jitter: float = ARRIVAL_JITTER,
    extra: int = 0,
) -> None:
    """No window [t_i, t_j] of *times* holds more than ``burst + rate * (t_j - t_i)`` arrivals,
    give or take *jitter* seconds on the window's length and *extra* arrivals."""
    times = sorted(times)
    for i, first in enumerate(times):
        for j in range(i, len(times)):
            allowed = burst + rate * (times[j] - first + jitter) + extra
            assert j - i + 1 <= allowed, (
                f"{what}: {j - i + 1} arrivals within {times[j] - first:.3f} s "
                f"(limit {rate}/s, burst {burst}: at most {allowed:.2f})"
            )


def achieved_rate(times: list[float], burst: int) -> float:
    """Requests per second after the initial burst, over the busy period."""
    times = sorted(times)
    return (len(times) - burst) / (times[-1] - times[0])


def pages(
    site: DemoSite, host: str, count: int, first: int = 0, **meta: Any
) -> list[dict[str, Any]]:
    """Requests (for :class:`spiders.UrlListSpider`) of *count* pages of *host* from *first*."""
    return [
        {"url": site.url(host, f"/page/{n}"), "meta": meta} for n in range(first, first + count)
    ]


def crawl_settings(redis_url: str, **overrides: Any) -> dict[str, Any]:
    return {**BASE_SETTINGS, "REDIS_URL": redis_url, **overrides}


async def run_crawl(
    settings: dict[str, Any], requests: list[dict[str, Any]], **spider_attributes: Any
) -> Crawler:
    """Run one in-process crawl to its end and return its crawler (for its stats)."""
    runner = CrawlerRunner(settings)
    crawler = runner.create_crawler(UrlListSpider)
    await maybe_deferred_to_future(runner.crawl(crawler, requests=requests, **spider_attributes))
    return crawler


__all__ = [
    "WORKER",
    "achieved_rate",
    "assert_paced",
    "async_test",
    "crawl_settings",
    "finish_crawl_workers",
    "pages",
    "redis_now_us",
    "run_crawl",
    "start_crawl_workers",
    "token_bucket",
    "wait_until",
    "wait_until_async",
]
