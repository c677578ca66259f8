"""Scheduler classes a project may name: each is its parent, unchanged, because the throttle
parks requests beside whichever scheduler the engine runs (see :mod:`.engine_hooks`).

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
