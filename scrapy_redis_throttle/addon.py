from __future__ import annotations

from typing import TYPE_CHECKING

from scrapy.settings import SETTINGS_PRIORITIES
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
DOWNLOAD_SLOT = "redis_throttle"


class Addon:
    """``ADDONS = {"scrapy_redis_throttle.Addon": 500}`` enables the throttle middleware, and
    parks the requests that must wait long beside the project's scheduler.

    A priority the user already gave the middleware in ``DOWNLOADER_MIDDLEWARES`` (even ``None``,
    to disable it) is kept. The project's ``SCHEDULER`` (any scheduler, scrapy-redis's
    included) becomes ``REDIS_THROTTLE_SCHEDULER``, and ``SCHEDULER`` a
    :class:`~scrapy_redis_throttle.ParkingScheduler` composed of it and the parking area (see
    :mod:`scrapy_redis_throttle.parking`), at the same priority: the project's choice stays the
    scheduler that queues its requests.

    The requests the throttle paces go through one download slot of their own,
    ``REDIS_THROTTLE_DOWNLOAD_SLOT`` (``"redis_throttle"``), an entry of ``DOWNLOAD_SLOTS``
    without delay and with ``CONCURRENT_REQUESTS``: the project's ``DOWNLOAD_DELAY`` and
    ``CONCURRENT_REQUESTS_PER_DOMAIN``, per process, no longer hold them below the fleet's
    shared budget, and still apply to the domains it does not pace. The project keeps both
    layers with ``REDIS_THROTTLE_DOWNLOAD_SLOT = None``.
    """

    def update_settings(self, settings: BaseSettings) -> None:
        settings.setdefault_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", RedisThrottleMiddleware, MIDDLEWARE_PRIORITY
        )
        self._own_download_slot(settings)
        scheduler = settings.get("SCHEDULER") or DEFAULT_SCHEDULER
        if composes_parking(load_object(scheduler) if isinstance(scheduler, str) else scheduler):
            return  # the project composes it itself
        priority = settings.getpriority("SCHEDULER") or 0
        settings.set("REDIS_THROTTLE_SCHEDULER", scheduler, priority=priority)
        settings.set("SCHEDULER", PARKING_SCHEDULER, priority=priority)

    @staticmethod
    def _own_download_slot(settings: BaseSettings) -> None:
        """The download slot of the paced requests, unless the project names its own (or
        None), and its entry in ``DOWNLOAD_SLOTS`` beside the project's own."""
        settings.set("REDIS_THROTTLE_DOWNLOAD_SLOT", DOWNLOAD_SLOT, priority="addon")
        slot = settings.get("REDIS_THROTTLE_DOWNLOAD_SLOT")
        slots = settings.getdict("DOWNLOAD_SLOTS")
        if not isinstance(slot, str) or slot in slots:
            return
        slots[slot] = {"delay": 0.0, "concurrency": settings.getint("CONCURRENT_REQUESTS")}
        priority = max(settings.getpriority("DOWNLOAD_SLOTS") or 0, SETTINGS_PRIORITIES["addon"])
        settings.set("DOWNLOAD_SLOTS", slots, priority=priority)
