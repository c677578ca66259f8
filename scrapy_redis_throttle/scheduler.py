"""Schedulers kept from 0.1 for the projects that name them: the throttle now parks requests
with any scheduler (see :mod:`scrapy_redis_throttle.parking`), so these are their parents.

* :class:`ThrottleScheduler`: Scrapy's own scheduler.
* :class:`RedisThrottleScheduler`: scrapy-redis's scheduler.
"""

from __future__ import annotations

from scrapy.core.scheduler import Scheduler
from scrapy_redis.scheduler import Scheduler as ScrapyRedisScheduler


class ThrottleScheduler(Scheduler):
    """Scrapy's scheduler, unchanged: set ``SCHEDULER = "scrapy.core.scheduler.Scheduler"``
    (Scrapy's default) instead."""


class RedisThrottleScheduler(ScrapyRedisScheduler):  # type: ignore[misc]
    """scrapy-redis's scheduler, unchanged: set
    ``SCHEDULER = "scrapy_redis.scheduler.Scheduler"`` instead."""
