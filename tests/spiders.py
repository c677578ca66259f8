"""The spider of the tests and benchmarks (no pytest needed, so the benchmarks can use it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from releases import EXTENSION as RELEASES_EXTENSION
from scrapy import Request, Spider
from scrapy_redis.spiders import RedisSpider

if TYPE_CHECKING:
    from scrapy.http import Response
    from twisted.python.failure import Failure


# Settings of the crawls in tests and benchmarks.
BASE_SETTINGS: dict[str, Any] = {
    "DOWNLOADER_MIDDLEWARES": {"scrapy_redis_throttle.RedisThrottleMiddleware": 950},
    "CONCURRENT_REQUESTS": 64,
    "CONCURRENT_REQUESTS_PER_DOMAIN": 64,
    "DOWNLOAD_DELAY": 0,
    "ROBOTSTXT_OBEY": False,
    "TELNETCONSOLE_ENABLED": False,
    "LOG_LEVEL": "DEBUG",
    "CLOSESPIDER_TIMEOUT": 60,  # a guard: a stuck crawl ends and its assertions fail
    "EXTENSIONS": RELEASES_EXTENSION,
}


class UrlListSpider(Spider):
    """Requests the given URLs once each (``requests``: dicts with ``url``, optional ``meta``
    and ``dont_filter``, True unless given) and counts what came back."""

    name = "url_list"
    requests: list[dict[str, Any]]
    barrier: dict[str, Any] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failure_messages: list[str] = []

    async def start(self) -> AsyncIterator[Request]:
        if self.barrier:
            await self._wait_for_go(**self.barrier)
        for spec in self.requests:
            yield Request(spec["url"], meta=spec.get("meta", {}),
                          dont_filter=spec.get("dont_filter", True),
                          callback=self.parse, errback=self.failed)  # fmt: skip
            # Let the reactor run between two: while the downloader is full, Scrapy puts start()'s
            # requests into the scheduler without returning to it, and scrapy-redis's writes
            # each to Redis synchronously. A worker's share (150) blocked it 120-145 ms, and
            # the requests sent just before reached the site that late (docs, "Known
            # limitations").
            await asyncio.sleep(0)

    @staticmethod
    async def _wait_for_go(redis_url: str, key: str) -> None:
        """Say we are ready, then wait for the test to let every worker go at once."""
        from redis.asyncio import Redis

        client = Redis.from_url(redis_url)
        await client.rpush(f"{key}:ready", 1)
        assert await client.blpop([f"{key}:go"], timeout=60), "no go signal within 60 s"
        await client.aclose()

    def parse(self, response: Response) -> None:
        self.crawler.stats.inc_value("test/responses")

    def failed(self, failure: Failure) -> None:
        self.crawler.stats.inc_value(f"test/failures/{failure.type.__name__}")  # type: ignore[union-attr]
        self.failure_messages.append(str(failure.value))


class RedisUrlSpider(RedisSpider):  # type: ignore[misc]
    """scrapy-redis's RedisSpider: takes its URLs from Redis (``redis_urls:start_urls``) in
    batches, whenever it idles, and counts what came back."""

    name = "redis_urls"

    def parse(self, response: Response) -> None:
        self.crawler.stats.inc_value("test/responses")
