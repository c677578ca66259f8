from __future__ import annotations

from typing import TYPE_CHECKING

from scrapy.utils.misc import load_object

from .config import DEFAULT_SCHEDULER
from .middleware import RedisThrottleMiddleware
from .parking_scheduler import ParkingScheduler, composes_parking

if TYPE_CHECKING:
    from scrapy.settings import BaseSettings

# After HttpCacheMiddleware (900), so cache hits spend no tokens, and above RetryMiddleware (550),
# so every response, retried ones included, passes by.
MIDDLEWARE_PRIORITY = 950
PARKING_SCHEDULER = f"{ParkingScheduler.__module__}.{ParkingScheduler.__qualname__}"


class Addon:
    """``ADDONS = {"scrapy_redis_throttle.Addon": 500}`` enables the throttle middleware, and
    parks the requests that must wait long beside the project's scheduler.

    A priority the user already gave the middleware in ``DOWNLOADER_MIDDLEWARES`` (even ``None``,
    to disable it) is kept. The project's ``SCHEDULER`` (any scheduler, scrapy-redis's
    included) becomes ``REDIS_THROTTLE_SCHEDULER``, and ``SCHEDULER`` a
    :class:`~scrapy_redis_throttle.ParkingScheduler` composed of it and the parking area (see
    :mod:`scrapy_redis_throttle.parking`), at the same priority: the project's choice stays the
    scheduler that queues its requests.
    """

    def update_settings(self, settings: BaseSettings) -> None:
        settings.setdefault_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", RedisThrottleMiddleware, MIDDLEWARE_PRIORITY
        )
        scheduler = settings.get("SCHEDULER") or DEFAULT_SCHEDULER
        if composes_parking(load_object(scheduler) if isinstance(scheduler, str) else scheduler):
            return  # the project composes it itself
        priority = settings.getpriority("SCHEDULER") or 0
        settings.set("REDIS_THROTTLE_SCHEDULER", scheduler, priority=priority)
        settings.set("SCHEDULER", PARKING_SCHEDULER, priority=priority)
