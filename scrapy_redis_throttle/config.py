"""The throttle's Scrapy settings and spider attribute, read and validated in one place.

:class:`ThrottleConfig` is built once per crawler, at start-up; a bad value raises
:class:`.ThrottleConfigError` naming the setting (or spider attribute) and the value. The
syntax of rates and limits is :mod:`.rates`'; the Redis connection settings are
:mod:`.redis_settings`'; each setting's value is read by :mod:`.setting_values`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scrapy.core.scheduler import BaseScheduler
from scrapy.exceptions import NotConfigured
from scrapy.utils.misc import load_object

from .errors import ThrottleConfigError
from .metrics import DEFAULT_MAX_DOMAINS
from .rates import LimitTable, build_table, parse_burst, parse_limit, parse_positive_int, parse_rate
from .redis_settings import (
    Cluster,
    Sentinel,
    queue_redis_connection,
    read_cluster,
    read_redis_params,
    read_redis_url,
    read_sentinel,
    redact_url,
)
from .scopes import HOST, PROXY, Scope, parse_scopes
from .setting_names import refuse_unknown_settings
from .setting_values import (
    get_dict,
    get_flag,
    get_number,
    get_seconds,
    get_status_codes,
    get_value,
)

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings

SPIDER_ATTRIBUTE = "redis_throttle_rates"
SCOPE_ATTRIBUTE = "redis_throttle_scope"

DEFAULT_RATE = "1/s"
DEFAULT_BURST = 1
DEFAULT_KEY_PREFIX = "redis_throttle"
DEFAULT_MAX_HOLD = 1.0
DEFAULT_MAX_RESERVE = 300.0
# Also how long, after Redis is back, another worker may still pace alone (the handover, see
# fallback.py): short, so that a fleet back from an outage takes up its whole budget within a
# second. A probe is one PING a worker, one at a time.
DEFAULT_PROBE_INTERVAL = 0.5
DEFAULT_REPORT_INTERVAL = 5.0
# Scrapy's LOGSTATS_INTERVAL is 60 s too.
DEFAULT_LOG_INTERVAL = 60.0
# A worker that renews nothing for this long is taken for dead (a full GC, a slow Redis, a busy
# reactor last far less).
DEFAULT_LEASE_TTL = 30.0
# Nutch and StormCrawler cap the Crawl-delay they honour at 30 s too.
DEFAULT_MAX_CRAWL_DELAY = 30.0
DEFAULT_PENALTY_HTTP_CODES = (429, 503)
DEFAULT_PENALTY_BACKOFF = 2.0
DEFAULT_MAX_PAUSE = 600.0
DEFAULT_PENALTY_DECAY = 60.0
# AutoThrottle's AUTOTHROTTLE_MAX_DELAY is 60 s too.
DEFAULT_ADAPTIVE_MIN_RATE = "1/m"
DEFAULT_ADAPTIVE_DECREASE = 0.5
DEFAULT_ADAPTIVE_RECOVERY = 600.0
# REDIS_THROTTLE_FALLBACK_WORKERS: None divides by the number of workers seen live in Redis.
DEFAULT_FALLBACK_WORKERS = None
DEFAULT_FALLBACK_AFTER = 5.0
DEFAULT_METRICS_HOST = "127.0.0.1"
# REDIS_THROTTLE_ON_REDIS_ERROR: what requests do while Redis fails (see resilience.py).
FALLBACK_LOCAL = "local"
FALLBACK_OPEN = "open"
FALLBACK_WAIT = "wait"


@dataclass(frozen=True)
class Backoff:
    """Pauses of a domain whose site gave no Retry-After, in seconds."""

    first: float
    """The first pause; it doubles with each penalty after the previous pause ended."""
    longest: float
    """The longest pause, Retry-After included."""
    decay: float
    """Time after a pause without a penalty that undoes one doubling."""


@dataclass(frozen=True)
class Adaptive:
    """The adaptive rate: a domain's rate for the fleet, lowered when its site struggles."""

    min_rate: float
    """The floor, requests per second (a domain configured slower keeps its rate)."""
    decrease: float
    """Each 429/503 pause or timeout multiplies the rate by this (0 < decrease < 1)."""
    recovery: float
    """Seconds the rate takes to climb back from the floor to the configured rate, linearly,
    while no failure comes."""


