"""robots.txt ``Crawl-delay`` as a host's shared limit.

With ``ROBOTSTXT_OBEY``, Scrapy's RobotsTxtMiddleware fetches each host's robots.txt before any
other request to it, and (Scrapy 2.18+) sends the ``robots_parsed`` signal. A ``Crawl-delay``
for our user agent then becomes that host's limit, one request per delay (burst 1), unless the
configured limit is already stricter. Every worker reads the same robots.txt, and their requests
take from the same bucket in Redis: the delay holds for the whole fleet.

A worker keeps the delays of at most :data:`MAX_HOSTS` hosts: past them, the host requested least
recently is forgotten together with Scrapy's copy of its robots.txt, whose next request fetches
it again, so that the delay comes back.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet.defer import Deferred

from .rates import Limit, normalize_domain
from .scrapy_internals import robots_parsers
from .stats import STATS_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request
    from scrapy.crawler import Crawler

    from .config import ThrottleConfig
    from .domains import Domains
    from .rejections import Rejections

logger = logging.getLogger(__name__)

# The shortest Crawl-delay (seconds): a shorter one asks for no less (down to 5e-324, whose rate
# would be infinite).
MIN_CRAWL_DELAY = 0.001
# Hosts whose Crawl-delay a worker keeps, at most: a crawl of 100,000 such hosts keeps a bounded
# memory here (RobotsTxtMiddleware's cache drops those forgotten, and keeps every other host's).
MAX_HOSTS = 10_000
# Hosts looked at, least recently requested first, for one to forget.
FORGET_TRIES = 8


def parse_crawl_delay(value: object) -> float | None:
    """Seconds between two requests, from a robots.txt parser's ``crawl_delay()``: None for none
    (or 0); at least MIN_CRAWL_DELAY, maybe ``inf``; ValueError, saying why, for what is not a
    number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Crawl-delay of type {type(value).__name__}: not a number")
    try:
        seconds = float(value)
    except OverflowError:  # an int of 400 digits
        seconds = -math.inf if isinstance(value, int) and value < 0 else math.inf
    except Exception as exc:  # a custom parser's number, whose __float__ may raise anything
        raise ValueError(f"Crawl-delay of type {type(value).__name__}: {exc!r:.100}") from None
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"Crawl-delay {seconds!r}: not a number of seconds")
    return max(MIN_CRAWL_DELAY, seconds) if seconds else None


def with_crawl_delay(configured: Limit | None, delay: float) -> Limit:
    """The limit of a host whose robots.txt asks for *delay* seconds between requests: at most
    one request per *delay*, and never faster than *configured* (``None``: unlimited)."""
    quotas = () if configured is None else configured.quotas
    if configured is not None and configured.rate <= 1 / delay:
        return Limit(configured.rate, 1, f"{configured.text} (Crawl-delay {delay:g} s)", quotas)
    return Limit(1 / delay, 1, f"1/{delay:g}s (Crawl-delay)", quotas)


