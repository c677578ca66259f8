"""Downloader middleware that makes every request wait for its domain's shared budget in Redis.

Settings (see README.md for the full reference):

* ``REDIS_THROTTLE_ENABLED`` - on by default once the middleware is enabled
* ``REDIS_THROTTLE_DEFAULT_RATE`` / ``REDIS_THROTTLE_DEFAULT_BURST`` - for domains not listed
* ``REDIS_THROTTLE_RATES`` and the spider attribute ``redis_throttle_rates`` - per-domain limits
* ``REDIS_THROTTLE_URL`` / ``REDIS_THROTTLE_PARAMS`` - default to scrapy-redis's ``REDIS_URL`` /
  ``REDIS_PARAMS``
* ``REDIS_THROTTLE_MAX_HOLD``, ``REDIS_THROTTLE_MAX_RESERVE`` - how long a request may wait here
  (longer waits are parked when ``SCHEDULER`` is one of :mod:`scrapy_redis_throttle.scheduler`'s)
  and how far ahead it may reserve its tokens
* ``REDIS_THROTTLE_ON_REDIS_ERROR``, ``REDIS_THROTTLE_FALLBACK_WORKERS``,
  ``REDIS_THROTTLE_PROBE_INTERVAL`` - what happens while Redis fails (see
  :mod:`scrapy_redis_throttle.resilience`)
* ``REDIS_THROTTLE_PENALTY_HTTP_CODES``, ``REDIS_THROTTLE_PENALTY_BACKOFF``,
  ``REDIS_THROTTLE_MAX_PAUSE``, ``REDIS_THROTTLE_PENALTY_DECAY`` - responses that pause their
  domain for the whole fleet (see :mod:`scrapy_redis_throttle.penalties`)
* ``REDIS_THROTTLE_ADAPTIVE_ENABLED``, ``REDIS_THROTTLE_ADAPTIVE_MIN_RATE``,
  ``REDIS_THROTTLE_ADAPTIVE_DECREASE``, ``REDIS_THROTTLE_ADAPTIVE_RECOVERY`` - a domain's rate
  for the fleet, lowered on those pauses and on download timeouts, climbing back meanwhile
* ``REDIS_THROTTLE_CRAWL_DELAY_ENABLED``, ``REDIS_THROTTLE_MAX_CRAWL_DELAY`` - robots.txt
  ``Crawl-delay`` as a host's limit (see :mod:`scrapy_redis_throttle.crawl_delay`)
* ``REDIS_THROTTLE_KEY_PREFIX``

Request meta keys: ``dont_redis_throttle``, ``redis_throttle_key``, ``redis_throttle_cost``,
``redis_throttle_penalty``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import TYPE_CHECKING, Any, NoReturn

from scrapy import exceptions, signals
from scrapy.utils.asyncio import is_asyncio_available
from scrapy.utils.misc import load_object
from twisted.internet.error import TCPTimedOutError
from twisted.internet.error import TimeoutError as TwistedTimeoutError

from .activity import Activity
from .bucket import penalty_channel
from .config import (
    InvalidThrottleMeta,
    ThrottleConfig,
    ThrottleConfigError,
    format_rate,
)
from .connection import close, connect
from .crawl_delay import CrawlDelays
from .penalties import Pauses, parse_retry_after
from .resilience import STATS_PREFIX, ResilientBucket, sleep
from .scheduler import PARK_META, RELEASE_AHEAD, RELEASE_META, ParkingScheduler

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from .bucket import AcquireResult
    from .config import Limit

logger = logging.getLogger(__name__)

# A parked request given back later than this after its reserved moment asks for a new one:
# going that late would squeeze it against the next request's moment.
LATE_RELEASE = 0.05
# When the request left for the download (loop time), for the adaptive rate.
SENT_META = "_redis_throttle_sent_at"
# Download timeouts: Scrapy's own exception since 2.19, Twisted's before (and TCP connects').
DOWNLOAD_TIMEOUTS = (
    getattr(exceptions, "DownloadTimeoutError", TwistedTimeoutError),
    TwistedTimeoutError,
    TCPTimedOutError,
)


class RedisThrottleMiddleware:
    def __init__(self, crawler: Crawler) -> None:
        self.config = ThrottleConfig.from_crawler(crawler)
        if not is_asyncio_available():
            raise ThrottleConfigError(
                "scrapy-redis-throttle needs the asyncio reactor: set TWISTED_REACTOR = "
                "'twisted.internet.asyncioreactor.AsyncioSelectorReactor' (Scrapy's default), "
                f"got {crawler.settings.get('TWISTED_REACTOR')!r}"
            )
        self.crawler = crawler
        self.stats = crawler.stats
        self.redis = connect(self.config)
        self.budget = ResilientBucket(self.redis, self.config, crawler.stats, self._log_extra)
        self.parking = issubclass(load_object(crawler.settings["SCHEDULER"]), ParkingScheduler)
        self.crawl_delays = CrawlDelays(crawler, self.config, self._log_extra)
        self.pauses = Pauses(
            self.redis,
            penalty_channel(self.config.key_prefix),
            crawler.stats,
            self._log_extra,
            forget=self.budget.local.forget,
        )
        self.activity = Activity(
            self.redis,
            self.config.key_prefix,
            self.config.report_interval,
            crawler.stats,
            self._log_extra,
        )
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self._spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    async def _spider_opened(self, spider: Spider) -> None:
        logger.info(
            "Redis throttle: shared limits in %s (key prefix %r), %s; if Redis fails, %s:\n  %s",
            self.config.redis_location,
            self.config.key_prefix,
            f"requests that must wait over {self.config.max_hold:g} s are parked in the scheduler"
            if self.parking
            else "waiting requests are held in the downloader (set SCHEDULER to "
            "scrapy_redis_throttle.ThrottleScheduler or RedisThrottleScheduler to park them)",
            self.budget.describe_policy(),
            "\n  ".join(self.config.limits.describe()),
            extra={"spider": spider},
        )
        crawl_delay = self.crawl_delays.describe()
        if crawl_delay is not None:
            logger.info("Redis throttle: %s", crawl_delay, extra={"spider": spider})
        adaptive = self.config.adaptive
        if adaptive is not None:
            codes = "/".join(map(str, sorted(self.config.penalty_codes)))
            logger.info(
                "Redis throttle: adaptive rate: each %sdownload timeout multiplies a domain's "
                "rate by %g (down to %s); it climbs back to the configured rate within %g s "
                "without failures",
                f"pause after a {codes} and each " if codes else "",
                adaptive.decrease,
                format_rate(adaptive.min_rate),
                adaptive.recovery,
                extra={"spider": spider},
            )
        await self.budget.check()
        # Pauses, decreases of adaptive rates and limits changed live void reservations.
        self.pauses.start()
        self.activity.start()

    async def _spider_closed(self, spider: Spider) -> None:
        self.pauses.stop()
        await self.activity.stop()
        await self.budget.aclose()
        await close(self.redis)

    def _log_extra(self) -> dict[str, Any]:
        return {"spider": self.crawler.spider}

    async def process_request(self, request: Request) -> Request | None:
        stats = self.stats
        if request.meta.get("dont_redis_throttle"):
            stats.inc_value(f"{STATS_PREFIX}/skipped")
            return None
        key = self._key(request)
        release = request.meta.pop(RELEASE_META, None)
        if release is not None:
            self.activity.park(key, -1)  # back from the parking area
        limit = self._limit(key)
        if limit is None:
            stats.inc_value(f"{STATS_PREFIX}/unthrottled")
            return None
        cost = self._cost(request, limit)
        self.activity.hold(key, 1)
        try:
            return await self._take_turn(request, key, limit, cost, release)
        finally:
            self.activity.hold(key, -1)

    async def _take_turn(
        self, request: Request, key: str, limit: Limit, cost: float, release: dict[str, Any] | None
    ) -> Request | None:
        """Wait until *request* may go (None), or hand it back to be parked (a copy)."""
        stats = self.stats
        loop = asyncio.get_running_loop()
        started = loop.time()
        if release is not None and release["reserved"]:
            # Back from the parking area: its tokens are reserved for go_at.
            if release["go_at"] - started >= -LATE_RELEASE:
                await self.pauses.sleep(key, release["go_at"] - started)
                if self._may_go(key, release["reserved_at"], release["go_at"]):
                    self._went(request, key, started, delayed=True)
                    return None
            else:
                stats.inc_value(f"{STATS_PREFIX}/released_late")  # its moment passed: ask again
        delayed = release is not None
        while True:
            grant = await self.budget.acquire(key, limit, cost)
            reserved_at = time.time()
            result = grant.result
            delayed = delayed or grant.waited_for_redis
            paused = 0.0 if grant.shared else self.pauses.paused_for(key)
            if paused:
                # Without Redis no bucket holds the pause back: this worker does.
                delayed = True
                await sleep(paused)
                continue
            if result.allowed:
                self._went(request, key, started, delayed)
                return None
            if result.paused:
                stats.inc_value(f"{STATS_PREFIX}/paused_live")
            if self.parking and result.retry_after > self.config.max_hold:
                return self._park(request, key, limit, result, reserved_at)
            if result.paused:
                why = ", paused live"
            else:
                why = "" if grant.shared else ", paced locally while Redis fails"
            logger.debug(
                "Redis throttle: %(request)s waits %(delay).3f s for %(key)r (%(limit)s)%(why)s",
                {
                    "request": request,
                    "delay": result.retry_after,
                    "key": key,
                    "limit": limit,
                    "why": why,
                },
                extra=self._log_extra(),
            )
            delayed = True
            if result.reserved:
                moment = loop.time() + result.retry_after
                await self.pauses.sleep(key, result.retry_after)
                if self._may_go(key, reserved_at, moment):
                    self._went(request, key, started, delayed)
                    return None
                continue
            if result.paused:
                await sleep(result.retry_after)
                continue
            # Too far ahead to reserve: come back when it is not.
            await sleep(result.retry_after - self.config.max_reserve / 2)

    async def process_response(self, request: Request, response: Response) -> Response:
        """A response whose status is one of ``REDIS_THROTTLE_PENALTY_HTTP_CODES`` pauses its
        domain for every worker (before RetryMiddleware, at 550, retries the request)."""
        if response.status not in self.config.penalty_codes:
            return response
        key, limit = self._penalized(request)
        if limit is None:
            return response
        self.stats.inc_value(f"{STATS_PREFIX}/penalties/{response.status}")
        retry_after = parse_retry_after(
            response.headers.get(b"Retry-After"), response.headers.get(b"Date")
        )
        penalty = await self.budget.penalize(key, limit, retry_after)
        backoff = self.config.backoff
        if penalty is None:  # Redis is unavailable: this worker pauses alone
            pause = min(backoff.longest, backoff.first if retry_after is None else retry_after)
            self.pauses.pause(key, pause)
            logger.warning(
                "Redis throttle: %(status)d from %(key)r: pausing it for %(pause).1f s in this "
                "worker only (Redis is unavailable)",
                {"status": response.status, "key": key, "pause": pause},
                extra=self._log_extra(),
            )
            return response
        self.pauses.pause(key, penalty.pause)
        if not penalty.changed:  # answers to requests sent before the pause
            logger.debug(
                "Redis throttle: %(status)d from %(key)r, already paused for %(pause).1f s",
                {"status": response.status, "key": key, "pause": penalty.pause},
                extra=self._log_extra(),
            )
            return response
        self.stats.inc_value(f"{STATS_PREFIX}/pauses")
        self.stats.max_value(f"{STATS_PREFIX}/pause_max", penalty.pause)
        logger.info(
            "Redis throttle: %(status)d from %(key)r (%(why)s): no request to it for "
            "%(pause).1f s, from any worker",
            {
                "status": response.status,
                "key": key,
                "why": f"Retry-After: {retry_after:g} s"
                if retry_after is not None
                else f"no Retry-After, penalty {penalty.strikes} in a row",
                "pause": penalty.pause,
            },
            extra=self._log_extra(),
        )
        await self._slow_down(request, key, limit, f"{response.status} from {key!r}", penalty.pause)
        return response

    async def process_exception(self, request: Request, exception: Exception) -> None:
        """A download timeout lowers its domain's adaptive rate, if that is on."""
        if self.config.adaptive is None or not isinstance(exception, DOWNLOAD_TIMEOUTS):
            return
        key, limit = self._penalized(request)
        if limit is not None:
            self.stats.inc_value(f"{STATS_PREFIX}/adaptive/timeouts")
            await self._slow_down(request, key, limit, f"download timeout at {key!r}")

    def _penalized(self, request: Request) -> tuple[str, Limit | None]:
        """The key and limit a failure of *request* counts against (no limit: against none,
        the request is not throttled or opted out)."""
        meta = request.meta
        if meta.get("dont_redis_throttle") or meta.get("redis_throttle_penalty", True) is False:
            return "", None
        key = self._key(request)
        return key, self._limit(key)

    async def _slow_down(
        self, request: Request, key: str, limit: Limit, cause: str, hold: float = 0
    ) -> None:
        """Lower *key*'s adaptive rate for the fleet after a failure of *request*."""
        now = asyncio.get_running_loop().time()
        sent_at = request.meta.get(SENT_META, now)
        slowdown = await self.budget.slow_down(key, limit, max(0.0, now - sent_at), hold)
        if slowdown is None or not slowdown.lowered:
            return
        self.pauses.pause(key, slowdown.void)  # this worker's reservations, before the message
        self.stats.inc_value(f"{STATS_PREFIX}/adaptive/lowered")
        logger.info(
            "Redis throttle: %(cause)s: its rate for the fleet is now %(rate)s (configured: "
            "%(limit)s); without failures it is back in %(back).0f s",
            {
                "cause": cause,
                "rate": format_rate(slowdown.rate),
                "limit": limit,
                "back": slowdown.back_in,
            },
            extra=self._log_extra(),
        )

    def _limit(self, key: str) -> Limit | None:
        """The limit of requests throttled under *key* ("" for data: and file: URLs: None)."""
        if not key:
            return None
        return self.crawl_delays.limit(key, self.config.limits.lookup(key))

    def _may_go(self, key: str, reserved_at: float, moment: float) -> bool:
        """Whether a request may go at the *moment* it reserved at *reserved_at* (see
        :meth:`.Pauses.voided`): not if a pause, or a change of the rate, voided it since; it
        must ask Redis again."""
        if self.pauses.voided(key, reserved_at, moment):
            self.stats.inc_value(f"{STATS_PREFIX}/paused_reservations")
            return False
        return True

    def _went(self, request: Request, key: str, started: float, delayed: bool) -> None:
        """Count a request that leaves for the download."""
        stats = self.stats
        self.activity.went(key)
        if self.config.adaptive is not None:
            request.meta[SENT_META] = asyncio.get_running_loop().time()
        stats.inc_value(f"{STATS_PREFIX}/requests")
        if not delayed:
            stats.inc_value(f"{STATS_PREFIX}/allowed_immediately")
            return
        waited = asyncio.get_running_loop().time() - started
        stats.inc_value(f"{STATS_PREFIX}/delayed")
        total_key = f"{STATS_PREFIX}/wait_time_total"
        stats.set_value(total_key, stats.get_value(total_key, 0.0) + waited)
        stats.max_value(f"{STATS_PREFIX}/wait_time_max", waited)

    def _park(
        self, request: Request, key: str, limit: Limit, result: AcquireResult, reserved_at: float
    ) -> Request:
        """Hand the request back to the scheduler, which keeps it out of the downloader until
        shortly before it may go."""
        if result.reserved or result.paused:
            delay = result.retry_after
        else:
            # Due when its tokens can be reserved, counting that the scheduler gives it back
            # RELEASE_AHEAD early (or it would come back too early, again and again); spread
            # out, so that the requests parked together do not all come back at once.
            delay = (
                result.retry_after
                + RELEASE_AHEAD
                - self.config.max_reserve * random.uniform(0.5, 1)
            )
        logger.debug(
            "Redis throttle: %(request)s parked for %(delay).3f s for %(key)r (%(limit)s)",
            {"request": request, "delay": delay, "key": key, "limit": limit},
            extra=self._log_extra(),
        )
        self.stats.inc_value(f"{STATS_PREFIX}/park_requests")
        self.activity.park(key, 1)
        park = {"delay": delay, "reserved": result.reserved, "reserved_at": reserved_at}
        return request.replace(meta={**request.meta, PARK_META: park})

    def _key(self, request: Request) -> str:
        key = request.meta.get("redis_throttle_key")
        if key is None:
            return self.crawler.engine.downloader.get_slot_key(request).lower()
        if isinstance(key, str) and key:
            return key.lower()
        self._bad_meta(request, f"redis_throttle_key must be a non-empty string, got {key!r}")

    def _cost(self, request: Request, limit: Limit) -> float:
        cost = request.meta.get("redis_throttle_cost", 1)
        if (
            isinstance(cost, bool)
            or not isinstance(cost, (int, float))
            or not math.isfinite(cost)
            or cost <= 0
        ):
            self._bad_meta(request, f"redis_throttle_cost must be a positive number, got {cost!r}")
        if cost > limit.max_cost:
            self._bad_meta(
                request,
                f"redis_throttle_cost {cost!r} exceeds {limit.max_cost:g}, the burst or count "
                f"of {limit} for this domain, so the request could never go",
            )
        return float(cost)

    def _bad_meta(self, request: Request, message: str) -> NoReturn:
        self.stats.inc_value(f"{STATS_PREFIX}/invalid_meta")
        raise InvalidThrottleMeta(f"{message} ({request})")
