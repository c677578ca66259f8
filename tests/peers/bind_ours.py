"""A pytest plugin for the peers' own test suites (see run.py): their schedulers decide as ours.

``-p bind_ours`` replaces ``scrapy.core.scheduler.Scheduler`` and
``scrapy_redis.scheduler.Scheduler``, before the peers' test modules import them (and before
Scrapy loads its ``SCHEDULER`` setting), with subclasses whose every instance has parking's
methods bound on it (:func:`~scrapy_redis_throttle.engine_hooks.bind_parking`, as the throttle
binds them with the middleware line alone, and as :class:`~scrapy_redis_throttle.ParkingScheduler`
runs them for the add-on), and says at the end how many of those their tests made (also into
the file ``$BIND_OURS_REPORT`` names, as JSON, for run.py): none would mean the binding missed.
With no request parked, their tests must pass as with theirs.
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

from scrapy_redis_throttle.engine_hooks import bind_parking

MADE: Counter[str] = Counter()


def _with_parking(theirs: type[Any]) -> type[Any]:
    """*theirs*, each of whose instances decides as a ParkingScheduler composed of it."""

    class WithParking(theirs):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            MADE[f"{theirs.__module__}.{theirs.__name__}"] += 1
            super().__init__(*args, **kwargs)
            bind_parking(self)

    WithParking.__name__ = WithParking.__qualname__ = theirs.__name__
    return WithParking


def pytest_configure(config: pytest.Config) -> None:
    scrapy.core.scheduler.Scheduler = _with_parking(scrapy.core.scheduler.Scheduler)  # type: ignore[misc]
    scrapy_redis.scheduler.Scheduler = _with_parking(scrapy_redis.scheduler.Scheduler)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    made = ", ".join(f"{count} {name}" for name, count in sorted(MADE.items())) or "none"
    terminalreporter.write_line(f"bind_ours: schedulers with parking made by the tests: {made}")
    if report := os.environ.get("BIND_OURS_REPORT"):
        Path(report).write_text(json.dumps(MADE))
