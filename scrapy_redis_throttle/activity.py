"""What the workers tell the fleet's Redis for ``scrapy-redis-throttle status``.

Redis holds each domain's limits, not how busy the fleet is with it. Every few seconds
(``REDIS_THROTTLE_REPORT_INTERVAL``) each worker writes, per throttle key, the requests that
went in the last minute and those its middleware holds now, to a key of its own that expires
when the worker stops reporting. Parked requests may come back to another worker than the one
that parked them, so they are counted in one hash for the fleet: the worker that parks one adds
1, the one that takes it back takes 1 away (sent with the reports). The tool adds it all up.
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
from .scripts import lua_script

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from scrapy.statscollectors import StatsCollector

    from .connection import ThrottleRedis

logger = logging.getLogger(__name__)

# A report outlives a missed one or two (a busy worker, a Redis hiccup), not a stopped worker.
REPORTS_KEPT = 3
RECENT = 60.0
"""The requests that went in this many seconds are counted."""
# The parked counts of a fleet idle this long vanish (with what a crashed worker left there).
PARKED_TTL = 3600.0


def report_pattern(prefix: str) -> str:
    """Matches the key of every worker's report (for SCAN)."""
    return f"{prefix}:worker:*"


def parked_key(prefix: str) -> str:
    """The hash of the fleet's parked requests per throttle key."""
    return f"{prefix}:parked"


class Activity:
    """This worker's requests per throttle key, reported to Redis every *interval* seconds
    (0: never, and nothing is counted)."""

    def __init__(
        self,
        redis: ThrottleRedis,
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
        self._parked_key = parked_key(prefix)
        self._log_extra = log_extra
        self._went: defaultdict[str, deque[float]] = defaultdict(deque)
        self._held: Counter[str] = Counter()
        self._parked: Counter[str] = Counter()  # not sent yet
        self._reporter: asyncio.Task[None] | None = None
        self._parked_script = lua_script(redis, "parked.lua")

    def went(self, key: str) -> None:
        """A request of *key* left for the download."""
        if self._interval:
            now = time.monotonic()
            times = self._went[key]
            times.append(now)
            _forget_before(times, now - RECENT)

    def hold(self, key: str, change: int) -> None:
        """*change* more (or, negative, fewer) requests of *key* wait in the middleware."""
        if self._interval:
            self._held[key] += change
            if not self._held[key]:
                del self._held[key]

    def park(self, key: str, change: int) -> None:
        """A request of *key* was parked (1), or came back from the parking area (-1)."""
        if self._interval:
            self._parked[key] += change

    def report(self) -> dict[str, list[int]]:
        """Per throttle key with any activity: [requests in the last minute, held now]."""
        since = time.monotonic() - RECENT
        for key, times in list(self._went.items()):
            _forget_before(times, since)
            if not times:
                del self._went[key]
        keys = sorted(set(self._went) | set(self._held))
        return {key: [len(self._went.get(key, ())), self._held[key]] for key in keys}

    def start(self) -> None:
        if self._interval:
            self._reporter = asyncio.ensure_future(self._report_every_interval())

    async def stop(self) -> None:
        if self._reporter is None:
            return
        self._reporter.cancel()
        await self._send_parked()
        # Else it expires. Not delete(): a cluster client sends that through a pipeline, which
        # redis-py 5 never runs without retries.
        await self._call(self._redis.execute_command("DEL", self._key))  # type: ignore[no-untyped-call]
        await self._parked_script.aclose()

    async def _report_every_interval(self) -> None:
        expiry = math.ceil(REPORTS_KEPT * self._interval * 1000)
        while True:
            await self._call(self._redis.set(self._key, json.dumps(self.report()), px=expiry))
            await self._send_parked()
            await sleep(self._interval)

    async def _send_parked(self) -> None:
        changes = {key: change for key, change in self._parked.items() if change}
        self._parked = Counter()
        if not changes:
            return
        args = [int(PARKED_TTL * 1000), *(part for change in changes.items() for part in change)]
        if not await self._call(self._parked_script([self._parked_key], args)):
            self._parked.update(changes)  # sent with the next report

    async def _call(self, command: Awaitable[object]) -> bool:
        try:
            await command
        except RedisError as exc:
            # The throttle logs Redis's failures; a missed report only ages the status.
            self._stats.inc_value(f"{STATS_PREFIX}/activity_errors/{type(exc).__name__}")
            logger.debug("Redis throttle: activity report: %r", exc, extra=self._log_extra())
            return False
        return True


def _forget_before(times: deque[float], since: float) -> None:
    while times and times[0] < since:
        times.popleft()
