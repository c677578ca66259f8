"""A pytest plugin for the peers' own test suites (see run.py): their scheduler classes are ours.

``-p bind_ours`` replaces ``scrapy.core.scheduler.Scheduler`` and
``scrapy_redis.scheduler.Scheduler`` with :class:`~scrapy_redis_throttle.ThrottleScheduler` and
:class:`~scrapy_redis_throttle.RedisThrottleScheduler` before the peers' test modules import them
(and before Scrapy loads its ``SCHEDULER`` setting), and says at the end how many of ours their
tests made (also into the file ``$BIND_OURS_REPORT`` names, as JSON, for run.py): none would
mean the binding missed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import scrapy.core.scheduler
import scrapy_redis.scheduler

from scrapy_redis_throttle import RedisThrottleScheduler, ThrottleScheduler

MADE: Counter[str] = Counter()


def _counted(cls: Any) -> None:
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        MADE[cls.__name__] += 1
        init(self, *args, **kwargs)

    cls.__init__ = __init__


def pytest_configure(config: pytest.Config) -> None:
    for ours in (ThrottleScheduler, RedisThrottleScheduler):
        _counted(ours)
    scrapy.core.scheduler.Scheduler = ThrottleScheduler  # type: ignore[misc]
    scrapy_redis.scheduler.Scheduler = RedisThrottleScheduler


def pytest_terminal_summary(terminalreporter: Any) -> None:
    made = ", ".join(f"{count} {name}" for name, count in sorted(MADE.items())) or "none"
    terminalreporter.write_line(f"bind_ours: schedulers of ours made by the tests: {made}")
    if report := os.environ.get("BIND_OURS_REPORT"):
        Path(report).write_text(json.dumps(MADE))