@dataclass(frozen=True)
class MetricsSettings:
    """What the worker's metrics are served by (see :mod:`.metrics`)."""

    ports: tuple[int, int] | None
    """The ``/metrics`` endpoint takes the first free port of this range (None: no endpoint;
    ``(0, 0)``: any free port)."""
    host: str
    """The address it listens on."""
    max_domains: int
    """The domains with the most traffic that keep their own ``domain`` label."""
    otel: bool
    """The metrics also go through OpenTelemetry's global MeterProvider."""

    @property
    def on(self) -> bool:
        return self.ports is not None or self.otel


@dataclass(frozen=True)
class CrawlSettings:
    """The settings of Scrapy and scrapy-redis the throttle works with: per-process politeness
    settings that can fight the shared budget (see :func:`.startup.setup_warnings`), robots.txt
    (Crawl-delay), and scrapy-redis's Redis (the parking area lives beside its queue)."""

    download_delay: float
    autothrottle: bool
    concurrent_requests: int
    per_domain: int
    per_ip: int
    robotstxt_obey: bool
    robotstxt_user_agent: str
    user_agent: str
    twisted_reactor: object
    """``TWISTED_REACTOR``, as set (for the message when it is not asyncio's)."""
    dns_timeout: float
    """``DNS_TIMEOUT``: the longest the "ip" scope waits for a host's address."""
    queue_redis: tuple[str, Mapping[str, Any]] | ThrottleConfigError
    """URL and client parameters of scrapy-redis's Redis (see :func:`.queue_redis_connection`),
    or why they are invalid: only the parking area beside scrapy-redis's queue needs them, and
    fails alone (the throttle works without it)."""

    @classmethod
    def from_settings(cls, settings: BaseSettings) -> CrawlSettings:
        return cls(
            download_delay=settings.getfloat("DOWNLOAD_DELAY"),
            autothrottle=settings.getbool("AUTOTHROTTLE_ENABLED"),
            concurrent_requests=settings.getint("CONCURRENT_REQUESTS"),
            per_domain=settings.getint("CONCURRENT_REQUESTS_PER_DOMAIN"),
            per_ip=settings.getint("CONCURRENT_REQUESTS_PER_IP"),
            robotstxt_obey=settings.getbool("ROBOTSTXT_OBEY"),
            robotstxt_user_agent=settings.get("ROBOTSTXT_USER_AGENT") or "",
            user_agent=settings.get("USER_AGENT") or "",
            twisted_reactor=settings.get("TWISTED_REACTOR"),
            dns_timeout=settings.getfloat("DNS_TIMEOUT"),
            queue_redis=_queue_redis(settings),
        )


def _queue_redis(settings: BaseSettings) -> tuple[str, Mapping[str, Any]] | ThrottleConfigError:
    try:
        return queue_redis_connection(settings)
    except ThrottleConfigError as error:
        return error


# What ParkingScheduler composes with parking when REDIS_THROTTLE_SCHEDULER names none: Scrapy's
# own, as SCHEDULER's default.
DEFAULT_SCHEDULER = "scrapy.core.scheduler.Scheduler"


def inner_scheduler(settings: BaseSettings, composer: type) -> type[BaseScheduler]:
    """``REDIS_THROTTLE_SCHEDULER``: the scheduler *composer* (:class:`.ParkingScheduler`)
    composes with parking (the add-on sets it to the project's ``SCHEDULER``), a class or its
    import path; never *composer* itself, nor a class made from it."""
    value = settings.get("REDIS_THROTTLE_SCHEDULER") or DEFAULT_SCHEDULER
    try:
        scheduler = load_object(value) if isinstance(value, str) else value
    except (ImportError, ValueError, NameError, AttributeError) as error:
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_SCHEDULER {value!r} cannot be imported: {error}"
        ) from None
    if (
        not isinstance(scheduler, type)
        or not issubclass(scheduler, BaseScheduler)
        or composer in scheduler.__mro__
    ):
        raise ThrottleConfigError(
            "REDIS_THROTTLE_SCHEDULER must name a scheduler class to compose with parking (not "
            f"ParkingScheduler itself), got {value!r}"
        )
    return scheduler


