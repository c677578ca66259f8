from __future__ import annotations

from typing import TYPE_CHECKING

from .middleware import RedisThrottleMiddleware

if TYPE_CHECKING:
    from scrapy.settings import BaseSettings

# After HttpCacheMiddleware (900), so cache hits spend no tokens, and above RetryMiddleware (550),
# so every response, retried ones included, passes by.
MIDDLEWARE_PRIORITY = 950


class Addon:
    """``ADDONS = {"scrapy_redis_throttle.Addon": 500}`` enables the throttle middleware.

    A priority the user already gave the middleware in ``DOWNLOADER_MIDDLEWARES`` (even ``None``,
    to disable it) is kept. Any ``SCHEDULER`` works: the middleware parks the requests that must
    wait long beside it (see :mod:`scrapy_redis_throttle.parking`).
    """

    def update_settings(self, settings: BaseSettings) -> None:
        settings.setdefault_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", RedisThrottleMiddleware, MIDDLEWARE_PRIORITY
        )
