"""What the fleet does when a site pushes back: a response whose status is one of
``REDIS_THROTTLE_PENALTY_HTTP_CODES`` (429, 503) pauses its domain for every worker (see
:mod:`.pauses`), and, with the adaptive rate on, lowers its rate for the fleet, as a download
timeout does."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scrapy import exceptions
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet.error import TCPTimedOutError
from twisted.internet.error import TimeoutError as TwistedTimeoutError

from .metrics import RETRY_AFTER
from .pauses import parse_retry_after
from .rates import format_rate
from .stats import STATS_PREFIX
from .waiting import SENT_META

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request
    from scrapy.http import Response
    from scrapy.statscollectors import StatsCollector

    from .budgets import Budgets
    from .clock import Clock
    from .config import ThrottleConfig
    from .metrics import ThrottleMetrics
    from .pauses import Pauses
    from .rates import Limit
    from .rejections import Rejections
    from .resilience import ResilientBucket

logger = logging.getLogger(__name__)

# Download timeouts: Scrapy's own exception since 2.19, Twisted's before (and TCP connects').
DOWNLOAD_TIMEOUTS = (
    getattr(exceptions, "DownloadTimeoutError", TwistedTimeoutError),
    TwistedTimeoutError,
    TCPTimedOutError,
)


class Pushback:
    """Pauses and slow-downs of the domains whose sites push back, for the fleet."""

    def __init__(
        self,
        config: ThrottleConfig,
        budgets: Budgets,
        bucket: ResilientBucket,
        pauses: Pauses,
        rejections: Rejections,
        stats: StatsCollector,
        metrics: ThrottleMetrics,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
    ) -> None:
        self._metrics = metrics
        self._config = config
        self._budgets = budgets
        self._bucket = bucket
        self._pauses = pauses
        self._rejections = rejections
        self._stats = stats
        self._log_extra = log_extra
        self._clock = clock

    async def response(self, request: Request, response: Response) -> Response:
        """A response whose status is one of ``REDIS_THROTTLE_PENALTY_HTTP_CODES`` pauses its
        domain for every worker (before RetryMiddleware, at 550, retries the request)."""
        if response.status not in self._config.penalty_codes:
            return response
        domain, limit = await self._budgets.failed(request)
        if limit is None:
            return response
        self._stats.inc_value(f"{STATS_PREFIX}/penalties/{response.status}")
        try:
            retry_after = parse_retry_after(
                response.headers.get(b"Retry-After"),
                response.headers.get(b"Date"),
                self._clock.wall(),
            )
        except ValueError as error:
            self._rejections.reject("retry_after", domain, str(error), "paused as without one")
            retry_after = None
        reason = str(response.status) if retry_after is None else RETRY_AFTER
        penalty = await self._bucket.penalize(domain, limit, retry_after)
        backoff = self._config.backoff
        source = _source(request, domain)
        if penalty is None:  # Redis is unavailable: this worker pauses alone
            pause = min(backoff.longest, backoff.first if retry_after is None else retry_after)
            self._pauses.pause(domain, pause)
            self._metrics.paused(domain, reason)
            logger.warning(
                "Redis throttle: %(status)d from %(source)s: pausing it for %(pause).1f s in this "
                "worker only (Redis is unavailable)",
                {"status": response.status, "source": source, "pause": pause},
                extra=self._log_extra(),
            )
            return response
        self._pauses.pause(domain, penalty.pause, at_us=penalty.at_us)
        if not penalty.changed:  # answers to requests sent before the pause
            logger.debug(
                "Redis throttle: %(status)d from %(source)s, already paused for %(pause).1f s",
                {"status": response.status, "source": source, "pause": penalty.pause},
                extra=self._log_extra(),
            )
            return response
        self._stats.inc_value(f"{STATS_PREFIX}/pauses")
        self._metrics.paused(domain, reason)
        self._stats.max_value(f"{STATS_PREFIX}/pause_max", penalty.pause)
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

    async def exception(self, request: Request, exception: Exception) -> None:
        """A download timeout lowers its domain's adaptive rate, if that is on."""
        if self._config.adaptive is None or not isinstance(exception, DOWNLOAD_TIMEOUTS):
            return
        domain, limit = await self._budgets.failed(request)
        if limit is not None:
            self._stats.inc_value(f"{STATS_PREFIX}/adaptive/timeouts")
            cause = f"download timeout at {_source(request, domain)}"
            await self._slow_down(request, domain, limit, cause)

    async def _slow_down(
        self, request: Request, domain: str, limit: Limit, cause: str, hold: float = 0
    ) -> None:
        """Lower *domain*'s adaptive rate for the fleet after a failure of *request*."""
        now = self._clock.monotonic()
        sent_at = request.meta.get(SENT_META, now)
        slowdown = await self._bucket.slow_down(domain, limit, max(0.0, now - sent_at), hold)
        if slowdown is None or not slowdown.lowered:
            return
        # This worker's reservations, before the message.
        self._pauses.pause(domain, slowdown.void, at_us=slowdown.at_us, holds=False)
        self._stats.inc_value(f"{STATS_PREFIX}/adaptive/lowered")
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


def _source(request: Request, domain: str) -> str:
    """Where a failure came from, for the log: the domain, with the host that answered when
    the scope makes them differ ("'www.shop.com' (domain 'shop.com')": it pauses all of it)."""
    host = urlparse_cached(request).hostname
    return repr(domain) if not host or host == domain else f"{host!r} (domain {domain!r})"