@dataclass(frozen=True)
class ThrottleConfig:
    limits: LimitTable
    scope: Scope
    """What a limit is kept per: the scope of a request's domain (see :mod:`.scopes`)."""
    other_scopes: tuple[Scope, ...]
    """The scopes whose budgets must allow a request too (see :mod:`.scopes`)."""
    redis_url: str
    redis_params: Mapping[str, Any]
    sentinel: Sentinel | None
    """Where the sentinels are, when they name the Redis (the URL then gives the rest)."""
    cluster: Cluster | None
    """Nodes of the Redis Cluster, when the throttle's Redis is one (the URL gives the rest)."""
    key_prefix: str
    max_hold: float
    """Longest wait a request spends in the middleware when the scheduler can park it."""
    max_reserve: float
    """How far ahead a request may reserve its tokens."""
    on_redis_error: str
    """``"local"``, ``"open"`` or ``"wait"``: see :mod:`scrapy_redis_throttle.resilience`."""
    fallback_workers: int | None
    """The ``"local"`` policy paces each domain at its rate divided by this; None: by the
    number of workers that were live in Redis just before it failed."""
    fallback_after: float
    """How long, from when Redis failed, a worker of a fleet sends only the moments it
    reserved in Redis before the ``"local"`` policy paces it alone: the outage may be its
    alone (see :meth:`.Fallback.decide`)."""
    probe_interval: float
    """Longest time between two probes of a failed Redis."""
    crawl_delay: bool
    """Honour robots.txt ``Crawl-delay`` (when ``ROBOTSTXT_OBEY`` is on)."""
    max_crawl_delay: float
    """Longest ``Crawl-delay`` honoured; longer ones are taken as this."""
    penalty_codes: frozenset[int]
    """Response statuses that pause their domain for the fleet (empty: none)."""
    backoff: Backoff
    """How long such a pause is when the response has no Retry-After, and the longest."""
    adaptive: Adaptive | None
    """The adaptive rate, None when ``REDIS_THROTTLE_ADAPTIVE_ENABLED`` is off."""
    lease_ttl: float
    """Seconds without renewal after which a worker's leases expire (see :mod:`.leases`)."""
    report_interval: float
    """Seconds between two reports of this worker's activity to Redis (0: none)."""
    log_interval: float
    """Seconds between two lines of the log's summary (see :mod:`.log_summary`); 0: none."""
    crawl: CrawlSettings
    """The settings of Scrapy and scrapy-redis the throttle works with."""
    gc_freeze: bool
    """Freeze the start-up's objects out of Python's garbage collector at the spider's
    opening (see :mod:`scrapy_redis_throttle.gc_freeze`)."""
    metrics: MetricsSettings
    """The worker's metrics: its ``/metrics`` endpoint, OpenTelemetry."""
    download_slot: str | None
    """The download slot of the requests the throttle paces, without Scrapy's per-domain delay
    and concurrency (see the add-on); None: Scrapy's own slots, per domain."""

    @property
    def redis_location(self) -> str:
        """The throttle's Redis for logs and messages (no password)."""
        return str(self.sentinel or self.cluster or redact_url(self.redis_url))

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> ThrottleConfig:
        """Read the crawler's settings and its spider's ``redis_throttle_rates`` and
        ``redis_throttle_scope`` attributes.

        Raises :exc:`~scrapy.exceptions.NotConfigured` when ``REDIS_THROTTLE_ENABLED`` is off.
        """
        return cls.from_settings(
            crawler.settings,
            spider_rates=getattr(crawler.spider, SPIDER_ATTRIBUTE, None),
            spider_scope=getattr(crawler.spider, SCOPE_ATTRIBUTE, None),
        )

    @classmethod
    def from_settings(
        cls, settings: BaseSettings, spider_rates: object = None, spider_scope: object = None
    ) -> ThrottleConfig:
        if not get_flag(settings, "REDIS_THROTTLE_ENABLED", default=True):
            raise NotConfigured("REDIS_THROTTLE_ENABLED is False")
        refuse_unknown_settings(settings)

        default_burst = parse_burst(
            get_value(settings, "REDIS_THROTTLE_DEFAULT_BURST", DEFAULT_BURST),
            source="REDIS_THROTTLE_DEFAULT_BURST",
        )
        default = parse_limit(
            get_value(settings, "REDIS_THROTTLE_DEFAULT_RATE", DEFAULT_RATE),
            default_burst=default_burst,
            source="REDIS_THROTTLE_DEFAULT_RATE",
        )
        entries = [("REDIS_THROTTLE_RATES", get_dict(settings, "REDIS_THROTTLE_RATES"))]
        if spider_rates is not None:
            if not isinstance(spider_rates, Mapping):
                raise ThrottleConfigError(
                    f"spider attribute {SPIDER_ATTRIBUTE} must be a dict of domain pattern to "
                    f"rate, got {spider_rates!r}"
                )
            entries.append((f"spider attribute {SPIDER_ATTRIBUTE}", spider_rates))

        key_prefix = get_value(settings, "REDIS_THROTTLE_KEY_PREFIX", DEFAULT_KEY_PREFIX)
        if not isinstance(key_prefix, str) or not key_prefix or "{" in key_prefix:
            raise ThrottleConfigError(
                f"REDIS_THROTTLE_KEY_PREFIX must be a non-empty string without '{{', "
                f"got {key_prefix!r}"
            )
        on_redis_error = get_value(settings, "REDIS_THROTTLE_ON_REDIS_ERROR", FALLBACK_LOCAL)
        policies = (FALLBACK_LOCAL, FALLBACK_OPEN, FALLBACK_WAIT)
        if on_redis_error not in policies:
            raise ThrottleConfigError(
                f"REDIS_THROTTLE_ON_REDIS_ERROR must be one of {', '.join(map(repr, policies))}, "
                f"got {on_redis_error!r}"
            )

        redis_url = read_redis_url(settings)
        redis_params = read_redis_params(settings)
        sentinel = read_sentinel(settings)
        cluster = read_cluster(settings, redis_url, redis_params, sentinel)
        source, value = (
            ("REDIS_THROTTLE_SCOPE", get_value(settings, "REDIS_THROTTLE_SCOPE", HOST))
            if spider_scope is None
            else (f"spider attribute {SCOPE_ATTRIBUTE}", spider_scope)
        )
        scopes = parse_scopes(value, source=source)
        return cls(
            on_redis_error=on_redis_error,
            fallback_workers=_fallback_workers(settings),
            fallback_after=get_seconds(
                settings, "REDIS_THROTTLE_FALLBACK_AFTER", DEFAULT_FALLBACK_AFTER, minimum=0
            ),
            probe_interval=get_seconds(
                settings, "REDIS_THROTTLE_PROBE_INTERVAL", DEFAULT_PROBE_INTERVAL, minimum=0.1
            ),
            max_hold=get_seconds(settings, "REDIS_THROTTLE_MAX_HOLD", DEFAULT_MAX_HOLD, minimum=0),
            lease_ttl=get_seconds(settings, "REDIS_THROTTLE_LEASE_TTL", DEFAULT_LEASE_TTL, 3),
            log_interval=get_seconds(
                settings, "REDIS_THROTTLE_LOG_INTERVAL", DEFAULT_LOG_INTERVAL, minimum=0
            ),
            report_interval=get_seconds(
                settings, "REDIS_THROTTLE_REPORT_INTERVAL", DEFAULT_REPORT_INTERVAL, minimum=0
            ),
            max_reserve=get_seconds(
                settings, "REDIS_THROTTLE_MAX_RESERVE", DEFAULT_MAX_RESERVE, minimum=1
            ),
            penalty_codes=get_status_codes(
                settings, "REDIS_THROTTLE_PENALTY_HTTP_CODES", DEFAULT_PENALTY_HTTP_CODES
            ),
            backoff=Backoff(
                first=get_seconds(
                    settings, "REDIS_THROTTLE_PENALTY_BACKOFF", DEFAULT_PENALTY_BACKOFF, 0.001
                ),
                longest=get_seconds(settings, "REDIS_THROTTLE_MAX_PAUSE", DEFAULT_MAX_PAUSE, 0.001),
                decay=get_seconds(
                    settings, "REDIS_THROTTLE_PENALTY_DECAY", DEFAULT_PENALTY_DECAY, 0.001
                ),
            ),
            adaptive=_adaptive(settings),
            crawl_delay=get_flag(settings, "REDIS_THROTTLE_CRAWL_DELAY_ENABLED", default=True),
            gc_freeze=get_flag(settings, "REDIS_THROTTLE_GC_FREEZE", default=True),
            metrics=_metrics(settings),
            download_slot=_download_slot(settings),
            max_crawl_delay=get_seconds(
                settings, "REDIS_THROTTLE_MAX_CRAWL_DELAY", DEFAULT_MAX_CRAWL_DELAY, minimum=0.001
            ),
            limits=build_table(
                entries,
                default,
                default_burst,
                proxies=any(scope.name == PROXY for scope in scopes),
            ),
            scope=scopes[0],
            other_scopes=scopes[1:],
            redis_url=redis_url,
            redis_params=redis_params,
            sentinel=sentinel,
            cluster=cluster,
            key_prefix=key_prefix,
            crawl=CrawlSettings.from_settings(settings),
        )


