"""Downloader middleware that makes every request wait for its domain's shared budget in Redis.

It is Scrapy's door to the :class:`.Throttle`, which owns the throttle's parts and decides. Its
settings are read by :class:`.ThrottleConfig`, and listed with their defaults in the settings
reference (``docs/reference/settings.rst``); its meta keys in ``docs/reference/meta.rst``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scrapy import signals
from scrapy.utils.asyncio import is_asyncio_available

from .clock import Clock
from .config import ThrottleConfig
from .errors import ThrottleConfigError
from .throttle import Throttle

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self


logger = logging.getLogger(__name__)


class RedisThrottleMiddleware:
    def __init__(self, crawler: Crawler) -> None:
        try:
            config = ThrottleConfig.from_crawler(crawler)
            if not is_asyncio_available():
                raise ThrottleConfigError(
                    "scrapy-redis-throttle needs the asyncio reactor, or none "
                    "(TWISTED_REACTOR_ENABLED = False, Scrapy 2.15+): set TWISTED_REACTOR = "
                    "'twisted.internet.asyncioreactor.AsyncioSelectorReactor' (Scrapy's "
                    f"default), got {config.crawl.twisted_reactor!r}"
                )
        except ThrottleConfigError as exc:
            # One line where the user looks, before Scrapy's traceback of it.
            logger.error("Redis throttle: the worker stops: %s", exc)
            raise
        self.throttle = Throttle(crawler, config, Clock())
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self._spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    async def _spider_opened(self) -> None:
        await self.throttle.open()

    async def _spider_closed(self) -> None:
        await self.throttle.close()

    async def process_request(self, request: Request) -> Request | None:
        """Wait for the request's turn; a request whose turn is far comes back with its ticket
        (the engine hands it to the parking area, see :mod:`.engine_hooks`)."""
        return await self.throttle.request(request)

    async def process_response(self, request: Request, response: Response) -> Response:
        """A 429 or 503 pauses its domain for every worker, before RetryMiddleware, at 550,
        retries the request."""
        return await self.throttle.response(request, response)

    async def process_exception(self, request: Request, exception: Exception) -> None:
        await self.throttle.exception(request, exception)
