"""What the workers tell the fleet's Redis for ``scrapy-redis-throttle status``.

Redis holds each domain's limits, not how busy the fleet is with it. Every few seconds
(``REDIS_THROTTLE_REPORT_INTERVAL``) each worker writes, per domain, the requests that
went in the last minute and those its middleware holds now, to a key of its own that expires
when the worker stops reporting. Parked requests may come back to another worker than the one
that parked them, so they are counted in one hash for the fleet: the worker that parks one adds
1, the one that takes it back takes 1 away (sent with the reports). The tool adds it all up.

Each worker also counts itself in the fleet (``lua/fleet.lua``) at the same pace, reports or
not: while Redis fails, the ``"local"`` policy paces each domain at its rate divided by the
number of workers it saw live (:attr:`Activity.fleet_size`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import uuid
from collections import Counter, defaultdict, deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .rates import limit_in_force
from .redis_schema import fleet_key, parked_counts_key, report_key
from .scripts import lua_script
from .stats import STATS_PREFIX
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from scrapy.statscollectors import StatsCollector

    from .clock import Clock
    from .connection import ThrottleRedis
    from .rates import Limit

logger = logging.getLogger(__name__)

# A Redis down, switching over or out of memory: the fleet's size stays as last read, the share
# an outage is paced with. Any other error refuses the call itself (a user without the rights
# of fleet.lua, a key of another type): the size is then unknown, and an outage is waited out.
OUTAGE_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    ReadOnlyError,
    MasterDownError,
    OutOfMemoryError,
)

# A report outlives a missed one or two (a busy worker, a Redis hiccup), not a stopped worker.
REPORTS_KEPT = 3
RECENT = 60.0
"""The requests that went in this many seconds are counted."""
# The parked counts of a fleet idle this long vanish (with what a crashed worker left there).
PARKED_TTL = 3600.0
# How often a worker counts itself in the fleet when it sends no reports.
FLEET_INTERVAL = 5.0
# The first reading of the fleet's size again after the start; then twice as long each time, up
# to the report interval.
FIRST_COUNT_DELAY = 0.25


class Activity:
    """This worker's requests per domain, reported to Redis every *interval* seconds (0:
    never), and told in the log's summary if *summarized* (see :mod:`.log_summary`); nothing is
    counted for neither. And its place in the fleet."""

    def __init__(
        self,
        redis: ThrottleRedis,
        prefix: str,
        interval: float,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
        summarized: bool = False,
    ) -> None:
        self._redis = redis
        self._clock = clock
        self._interval = interval
        self._stats = stats
        self._worker = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._report_key = report_key(prefix, self._worker)
        self._parked_key = parked_counts_key(prefix)
        self._fleet_key = fleet_key(prefix)
        self._period = interval or FLEET_INTERVAL
        # The fleet's sizes Redis gave (monotonic time, size), over a worker's lifetime in it.
        self._sizes: deque[tuple[float, int]] = deque()
        self._fleet_refused = False
        self._log_extra = log_extra
        self._counting = bool(interval) or summarized
        self._summarized = summarized
        self._went: defaultdict[str, deque[float]] = defaultdict(deque)
        # Since the log's last summary, per domain: the longest wait of a request sent, and the
        # limit the last one went under, with the rate Redis paced it at (see limit_in_force).
        self._longest: dict[str, float] = {}
        self._limits: dict[str, tuple[Limit, float | None]] = {}
        self._held: Counter[str] = Counter()
        self._parked: Counter[str] = Counter()  # not sent yet
        # Since when (monotonic time) this worker counts what went (None: not yet): its
        # reports' "last minute" is shorter until a minute later.
        self._counting_since: float | None = None
        self._reporter: asyncio.Task[None] | None = None
        self._parked_script = lua_script(redis, "parked.lua")
        self._fleet_script = lua_script(redis, "fleet.lua")

    @property
    def fleet_size(self) -> int | None:
        """Workers live in the fleet, this one included: the most Redis counted over the last
        time a worker stays counted after its last call (``REPORTS_KEPT`` periods; None: not
        read yet, or Redis refused the call). Not just the last count: a Redis restarted empty
        counts the workers again one by one as they call, and an outage then would be paced
        with shares too large. So a worker that left stops counting here some 2 to 2.5 times
        that long after its last call."""
        return max((size for _, size in self._sizes), default=None)

    def went(
        self,
        domain: str,
        waited: float = 0.0,
        limit: Limit | None = None,
        rate: float | None = None,
    ) -> None:
        """A request of *domain* left for the download, after *waited* seconds, under *limit*,
        paced at *rate* (see :func:`.rates.limit_in_force`)."""
        if not self._counting:
            return
        now = self._clock.monotonic()
        if self._counting_since is None:
            self._counting_since = now
        times = self._went[domain]
        times.append(now)
        _forget_before(times, now - RECENT)
        if self._summarized:
            self._longest[domain] = max(waited, self._longest.get(domain, 0.0))
            if limit is not None:
                self._limits[domain] = limit, rate

    @contextmanager
    def holding(self, domain: str) -> Iterator[None]:
        """A request of *domain* waits in the middleware meanwhile."""
        if not self._counting:
            yield
            return
        self._held[domain] += 1
        try:
            yield
        finally:
            self._held[domain] -= 1
            if not self._held[domain]:
                del self._held[domain]

    def park(self, domain: str, change: int) -> None:
        """A request of *domain* was parked (1), or came back from the parking area (-1)."""
        if self._interval:
            self._parked[domain] += change

    def report(self) -> dict[str, list[int]]:
        """Per domain with any activity: [requests in the last minute, held now, the ms that
        "last minute" is (shorter in this worker's first minute)]."""
        now = self._clock.monotonic()
        for domain, times in list(self._went.items()):
            _forget_before(times, now - RECENT)
            if not times:
                del self._went[domain]
        since = now if self._counting_since is None else self._counting_since
        counted_ms = round(1000 * min(RECENT, now - since))
        domains = sorted(set(self._went) | set(self._held))
        return {
            domain: [len(self._went.get(domain, ())), self._held[domain], counted_ms]
            for domain in domains
        }

    def summary(self) -> dict[str, tuple[int, int, float, str | None]]:
        """Per domain with any activity: requests in the last minute, held now, the longest
        wait and the limit of the last request sent since the last summary (None: none went);
        those two start again."""
        limits = {domain: limit_in_force(*told) for domain, told in self._limits.items()}
        summary = {
            domain: (went, held, self._longest.get(domain, 0.0), limits.get(domain))
            for domain, (went, held, _) in self.report().items()
        }
        self._longest.clear()
        self._limits.clear()
        return summary

    async def start(self) -> None:
        """Count this worker in the fleet (before the first request, so that the fleet's size
        is known if Redis fails early), then report every interval."""
        self._counting_since = self._clock.monotonic()
        await self._count_in()
        self._reporter = asyncio.ensure_future(self._report_every_interval())

    async def stop(self) -> None:
        if self._reporter is None:
            return
        await cancel_and_wait(self._reporter, "the activity reports")
        await self._call(self._fleet_script([self._fleet_key], [self._worker, 0]))
        if self._interval:
            await self._send_parked()
            # Else it expires. Not delete(): a cluster client sends that through a pipeline,
            # which redis-py 5 never runs without retries.
            await self._call(self._redis.execute_command("DEL", self._report_key))  # type: ignore[no-untyped-call]
        await self._parked_script.aclose()
        await self._fleet_script.aclose()

    async def _count_in(self) -> None:
        counted_for = REPORTS_KEPT * self._period
        try:
            size = int(
                await self._fleet_script(
                    [self._fleet_key], [self._worker, math.ceil(counted_for * 1e6)]
                )
            )
        except RedisError as exc:
            self._failed(exc)
            if not isinstance(exc, OUTAGE_ERRORS):
                if not self._fleet_refused:
                    logger.warning(
                        "Redis throttle: Redis refused to count this worker in the fleet "
                        "(%s: %s): "
                        "while Redis fails, its throttled requests will wait, not knowing "
                        "its share of the rates (see the documented ACL rights, or set "
                        "REDIS_THROTTLE_FALLBACK_WORKERS)",
                        type(exc).__name__,
                        exc,
                        extra=self._log_extra(),
                    )
                self._fleet_refused = True
                self._sizes.clear()
            return
        self._fleet_refused = False
        now = self._clock.monotonic()
        self._sizes.append((now, size))
        # A count is forgotten once the counts after it cover a worker's time in the fleet: by
        # then every live worker has counted itself in again, even in a Redis restarted empty.
        while len(self._sizes) > 1 and self._sizes[1][0] <= now - counted_for:
            self._sizes.popleft()
        self._stats.set_value(f"{STATS_PREFIX}/fleet_size", self.fleet_size)

    async def _report_every_interval(self) -> None:
        expiry = math.ceil(REPORTS_KEPT * self._interval * 1000)
        # Soon after the start, the fleet's size is read again at a growing pace: workers
        # started together each read only those that counted in before them (1, 2, 3, ...),
        # and an outage in their first interval would be paced with those shares.
        delay = FIRST_COUNT_DELAY
        while True:
            if self._interval:
                report = json.dumps(self.report())
                await self._call(self._redis.set(self._report_key, report, px=expiry))
                await self._send_parked()
            await self._clock.sleep(min(delay, self._period))
            delay *= 2
            await self._count_in()

    async def _send_parked(self) -> None:
        changes = {domain: change for domain, change in self._parked.items() if change}
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
            self._failed(exc)
            return False
        return True

    def _failed(self, exc: RedisError) -> None:
        # The throttle logs Redis's failures; a missed report only ages the status, and the
        # fleet's size stays as last seen.
        self._stats.inc_value(f"{STATS_PREFIX}/activity_errors/{type(exc).__name__}")
        logger.debug("Redis throttle: activity report: %r", exc, extra=self._log_extra())


def _forget_before(times: deque[float], since: float) -> None:
    while times and times[0] < since:
        times.popleft()