def _fallback_workers(settings: BaseSettings) -> int | None:
    value = get_value(settings, "REDIS_THROTTLE_FALLBACK_WORKERS", DEFAULT_FALLBACK_WORKERS)
    if value is None:
        return None
    return parse_positive_int(
        value, source="REDIS_THROTTLE_FALLBACK_WORKERS", what="the number of workers"
    )


def _download_slot(settings: BaseSettings) -> str | None:
    slot = get_value(settings, "REDIS_THROTTLE_DOWNLOAD_SLOT", None)
    if slot is None:
        return None
    if not isinstance(slot, str) or not slot:
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_DOWNLOAD_SLOT must be the name of a download slot, or None, "
            f"got {slot!r}"
        )
    if slot not in get_dict(settings, "DOWNLOAD_SLOTS"):
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_DOWNLOAD_SLOT {slot!r} names no entry of DOWNLOAD_SLOTS: give it "
            f"one (the add-on does, without delay)"
        )
    return slot


def _metrics(settings: BaseSettings) -> MetricsSettings:
    host = get_value(settings, "REDIS_THROTTLE_METRICS_HOST", DEFAULT_METRICS_HOST)
    if not isinstance(host, str) or not host.strip():
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_METRICS_HOST must be a host name or address, got {host!r}"
        )
    metrics = MetricsSettings(
        ports=_ports(get_value(settings, "REDIS_THROTTLE_METRICS_PORT", None)),
        host=host.strip(),
        max_domains=parse_positive_int(
            get_value(settings, "REDIS_THROTTLE_METRICS_MAX_DOMAINS", DEFAULT_MAX_DOMAINS),
            source="REDIS_THROTTLE_METRICS_MAX_DOMAINS",
            what="the number of domains",
        ),
        otel=get_flag(settings, "REDIS_THROTTLE_METRICS_OTEL", default=False),
    )
    if metrics.ports is not None:
        needs_extra("REDIS_THROTTLE_METRICS_PORT", "prometheus_client", "metrics")
    if metrics.otel:
        needs_extra("REDIS_THROTTLE_METRICS_OTEL", "opentelemetry.metrics", "otel")
    return metrics