class CrawlDelays:
    """The hosts whose robots.txt set a Crawl-delay, and the limit each one now has."""

    def __init__(
        self,
        crawler: Crawler,
        config: ThrottleConfig,
        rejections: Rejections,
        log_extra: Callable[[], dict[str, Any]],
        domains: Domains,
    ) -> None:
        self._crawler = crawler
        self._domains = domains
        self._config = config
        self._rejections = rejections
        self._log_extra = log_extra
        # Domain -> its limit, and the netlocs (host:port) whose robots.txt set it, least
        # recently requested first.
        self._limits: OrderedDict[str, tuple[Limit, frozenset[str]]] = OrderedDict()
        # RobotsTxtMiddleware's robots.txt per netloc (looked for at the first host to forget).
        self._robots: dict[str, object] | None = None
        self._robots_looked_for = False
        self._user_agent = config.crawl.robotstxt_user_agent
        self._default_user_agent = config.crawl.user_agent
        self.active = config.crawl_delay and config.crawl.robotstxt_obey
        # Scrapy 2.18 added the signal, and RobotParser.crawl_delay().
        self._signal = getattr(signals, "robots_parsed", None)
        if self.active and self._signal is not None:
            crawler.signals.connect(self._robots_parsed, signal=self._signal)

    def describe(self) -> str | None:
        """What happens to Crawl-delay, for the start-up log; None when nothing does."""
        if not self.active:
            return None
        if self._signal is None:
            return (
                "robots.txt Crawl-delay is NOT honoured: that needs Scrapy 2.18 or newer (set "
                "REDIS_THROTTLE_CRAWL_DELAY_ENABLED = False to silence this)"
            )
        return (
            f"a robots.txt Crawl-delay (up to {self._config.max_crawl_delay:g} s, "
            f"REDIS_THROTTLE_MAX_CRAWL_DELAY) becomes its host's limit when stricter"
        )

    def limit(self, domain: str, configured: Limit | None) -> Limit | None:
        """The limit for requests of *domain*: *configured*, or a stricter one from the
        robots.txt of its host (of its hosts, the strictest, when the domain is a registrable
        domain: see :mod:`.scopes`)."""
        if not self._limits or (known := self._limits.get(domain)) is None:
            return configured
        self._limits.move_to_end(domain)
        return known[0]

    def _robots_parsed(self, robotparser: Any, request: Request) -> None:
        host = normalize_domain(urlparse_cached(request).hostname or "")  # ASCII: Scrapy's IDNA
        crawl_delay = getattr(robotparser, "crawl_delay", None)
        if not host or crawl_delay is None:  # a custom ROBOTSTXT_PARSER of the older interface
            return
        user_agent = self._user_agent or request.headers.get(
            b"User-Agent", self._default_user_agent
        )
        try:
            delay = parse_crawl_delay(crawl_delay(user_agent))
        except ValueError as error:
            self._rejections.reject("crawl_delay", host, str(error), "its configured limit applies")
            return
        if delay is None:
            return
        stats = self._crawler.stats
        if delay > self._config.max_crawl_delay:
            stats.inc_value(f"{STATS_PREFIX}/crawl_delay/capped")
            logger.warning(
                "Redis throttle: robots.txt of %r asks for a Crawl-delay of %g s; honouring "
                "%g s (REDIS_THROTTLE_MAX_CRAWL_DELAY)",
                host,
                delay,
                self._config.max_crawl_delay,
                extra=self._log_extra(),
            )
            delay = self._config.max_crawl_delay
        url = urlparse_cached(request)
        try:
            domain = self._domains.of_robots_txt(f"{url.scheme}://{url.netloc}/robots.txt")
        except ValueError as error:  # the scope's function failed for it
            self._rejections.reject("crawl_delay", host, str(error), "its configured limit applies")
            return
        # Several ports of one host, or hosts of one registrable domain, have a robots.txt each:
        # the longest delay counts.
        limit, netlocs = self._limits.pop(domain, (None, frozenset()))
        netlocs |= {url.netloc}
        if limit is not None and 1 / limit.rate >= delay:
            self._keep(domain, limit, netlocs)
            return
        configured = self._config.limits.lookup(domain, self._config.scope.wildcards_cover_domains)
        limit = with_crawl_delay(configured, delay)
        self._keep(domain, limit, netlocs)
        stats.inc_value(f"{STATS_PREFIX}/crawl_delay/applied")
        logger.info(
            "Redis throttle: honouring the Crawl-delay of %g s in the robots.txt of %r: the "
            "limit of %r is now %s (configured: %s)",
            delay,
            host,
            domain,
            limit,
            configured if configured is not None else "unlimited",
            extra=self._log_extra(),
        )

    def _keep(self, host: str, limit: Limit, netlocs: frozenset[str]) -> None:
        self._limits[host] = (limit, netlocs)
        if len(self._limits) <= MAX_HOSTS:
            return
        if not self._robots_looked_for:
            self._robots_looked_for = True
            self._robots = self._robots_cache()
        if self._robots is None:
            return  # kept: forgetting a delay Scrapy would not fetch again is impolite
        for _ in range(min(FORGET_TRIES, len(self._limits))):
            oldest, (_, oldest_netlocs) = next(iter(self._limits.items()))
            # Scrapy sends the signal before it stores the robots.txt parsed: a host forgotten
            # meanwhile would keep it stored, and never have its delay again. Later.
            if any(isinstance(self._robots.get(netloc), Deferred) for netloc in oldest_netlocs):
                self._limits.move_to_end(oldest)
                continue
            del self._limits[oldest]
            for netloc in oldest_netlocs:
                self._robots.pop(netloc, None)
            self._crawler.stats.inc_value(f"{STATS_PREFIX}/crawl_delay/forgotten")
            logger.debug(
                "Redis throttle: forgot the Crawl-delay of %r (more than %d hosts); its next "
                "request fetches its robots.txt again",
                oldest,
                MAX_HOSTS,
                extra=self._log_extra(),
            )
            return

    def _robots_cache(self) -> dict[str, object] | None:
        """RobotsTxtMiddleware's robots.txt per netloc, from which a forgotten host is dropped
        (None where the robots.txt middleware is another's: then no host is forgotten)."""
        parsers = robots_parsers(self._crawler)
        if parsers is not None:
            return parsers
        logger.warning(
            "Redis throttle: found no RobotsTxtMiddleware; the Crawl-delays of more than %d "
            "hosts are all kept",
            MAX_HOSTS,
            extra=self._log_extra(),
        )
        return None
