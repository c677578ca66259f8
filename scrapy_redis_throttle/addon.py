from __future__ import annotations

from typing import TYPE_CHECKING

from .middleware import RedisThrottleMiddleware

if TYPE_CHECKING:
    from scrapy.settings import BaseSettings

# After HttpCacheMiddleware (900), so cache hits spend no tokens, and above RetryMiddleware (550),
# so every response, retried ones included, passes by.
MIDDLEWARE_PRIORITY = 950


class Addon:
    """``ADDONS = {"scrapy_redis_throttle.Addon": 500}`` enables the throttle middleware and, unless
    the project chose a scheduler, :class:`~scrapy_redis_throttle.ThrottleScheduler`.

    A priority the user already gave the middleware in ``DOWNLOADER_MIDDLEWARES`` (even ``None``,
    to disable it) is kept, and so is a ``SCHEDULER`` the project set (scrapy-redis users set
    ``scrapy_redis_throttle.RedisThrottleScheduler`` themselves).
    """

    def update_settings(self, settings: BaseSettings) -> None:
        settings.setdefault_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", RedisThrottleMiddleware, MIDDLEWARE_PRIORITY
        )
        settings.set("SCHEDULER", "scrapy_redis_throttle.ThrottleScheduler", priority="addon")