def needs_extra(what: str, module: str, extra: str) -> None:
    """Raise :exc:`.ThrottleConfigError` when *what* (a setting, a command) needs *module*,
    which the package's *extra* installs, and it is missing."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise ThrottleConfigError(
            f"{what} needs {module.partition('.')[0]}: install the {extra!r} extra (from a "
            f"checkout of scrapy-redis-throttle: pip install './scrapy-redis-throttle[{extra}]')"
        ) from None


def _ports(value: object) -> tuple[int, int] | None:
    """``REDIS_THROTTLE_METRICS_PORT``: None, a port, or a range ``[low, high]`` (a list, or a
    string ``"low,high"`` from ``scrapy crawl -s``) as Scrapy's ``TELNETCONSOLE_PORT``."""
    if value is None:
        return None
    parts: object = value.split(",") if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)):
        parts = [parts]
    ports = [_port(part) for part in parts]
    valid = [port for port in ports if port is not None]
    if len(valid) != len(ports) or len(valid) not in (1, 2) or valid[0] > valid[-1]:
        raise ThrottleConfigError(
            "REDIS_THROTTLE_METRICS_PORT must be a port (0-65535; 0: any free one) or a range "
            f"[low, high] of them, got {value!r}"
        )
    return valid[0], valid[-1]


def _port(value: object) -> int | None:
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        return None
    return value


def _adaptive(settings: BaseSettings) -> Adaptive | None:
    if not get_flag(settings, "REDIS_THROTTLE_ADAPTIVE_ENABLED", default=False):
        return None
    decrease = get_number(
        settings,
        "REDIS_THROTTLE_ADAPTIVE_DECREASE",
        DEFAULT_ADAPTIVE_DECREASE,
        lambda number: 0 < number < 1,
        "a number between 0 and 1 (both excluded)",
    )
    return Adaptive(
        min_rate=parse_rate(
            get_value(settings, "REDIS_THROTTLE_ADAPTIVE_MIN_RATE", DEFAULT_ADAPTIVE_MIN_RATE),
            source="REDIS_THROTTLE_ADAPTIVE_MIN_RATE",
        ),
        decrease=decrease,
        recovery=get_seconds(
            settings, "REDIS_THROTTLE_ADAPTIVE_RECOVERY", DEFAULT_ADAPTIVE_RECOVERY, 0.001
        ),
    )
