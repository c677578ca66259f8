"""The throttle: its parts, built from its config, a clock and the scripts' calls, and their life
from the spider's open to its close. A request's path through them:

1. :mod:`.budgets` resolves what it draws on (its domain's budget, and its other scopes');
2. :mod:`.waiting` decides its turn, asking :class:`.ResilientBucket` (the shared bucket in
   Redis, and what happens while Redis fails), and :mod:`.moments` whether a reserved moment
   still holds when it comes;
3. :mod:`.parking` keeps it while its moment is far;
4. its response goes to :mod:`.pushback` (a 429 or 503 pauses its domain for the fleet).

:class:`.RedisThrottleMiddleware` hands Scrapy's requests, responses and exceptions to it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from scrapy.utils.httpobj import urlparse_cached

from .activity import Activity
from .budgets import Budgets
from .connection import close, connect
from .crawl_delay import CrawlDelays
from .domains import Domains
from .engine_hooks import attach_parking
from .log_summary import LogSummary
from .metrics import CANCELED, REJECTED, UNTHROTTLED, ThrottleMetrics, WorkerState
from .metrics_endpoint import serve
from .pauses import Pauses
from .pushback import Pushback
from .redis_schema import penalty_channel
from .rejections import Once, Rejections
from .resilience import ResilientBucket
from .scrapy_internals import engine_closing
from .slot_caps import SlotCaps
from .startup import announce
from .stats import STATS_PREFIX
from .tasks import cancel_and_wait
from .tickets import OTHERS_META, TICKET_META
from .waiting import DroppedAtClose, Turns

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response

    from .bucket import TokenBucket
    from .clock import Clock
    from .config import ThrottleConfig
    from .metrics_endpoint import MetricsEndpoint
    from .parking import ParkingArea

logger = logging.getLogger(__name__)

# How often the throttle looks whether the engine closes the spider (Scrapy sends no signal).
CLOSE_LOOK = 0.25
# Scrapy's meta key of a request's download slot.
DOWNLOAD_SLOT_META = "download_slot"


class Throttle:
    """The throttle of *crawler*'s crawl, by *config*, on *clock*. *scripts*: the calls of the
    scripts in Redis (:class:`.TokenBucket` on the configured Redis when None; a test passes
    one in memory)."""

    def __init__(
        self,
        crawler: Crawler,
        config: ThrottleConfig,
        clock: Clock,
        scripts: TokenBucket | None = None,
    ) -> None:
        stats = crawler.stats
        assert stats is not None, "Scrapy builds the stats before the middlewares"
        self.crawler = crawler
        self.config = config
        self.clock = clock
        self.stats = stats
        self.redis = connect(config)
        log_extra = self._log_extra
        self.activity = Activity(
            self.redis,
            config.key_prefix,
            config.report_interval,
            stats,
            log_extra,
            clock,
            summarized=bool(config.log_interval),
        )
        self.bucket = ResilientBucket(
            self.redis, config, stats, log_extra, clock, self.activity, scripts
        )
        self.live_limits = self.bucket.live_limits
        self.metrics = ThrottleMetrics(
            config.metrics.on,
            config.metrics.max_domains,
            WorkerState(self.bucket.breaker, self.activity, stats),
        )
        if config.metrics.otel:
            from .otel import instrument

            instrument(self.metrics)
        self.rejections = Rejections(stats, log_extra)
        self.domains = Domains(config.scope, stats, config.crawl.dns_timeout, config.other_scopes)
        self.crawl_delays = CrawlDelays(crawler, config, self.rejections, log_extra, self.domains)
        self.budgets = Budgets(config, self.domains, self.crawl_delays)
        self.slot_caps = SlotCaps(config.crawl, self.activity, log_extra)
        self.pauses = Pauses(
            self.redis,
            penalty_channel(config.key_prefix),
            stats,
            log_extra,
            self.bucket.fallback.local,
            # No pause is longer, nor any moment further ahead.
            longest=max(config.backoff.longest, config.max_reserve),
            clock=clock,
            state=self.bucket.guard,
        )
        self.log_summary = LogSummary(
            config.log_interval,
            self.activity,
            self.budgets,
            self.pauses,
            self.live_limits,
            log_extra,
            clock,
        )
        self.turns = Turns(
            config,
            self.bucket,
            self.pauses,
            self.activity,
            self.live_limits,
            stats,
            self.metrics,
            log_extra,
            clock,
        )
        self.pushback = Pushback(
            config,
            self.budgets,
            self.bucket,
            self.pauses,
            self.rejections,
            stats,
            self.metrics,
            log_extra,
            clock,
        )
        self.parking: ParkingArea | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._close_watch: asyncio.Task[None] | None = None
        self._once = Once()

    async def open(self) -> None:
        """The spider opens: park beside the engine's scheduler, read Redis, listen for the
        fleet's pauses, count this worker in the fleet, and say what this set-up does."""
        self.parking = attach_parking(
            self.crawler, self.config, self.rejections, self.clock, self.bucket, self.metrics
        )
        if self.parking is not None:
            self.turns.handoff = self.parking.handoff
            self.pauses.parking = self.parking
        await self.bucket.start()
        # Pauses, decreases of adaptive rates and limits changed live void reservations.
        await self.pauses.start()
        # Counts this worker in the fleet before the first request: the "local" policy's share.
        await self.activity.start()
        self.log_summary.start()
        self.metrics_endpoint = serve(self.config.metrics, self.metrics.snapshot, self._log_extra)
        self._close_watch = asyncio.get_running_loop().create_task(self._watch_the_close())
        announce(
            self.config,
            self.stats,
            self.parking,
            self.bucket.fallback,
            self.crawl_delays,
            self._log_extra(),
        )

    async def close(self) -> None:
        """The spider closed: stop every task, disconnect."""
        if self._close_watch is not None:
            await cancel_and_wait(self._close_watch, "the watch of the close")
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        self.domains.close()
        await self.log_summary.stop()
        await self.pauses.stop()
        await self.activity.stop()
        await self.bucket.aclose()
        await close(self.redis)

    async def _watch_the_close(self) -> None:
        """Once the engine closes the spider, no held request waits again (for Redis, for a
        domain paused, for a moment too far to reserve): the close waits for none of them."""
        while not engine_closing(self.crawler):
            await self.clock.sleep(CLOSE_LOOK)
        self.turns.closing = True
        self.bucket.closing()

    def _log_extra(self) -> dict[str, Any]:
        return {"spider": self.crawler.spider}

    async def request(self, request: Request) -> Request | None:
        """Wait for *request*'s turn: None once it may go, or the request to park (see
        :meth:`.RedisThrottleMiddleware.process_request`)."""
        try:
            # Asked of every request the engine took, so that the handoff forgets it.
            may_park, ticket = (
                (False, None) if self.parking is None else self.parking.handoff.handed_out(request)
            )
            if request.meta.get("dont_redis_throttle"):
                self.stats.inc_value(f"{STATS_PREFIX}/skipped")
                self._unpaced(request)
                return None
            budget = await self.budgets.of(request)
            if ticket is not None:
                self.activity.park(ticket.domain, -1)  # back from the parking area
            if budget is None:
                self.stats.inc_value(f"{STATS_PREFIX}/unthrottled")
                self._unpaced(request)
                return None
            park = await self.turns.take(request, budget, ticket, may_park)
            if park is None:
                if self.config.download_slot is not None:
                    # Not through its domain's slot, whose per-process delay and concurrency
                    # would hold it below the shared budget (a slot the project chose stays).
                    request.meta.setdefault(DOWNLOAD_SLOT_META, self.config.download_slot)
                return None
            # Back to the engine, which hands it to the parking area (see engine_hooks.attach),
            # with the other budgets its moment is reserved in.
            meta = {**request.meta, TICKET_META: park, OTHERS_META: budget.other_names}
            if not budget.other_names:
                del meta[OTHERS_META]
            return request.replace(meta=meta)
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

    def _unpaced(self, request: Request) -> None:
        """A request the throttle does not pace goes through its domain's own slot (one that
        followed a redirect from a paced domain carries the throttle's)."""
        self.metrics.request(self._domain_of(request), UNTHROTTLED)
        if (
            self.config.download_slot is not None
            and request.meta.get(DOWNLOAD_SLOT_META) == self.config.download_slot
        ):
            del request.meta[DOWNLOAD_SLOT_META]

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

    async def response(self, request: Request, response: Response) -> Response:
        """A 429 or 503 pauses its domain for every worker (see :mod:`.pushback`). Without a
        download slot of the throttle's own, a domain that Scrapy's slot settings hold below
        its budget is warned of (see :mod:`.slot_caps`)."""
        if self.config.download_slot is None:
            domain = self.budgets.domain_of(request)
            limit = None if domain is None else self.budgets.limit(domain)
            if domain is not None and limit is not None:
                self.slot_caps.check(domain, limit, request.meta.get("download_latency"))
        return await self.pushback.response(request, response)

    async def exception(self, request: Request, exception: Exception) -> None:
        """A download timeout lowers its domain's adaptive rate, if that is on."""
        await self.pushback.exception(request, exception)
