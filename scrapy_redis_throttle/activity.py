"""What each worker tells the fleet's Redis for ``scrapy-redis-throttle status``.

Redis holds each domain's limits, not how busy the fleet is with it: every few seconds
(``REDIS_THROTTLE_REPORT_INTERVAL``) each worker writes, per throttle key, the requests that
went in the last minute and those waiting now (held by the middleware, or parked in the
scheduler) to a key of its own that expires when the worker stops reporting. The tool adds the
workers' reports up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
import uuid
from collections import Counter, defaultdict, deque
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from .resilience import STATS_PREFIX, sleep

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from redis.asyncio import Redis
    from scrapy.statscollectors import StatsCollector

logger = logging.getLogger(__name__)

# A report outlives a missed one or two (a busy worker, a Redis hiccup), not a stopped worker.
REPORTS_KEPT = 3
RECENT = 60.0
"""The requests that went in this many seconds are counted."""


def report_pattern(prefix: str) -> str:
    """Matches the key of every worker's report (for SCAN)."""
    return f"{prefix}:worker:*"


class Activity:
    """This worker's requests per throttle key, reported to Redis every *interval* seconds."""

    def __init__(
        self,
        redis: Redis,
        prefix: str,
        interval: float,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
    ) -> None:
        self._redis = redis
        self._interval = interval
        self._stats = stats
        worker = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._key = report_pattern(prefix).replace("*", worker)
        self._log_extra = log_extra
        self._went: defaultdict[str, deque[float]] = defaultdict(deque)
        self._waiting: Counter[str] = Counter()
        self._reporter: asyncio.Task[None] | None = None

    def went(self, key: str) -> None:
        """A request of *key* left for the download."""
        self._went[key].append(time.monotonic())

    def wait(self, key: str, change: int) -> None:
        """*change* more (or, negative, fewer) requests of *key* are waiting. A request parked
        by one worker may come back to another: only the fleet's sum counts."""
        self._waiting[key] += change

    def report(self) -> dict[str, list[int]]:
        """Per throttle key with any activity: [requests in the last minute, waiting now]."""
        since = time.monotonic() - RECENT
        for key, times in list(self._went.items()):
            while times and times[0] < since:
                times.popleft()
            if not times:
                del self._went[key]
        keys = set(self._went) | {key for key, count in self._waiting.items() if count}
        return {key: [len(self._went.get(key, ())), self._waiting[key]] for key in sorted(keys)}

    def start(self) -> None:
        if self._interval > 0:
            self._reporter = asyncio.ensure_future(self._report_every_interval())

    async def stop(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            await self._call(self._redis.delete(self._key))  # else it expires

    async def _report_every_interval(self) -> None:
        expiry = math.ceil(REPORTS_KEPT * self._interval * 1000)
        while True:
            await self._call(self._redis.set(self._key, json.dumps(self.report()), px=expiry))
            await sleep(self._interval)

    async def _call(self, command: Awaitable[object]) -> None:
        try:
            await command
        except RedisError as exc:
            # The throttle logs Redis's failures; a missed report only ages the status.
            self._stats.inc_value(f"{STATS_PREFIX}/activity_errors/{type(exc).__name__}")
            logger.debug("Redis throttle: activity report: %r", exc, extra=self._log_extra())
