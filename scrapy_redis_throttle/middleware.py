"""Downloader middleware that makes every request wait for its domain's shared budget in Redis.

The middleware is thin: it builds the throttle's parts and hands each request along its path:
:mod:`.budgets` resolves what it draws on, :mod:`.waiting` decides its turn (asking
:class:`.ResilientBucket`: the shared bucket, and what happens while Redis fails), and
:mod:`.parking` keeps it while its moment is far; responses go to :mod:`.pushback`. Its
settings are read by :class:`.ThrottleConfig`, and listed with their defaults in the settings
reference (``docs/reference/settings.rst``); its meta keys in ``docs/reference/meta.rst``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.utils.asyncio import is_asyncio_available
from scrapy.utils.httpobj import urlparse_cached

from .activity import Activity
from .budgets import Budgets
from .clock import Clock
from .config import STATS_PREFIX, ThrottleConfig
from .connection import close, connect
from .crawl_delay import CrawlDelays
from .domains import Domains
from .engine_hooks import attach_parking, engine_closing
from .errors import ThrottleConfigError
from .metrics import CANCELED, REJECTED, UNTHROTTLED, ThrottleMetrics, WorkerState
from .metrics_endpoint import MetricsEndpoint, WorkerCollector
from .penalties import Pause, Pauses
from .pushback import Pushback
from .redis_schema import penalty_channel
from .rejections import Once, Rejections
from .resilience import ResilientBucket, redis_error_stat
from .slot_caps import SlotCaps
from .startup import announce
from .tasks import cancel_and_wait
from .tickets import OTHERS_META, TICKET_META
from .waiting import WENT, DroppedAtClose, Turns

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from .parking import ParkingArea

logger = logging.getLogger(__name__)

# How often the middleware looks whether the engine closes the spider (Scrapy sends no signal).
CLOSE_LOOK = 0.25
# Scrapy's meta key of a request's download slot.
DOWNLOAD_SLOT_META = "download_slot"


class RedisThrottleMiddleware:
    def __init__(self, crawler: Crawler) -> None:
        self.config = ThrottleConfig.from_crawler(crawler)
        if not is_asyncio_available():
            raise ThrottleConfigError(
                "scrapy-redis-throttle needs the asyncio reactor, or none (TWISTED_REACTOR_ENABLED "
                "= False, Scrapy 2.15+): set TWISTED_REACTOR = "
                "'twisted.internet.asyncioreactor.AsyncioSelectorReactor' (Scrapy's default), "
                f"got {self.config.crawl.twisted_reactor!r}"
            )
        self.crawler = crawler
        self.stats = crawler.stats
        self.clock = Clock()
        self.redis = connect(self.config)
        self.activity = Activity(
            self.redis,
            self.config.key_prefix,
            self.config.report_interval,
            crawler.stats,
            self._log_extra,
            self.clock,
        )
        self.bucket = ResilientBucket(
            self.redis,
            self.config,
            crawler.stats,
            self._log_extra,
            self.clock,
            fleet_size=lambda: self.activity.fleet_size,
        )
        self.metrics = ThrottleMetrics(
            self.config.metrics.on,
            self.config.metrics.max_domains,
            WorkerState(
                fallback_active=lambda: self.bucket.breaker.open_for() is not None,
                fleet_workers=lambda: self.activity.fleet_size,
                redis_errors=self._redis_errors,
            ),
        )
        if self.config.metrics.otel:
            from .otel import instrument

            instrument(self.metrics)
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._close_watch: asyncio.Task[None] | None = None
        self._once = Once()
        self.parking: ParkingArea | None = None
        self.rejections = Rejections(crawler.stats, self._log_extra)
        self.domains = Domains(
            self.config.scope,
            crawler.stats,
            self.config.crawl.dns_timeout,
            self.config.other_scopes,
        )
        self.crawl_delays = CrawlDelays(
            crawler, self.config, self.rejections, self._log_extra, self.domains
        )
        self.budgets = Budgets(self.config, self.domains, self.crawl_delays)
        self.slot_caps = SlotCaps(
            self.config.crawl, lambda: self.activity.fleet_size, self._log_extra
        )
        self.pauses = Pauses(
            self.redis,
            penalty_channel(self.config.key_prefix),
            crawler.stats,
            self._log_extra,
            forget=self.bucket.fallback.local.forget,
            release_parked=self._release_parked,
            # No pause is longer, nor any moment further ahead.
            longest=max(self.config.backoff.longest, self.config.max_reserve),
            clock=self.clock,
            check_state=self.bucket.check_state,
        )
        self.turns = Turns(
            self.config,
            self.bucket,
            self.pauses,
            self.activity,
            crawler.stats,
            self.metrics,
            self._log_extra,
            self.clock,
        )
        self.pushback = Pushback(
            self.config,
            self.budgets,
            self.bucket,
            self.pauses,
            self.rejections,
            crawler.stats,
            self.metrics,
            self._log_extra,
            self.clock,
        )
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self._spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    async def _spider_opened(self, spider: Spider) -> None:
        self.parking = attach_parking(
            self.crawler, self.config, self.rejections, self.clock, self.bucket, self.metrics
        )
        await self.bucket.check()
        # Pauses, decreases of adaptive rates and limits changed live void reservations.
        await self.pauses.start()
        # Counts this worker in the fleet before the first request: the "local" policy's share.
        await self.activity.start()
        self._serve_metrics()
        self._close_watch = asyncio.get_running_loop().create_task(self._watch_the_close())
        announce(self, spider)

    async def _spider_closed(self, spider: Spider) -> None:
        if self._close_watch is not None:
            await cancel_and_wait(self._close_watch, "the watch of the close")
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        self.domains.close()
        await self.pauses.stop()
        await self.activity.stop()
        await self.bucket.aclose()
        await close(self.redis)

    def _release_parked(self, domain: str, pause: Pause) -> None:
        if self.parking is not None:
            self.parking.void(domain, pause)

    async def _watch_the_close(self) -> None:
        """Once the engine closes the spider, no held request waits again (for Redis, for a
        domain paused, for a moment too far to reserve): the close waits for none of them."""
        while not engine_closing(self.crawler):
            await self.clock.sleep(CLOSE_LOOK)
        self.turns.closing = True
        self.bucket.closing()

    def _serve_metrics(self) -> None:
        """Start the ``/metrics`` endpoint, if ``REDIS_THROTTLE_METRICS_PORT`` is set; without
        a free port the crawl goes on without it (an ERROR says so)."""
        settings = self.config.metrics
        if settings.ports is None:
            return
        try:
            self.metrics_endpoint = MetricsEndpoint.start(
                WorkerCollector(self.metrics.snapshot), settings.host, settings.ports
            )
        except OSError as error:
            low, high = settings.ports
            logger.error(
                "Redis throttle: no metrics endpoint: REDIS_THROTTLE_METRICS_PORT %(ports)s has "
                "no free port on %(host)r (%(error)s)",
                {
                    "ports": low if low == high else f"{low}-{high}",
                    "host": settings.host,
                    "error": error,
                },
                extra=self._log_extra(),
            )
            return
        logger.info(
            "Redis throttle: metrics at http://%(host)s:%(port)d/metrics",
            {"host": self.metrics_endpoint.host, "port": self.metrics_endpoint.port},
            extra=self._log_extra(),
        )

    def _redis_errors(self) -> dict[str, int]:
        """Failed Redis calls by exception, from the stats (see :mod:`.resilience`)."""
        prefix = redis_error_stat("")
        return {
            key[len(prefix) :]: int(value)
            for key, value in list(self.stats.get_stats().items())
            if key.startswith(prefix)
        }

    def _log_extra(self) -> dict[str, Any]:
        return {"spider": self.crawler.spider}

    async def process_request(self, request: Request) -> Request | None:
        try:
            return await self._turn(request)
        except asyncio.CancelledError:
            self.metrics.request(self._domain_of(request), CANCELED)
            raise
        except DroppedAtClose:
            self.metrics.request(self._domain_of(request), CANCELED)
            self._dropped_at_close(request)
            raise
        except Exception:
            self.metrics.request(self._domain_of(request), REJECTED)
            raise

    def _dropped_at_close(self, request: Request) -> None:
        self.stats.inc_value(f"{STATS_PREFIX}/dropped_at_close")
        if self._once.first("dropped_at_close"):
            logger.info(
                "Redis throttle: the spider closes: %(request)s, which would wait again for "
                "its turn and cannot be parked, is dropped, as are the others like it (counted "
                "in %(stat)s)",
                {"request": request, "stat": f"{STATS_PREFIX}/dropped_at_close"},
                extra=self._log_extra(),
            )

    def _domain_of(self, request: Request) -> str:
        """The domain *request* counts under in the metrics: its budget's, else its host (a
        request failed before its domain was known, or with ``dont_redis_throttle``)."""
        return self.budgets.domain_of(request) or urlparse_cached(request).hostname or ""

    async def _turn(self, request: Request) -> Request | None:
        may_park, ticket = (
            (False, None) if self.parking is None else self.parking.handoff.handed_out(request)
        )
        if request.meta.get("dont_redis_throttle"):
            self.stats.inc_value(f"{STATS_PREFIX}/skipped")
            self.metrics.request(self._domain_of(request), UNTHROTTLED)
            self._unpaced(request)
            return None
        budget = await self.budgets.of(request)
        if ticket is not None:
            self.activity.park(ticket.domain, -1)  # back from the parking area
        if budget is None:
            self.stats.inc_value(f"{STATS_PREFIX}/unthrottled")
            self.metrics.request(self._domain_of(request), UNTHROTTLED)
            self._unpaced(request)
            return None
        lend = None
        if ticket is None and self.parking is not None and not budget.others and _robots(request):
            # Its worker's requests of the domain back from the parking area wait for it:
            # it goes at the soonest moment one of them holds (see Handoff.lend).
            lend = functools.partial(self.parking.handoff.lend, budget.domain)
            ticket = lend()
        others = budget.other_names
        if ticket is not None and (
            ticket.domain != budget.domain or request.meta.get(OTHERS_META, []) != others
        ):
            # Its scope names another domain now, or its other budgets changed while it was
            # parked (another proxy): its moment was not reserved in them; it asks anew.
            ticket = replace(ticket, domain=budget.domain, reserved=False)
        park = await self.turns.take(request, budget, ticket, may_park, lend)
        if park is WENT:
            if self.config.download_slot is not None:
                # Not through its domain's slot, whose per-process delay and concurrency would
                # hold it below the shared budget (a slot the project chose stays).
                request.meta.setdefault(DOWNLOAD_SLOT_META, self.config.download_slot)
            return None
        # Back to the engine, which hands it to the parking area (see engine_hooks.attach), with
        # the other budgets its moment is reserved in.
        meta = {**request.meta, TICKET_META: park, OTHERS_META: others}
        if not others:
            del meta[OTHERS_META]
        return request.replace(meta=meta)

    def _unpaced(self, request: Request) -> None:
        """A request the throttle does not pace goes through its domain's own slot (one that
        followed a redirect from a paced domain carries the throttle's)."""
        if (
            self.config.download_slot is not None
            and request.meta.get(DOWNLOAD_SLOT_META) == self.config.download_slot
        ):
            del request.meta[DOWNLOAD_SLOT_META]

    async def process_response(self, request: Request, response: Response) -> Response:
        """A 429 or 503 pauses its domain for every worker (see :mod:`.pushback`), before
        RetryMiddleware, at 550, retries the request. Without a download slot of the
        throttle's own, a domain that Scrapy's slot settings hold below its budget is warned
        of (see :mod:`.slot_caps`)."""
        if self.config.download_slot is None:
            domain = self.budgets.domain_of(request)
            limit = None if domain is None else self.budgets.limit(domain)
            if domain is not None and limit is not None:
                self.slot_caps.check(domain, limit, request.meta.get("download_latency"))
        return await self.pushback.response(request, response)

    async def process_exception(self, request: Request, exception: Exception) -> None:
        """A download timeout lowers its domain's adaptive rate, if that is on."""
        await self.pushback.exception(request, exception)


def _robots(request: Request) -> bool:
    """Whether *request* is RobotsTxtMiddleware's fetch of a robots.txt."""
    return bool(request.meta.get("dont_obey_robotstxt")) and (
        urlparse_cached(request).path == "/robots.txt"
    )
