"""What the start-up warns of: a set-up in which the workers share no queue, and Scrapy's
per-process politeness that fights the shared budget."""

from __future__ import annotations

from fakes import Yard, throttle_config
from support import async_test

from scrapy_redis_throttle.startup import setup_warnings

NOT_SHARED = "the workers do not share one (they share the budgets only)"


@async_test
async def test_a_scheduler_whose_queue_is_the_process_s_is_warned_of() -> None:
    """Requests parked in memory: the scheduler is not scrapy-redis's."""
    yard = Yard()
    [warning] = setup_warnings(throttle_config(), yard.area)
    await yard.area.stop()
    assert NOT_SHARED in warning
    assert "SCHEDULER = 'scrapy_redis.scheduler.Scheduler'" in warning


def test_without_a_parking_area_the_scheduler_is_not_judged() -> None:
    """No parking area: another WARNING said so, and the queue's kind is not known."""
    assert setup_warnings(throttle_config(), None) == []


def test_autothrottle_is_warned_of() -> None:
    [warning] = setup_warnings(throttle_config(AUTOTHROTTLE_ENABLED=True), None)
    assert "set AUTOTHROTTLE_ENABLED = False" in warning
