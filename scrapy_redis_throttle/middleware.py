"""Downloader middleware that makes every request wait for its domain's shared budget in Redis.

The middleware is thin: it asks :class:`.ResilientBucket` (the shared budget, and what happens
while Redis fails), waits in :mod:`.waiting` or parks in :mod:`.parking`, and hands 429/503
responses to :mod:`.penalties`. Its settings are read by :class:`.ThrottleConfig`, and listed
with their defaults in the settings reference (``docs/reference/settings.rst``); its meta keys
in ``docs/reference/meta.rst``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from scrapy import exceptions, signals
from scrapy.utils.asyncio import is_asyncio_available
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet.error import TCPTimedOutError
from twisted.internet.error import TimeoutError as TwistedTimeoutError

from .activity import Activity
from .clock import Clock
from .config import STATS_PREFIX, ThrottleConfig
from .connection import close, connect
from .crawl_delay import CrawlDelays
from .domains import Domains
from .engine_hooks import attach, engine_scheduler
from .errors import ThrottleConfigError
from .gc_freeze import freeze_startup_objects
from .penalties import Pauses, parse_retry_after
from .rates import format_rate
from .redis_schema import penalty_channel
from .rejections import Rejections
from .resilience import ResilientBucket
from .startup import describe_setup, setup_warnings
from .tickets import TICKET_META
from .waiting import SENT_META, Turns

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from .parking import ParkingArea
    from .rates import Limit

logger = logging.getLogger(__name__)

# The other budgets (see .scopes) a parked request's moment was reserved in.
OTHERS_META = "_redis_throttle_others"

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
        self.budget = ResilientBucket(
            self.redis,
            self.config,
            crawler.stats,
            self._log_extra,
            self.clock,
            fleet_size=lambda: self.activity.fleet_size,
        )
        self.parking: ParkingArea | None = None
        self.rejections = Rejections(crawler.stats, self._log_extra)
        self.domains = Domains(
            self.config.scope,
            crawler.stats,
            self.config.crawl.dns_timeout,
            self.config.other_scopes,
        )
        # The domain each request in flight was throttled under: its failure counts against
        # that one (a new look might differ: the "ip" scope's DNS may answer otherwise).
        self._sent: WeakKeyDictionary[Request, str] = WeakKeyDictionary()
        self.crawl_delays = CrawlDelays(
            crawler, self.config, self.rejections, self._log_extra, self.domains
        )
        self.pauses = Pauses(
            self.redis,
            penalty_channel(self.config.key_prefix),
            crawler.stats,
            self._log_extra,
            forget=self.budget.fallback.local.forget,
            release_parked=self._release_parked,
            # No pause is longer, nor any moment further ahead.
            longest=max(self.config.backoff.longest, self.config.max_reserve),
            clock=self.clock,
        )
        self.turns = Turns(
            self.config,
            self.budget,
            self.pauses,
            self.activity,
            crawler.stats,
            self._log_extra,
            self.clock,
        )
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self._spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    async def _spider_opened(self, spider: Spider) -> None:
        self._attach_parking()
        await self.budget.check()
        # Pauses, decreases of adaptive rates and limits changed live void reservations.
        await self.pauses.start()
        # Counts this worker in the fleet before the first request: the "local" policy's share.
        await self.activity.start()
        for line in describe_setup(self):
            logger.info("Redis throttle: %s", line, extra={"spider": spider})
        for warning in setup_warnings(self.config):
            logger.warning("Redis throttle: %s", warning, extra={"spider": spider})
        if self.config.gc_freeze:
            # Last, once the whole crawler is built: its objects are frozen too.
            frozen = freeze_startup_objects()
            if frozen:
                self.stats.set_value(f"{STATS_PREFIX}/gc_frozen_objects", frozen)
                logger.debug(
                    "Redis throttle: %(frozen)d objects of the start-up frozen out of the "
                    "garbage collector (REDIS_THROTTLE_GC_FREEZE)",
                    {"frozen": frozen},
                    extra={"spider": spider},
                )

    def _attach_parking(self) -> None:
        scheduler = engine_scheduler(self.crawler)
        if scheduler is None:  # not Scrapy's engine: requests wait in the downloader
            logger.warning(
                "Redis throttle: found no scheduler to park waiting requests beside; they wait "
                "in the downloader, holding its slots",
                extra=self._log_extra(),
            )
            return
        try:
            self.parking = attach(
                self.crawler,
                self.config,
                scheduler,
                self.rejections,
                self.clock,
                self.budget.unreserve,
                self.budget.seals,
            )
        except Exception:
            # Without parking the throttle still works: the rest of the start must happen.
            logger.exception(
                "Redis throttle: could not attach the parking area to %s; waiting requests "
                "wait in the downloader, holding its slots",
                type(scheduler).__name__,
                extra=self._log_extra(),
            )

    async def _spider_closed(self, spider: Spider) -> None:
        self.domains.close()
        await self.pauses.stop()
        await self.activity.stop()
        await self.budget.aclose()
        await close(self.redis)

    def _release_parked(self, domain: str, heard: float, until: float) -> None:
        if self.parking is not None:
            self.parking.voided(domain, heard, until)

    def _log_extra(self) -> dict[str, Any]:
        return {"spider": self.crawler.spider}

    async def process_request(self, request: Request) -> Request | None:
        stats = self.stats
        may_park, ticket = (
            (False, None) if self.parking is None else self.parking.handoff.handed_out(request)
        )
        if request.meta.get("dont_redis_throttle"):
            stats.inc_value(f"{STATS_PREFIX}/skipped")
            return None
        domain, limit = await self._budget(request)
        self._sent[request] = domain
        if ticket is not None:
            self.activity.park(ticket.domain, -1)  # back from the parking area
            if ticket.domain != domain:  # its scope names another budget now: it asks anew
                ticket = replace(ticket, domain=domain, reserved=False)
        if limit is None:
            stats.inc_value(f"{STATS_PREFIX}/unthrottled")
            return None
        others = await self._others(request, domain)
        names = [name for name, _ in others]
        if ticket is not None and request.meta.get(OTHERS_META, []) != names:
            # Its other budgets changed while it was parked (another proxy): its moment was
            # not reserved in the new ones; it asks anew.
            ticket = replace(ticket, reserved=False)
        cost = self._cost(request, limit, others)
        park = await self.turns.take(request, domain, limit, cost, ticket, may_park, others)
        if park is None:
            return None
        # Back to the engine, which hands it to the parking area (see parking.attach), with the
        # other budgets its moment is reserved in.
        meta = {**request.meta, TICKET_META: park, OTHERS_META: names}
        if not names:
            del meta[OTHERS_META]
        return request.replace(meta=meta)

    async def process_response(self, request: Request, response: Response) -> Response:
        """A response whose status is one of ``REDIS_THROTTLE_PENALTY_HTTP_CODES`` pauses its
        domain for every worker (before RetryMiddleware, at 550, retries the request)."""
        if response.status not in self.config.penalty_codes:
            return response
        domain, limit = await self._penalized(request)
        if limit is None:
            return response
        self.stats.inc_value(f"{STATS_PREFIX}/penalties/{response.status}")
        try:
            retry_after = parse_retry_after(
                response.headers.get(b"Retry-After"), response.headers.get(b"Date")
            )
        except ValueError as error:
            self.rejections.reject("retry_after", domain, str(error), "paused as without one")
            retry_after = None
        penalty = await self.budget.penalize(domain, limit, retry_after)
        backoff = self.config.backoff
        source = _source(request, domain)
        if penalty is None:  # Redis is unavailable: this worker pauses alone
            pause = min(backoff.longest, backoff.first if retry_after is None else retry_after)
            self.pauses.pause(domain, pause)
            logger.warning(
                "Redis throttle: %(status)d from %(source)s: pausing it for %(pause).1f s in this "
                "worker only (Redis is unavailable)",
                {"status": response.status, "source": source, "pause": pause},
                extra=self._log_extra(),
            )
            return response
        self.pauses.pause(domain, penalty.pause)
        if not penalty.changed:  # answers to requests sent before the pause
            logger.debug(
                "Redis throttle: %(status)d from %(source)s, already paused for %(pause).1f s",
                {"status": response.status, "source": source, "pause": penalty.pause},
                extra=self._log_extra(),
            )
            return response
        self.stats.inc_value(f"{STATS_PREFIX}/pauses")
        self.stats.max_value(f"{STATS_PREFIX}/pause_max", penalty.pause)
        logger.info(
            "Redis throttle: %(status)d from %(source)s (%(why)s): no request to it for "
            "%(pause).1f s, from any worker",
            {
                "status": response.status,
                "source": source,
                "why": f"Retry-After: {retry_after:g} s"
                if retry_after is not None
                else f"no Retry-After, penalty {penalty.strikes} in a row",
                "pause": penalty.pause,
            },
            extra=self._log_extra(),
        )
        await self._slow_down(
            request, domain, limit, f"{response.status} from {source}", penalty.pause
        )
        return response

    async def process_exception(self, request: Request, exception: Exception) -> None:
        """A download timeout lowers its domain's adaptive rate, if that is on."""
        if self.config.adaptive is None or not isinstance(exception, DOWNLOAD_TIMEOUTS):
            return
        domain, limit = await self._penalized(request)
        if limit is not None:
            self.stats.inc_value(f"{STATS_PREFIX}/adaptive/timeouts")
            cause = f"download timeout at {_source(request, domain)}"
            await self._slow_down(request, domain, limit, cause)

    async def _penalized(self, request: Request) -> tuple[str, Limit | None]:
        """The domain and limit a failure of *request* counts against (no limit: against none,
        the request is not throttled or opted out)."""
        meta = request.meta
        if meta.get("dont_redis_throttle") or meta.get("redis_throttle_penalty", True) is False:
            return "", None
        domain = self._sent.get(request)
        if domain is None:
            return await self._budget(request)
        return domain, self._limit(domain)

    async def _slow_down(
        self, request: Request, domain: str, limit: Limit, cause: str, hold: float = 0
    ) -> None:
        """Lower *domain*'s adaptive rate for the fleet after a failure of *request*."""
        now = self.clock.monotonic()
        sent_at = request.meta.get(SENT_META, now)
        slowdown = await self.budget.slow_down(domain, limit, max(0.0, now - sent_at), hold)
        if slowdown is None or not slowdown.lowered:
            return
        self.pauses.pause(domain, slowdown.void)  # this worker's reservations, before the message
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

    async def _budget(self, request: Request) -> tuple[str, Limit | None]:
        """The request's domain (see :mod:`.domains`) and its limit (None: unthrottled; so are
        data: and file: URLs, whose domain is "")."""
        domain = await self.domains.of(request)
        if not domain:
            return "", None
        return domain, self._limit(domain)

    async def _others(self, request: Request, domain: str) -> list[tuple[str, Limit]]:
        """The budgets of the request's other scopes that have a limit (see
        :meth:`.Domains.others`): by their names, as a domain's, without Crawl-delay (a
        robots.txt sets its domain's)."""
        others = []
        for name, scope in await self.domains.others(request, domain):
            limit = self.config.limits.lookup(name, scope.wildcards_cover_domains)
            if limit is not None:
                others.append((name, limit))
        return others

    def _limit(self, domain: str) -> Limit | None:
        configured = self.config.limits.lookup(domain, self.config.scope.wildcards_cover_domains)
        return self.crawl_delays.limit(domain, configured)

    def _cost(self, request: Request, limit: Limit, others: list[tuple[str, Limit]]) -> float:
        cost = request.meta.get("redis_throttle_cost", 1)
        if (
            isinstance(cost, bool)
            or not isinstance(cost, (int, float))
            or not math.isfinite(cost)
            or cost <= 0
        ):
            self.domains.bad_meta(
                request, f"redis_throttle_cost must be a positive number, got {cost!r}"
            )
        if cost > limit.max_cost:
            self.domains.bad_meta(
                request,
                f"redis_throttle_cost {cost!r} exceeds {limit.max_cost:g}, the burst or count "
                f"of {limit} for this domain, so the request could never go",
            )
        for name, other in others:
            if cost > other.burst:
                self.domains.bad_meta(
                    request,
                    f"redis_throttle_cost {cost!r} exceeds {other.burst}, the burst of {other} "
                    f"for {name!r}, so the request could never go",
                )
        return float(cost)


def _source(request: Request, domain: str) -> str:
    """Where a failure came from, for the log: the domain, with the host that answered when
    the scope makes them differ ("'www.shop.com' (domain 'shop.com')": it pauses all of it)."""
    host = urlparse_cached(request).hostname
    return repr(domain) if not host or host == domain else f"{host!r} (domain {domain!r})"
