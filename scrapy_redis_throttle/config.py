"""Every setting of scrapy-redis-throttle, read and validated in one place.

:class:`ThrottleConfig` is built once per crawler, at start-up; a bad value raises
:class:`ThrottleConfigError` naming the setting (or spider attribute) and the value.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus, urlsplit

from redis.connection import parse_url
from scrapy.exceptions import NotConfigured

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings

SPIDER_ATTRIBUTE = "redis_throttle_rates"
UNLIMITED = "unlimited"

DEFAULT_RATE = "1/s"
DEFAULT_BURST = 1
DEFAULT_KEY_PREFIX = "redis_throttle"
DEFAULT_MAX_HOLD = 1.0
DEFAULT_MAX_RESERVE = 300.0
DEFAULT_PROBE_INTERVAL = 5.0
DEFAULT_REPORT_INTERVAL = 5.0
# Nutch and StormCrawler cap the Crawl-delay they honour at 30 s too.
DEFAULT_MAX_CRAWL_DELAY = 30.0
DEFAULT_PENALTY_HTTP_CODES = (429, 503)
DEFAULT_PENALTY_BACKOFF = 2.0
# Of every stat: redis_throttle/<name>.
STATS_PREFIX = "redis_throttle"
DEFAULT_MAX_PAUSE = 600.0
# The longest period of a rate or window, and the slowest rate (one request per it), in seconds:
# the scripts keep moments in µs, exact in a double (lua/token_bucket.lua takes up to 1e14 µs).
MAX_PERIOD = 365 * 86400.0
DEFAULT_PENALTY_DECAY = 60.0
# AutoThrottle's AUTOTHROTTLE_MAX_DELAY is 60 s too.
DEFAULT_ADAPTIVE_MIN_RATE = "1/m"
DEFAULT_ADAPTIVE_DECREASE = 0.5
DEFAULT_ADAPTIVE_RECOVERY = 600.0
# REDIS_THROTTLE_FALLBACK_WORKERS: None divides by the number of workers seen live in Redis.
DEFAULT_FALLBACK_WORKERS = None
# REDIS_THROTTLE_ON_REDIS_ERROR: what requests do while Redis fails (see resilience.py).
FALLBACK_LOCAL = "local"
FALLBACK_OPEN = "open"
FALLBACK_WAIT = "wait"
# Short timeouts: a stalled Redis must cost a request one second, not scrapy-redis's 30 s.
# Only REDIS_THROTTLE_PARAMS may change them, not the REDIS_PARAMS made for scrapy-redis.
DEFAULT_REDIS_PARAMS: Mapping[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
# Client parameters the throttle chooses itself, with the reason.
_NO_REPLAY = "a replayed acquire could take its tokens twice; see REDIS_THROTTLE_ON_REDIS_ERROR"
_SET_BY_THE_THROTTLE = {
    "max_connections": "each script has one connection, pipelined",
    "retry": _NO_REPLAY,
    "retry_on_timeout": _NO_REPLAY,
    "retry_on_error": _NO_REPLAY,
}
_PART_OF_THE_URL = frozenset({"url", "host", "port", "db", "path"})
# What scrapy-redis's REDIS_PARAMS may hold for its own client, which the throttle does not use.
_NOT_SHARED_WITH_SCRAPY_REDIS = frozenset(
    {"redis_cls", *_SET_BY_THE_THROTTLE, *_PART_OF_THE_URL, *DEFAULT_REDIS_PARAMS}
)

_UNITS = {
    "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}  # fmt: skip
_NUMBER = r"\d+(?:\.\d+)?"
_RATE_RE = re.compile(
    rf"^\s*(?P<count>{_NUMBER})\s*/\s*(?P<multiplier>{_NUMBER})?\s*(?P<unit>[a-z]+)\s*$"
)
_PER_SECOND_RE = re.compile(rf"^\s*{_NUMBER}\s*$")
_PATTERN_RE = re.compile(r"^(\*\.)?[^\s*/]+$")


class ThrottleConfigError(ValueError):
    """A setting or spider attribute of scrapy-redis-throttle is invalid."""


class InvalidThrottleMeta(ValueError):
    """A request's ``redis_throttle_*`` meta value is invalid; that request fails."""


# Bounds on a domain's limits, as lua/token_bucket.lua keeps its work per call bounded: at most
# this many in a list...
MAX_LIMITS = 16
# ...and a sliding window's count (its log in Redis holds a member per request of the window).
MAX_SLIDING_COUNT = 10_000

TOKEN_BUCKET = "token_bucket"
FIXED_WINDOW = "fixed_window"
SLIDING_WINDOW = "sliding_window"
# How lua/token_bucket.lua names each algorithm.
ALGORITHM_CODES = {TOKEN_BUCKET: "t", FIXED_WINDOW: "f", SLIDING_WINDOW: "s"}


@dataclass(frozen=True)
class Quota:
    """One more limit of a domain, checked with its token bucket in the same call."""

    algorithm: str
    """:data:`TOKEN_BUCKET`, :data:`FIXED_WINDOW` or :data:`SLIDING_WINDOW`."""
    count: float
    """A token bucket's burst, or the requests a window allows (a whole number)."""
    period: float
    """Seconds: a token bucket's time per token, or the window."""
    text: str = field(compare=False)

    @property
    def rate(self) -> float:
        """Requests per second in the long run."""
        return (1 if self.algorithm == TOKEN_BUCKET else self.count) / self.period

    @property
    def script_args(self) -> tuple[str, str, str]:
        """As ``lua/token_bucket.lua`` takes it: algorithm, count, period in µs (whole for a
        window: ``"10/4.1s"`` is 4099999.9999999995 µs in floats)."""
        period = self.period * 1e6
        if self.algorithm != TOKEN_BUCKET:
            period = float(round(period))
        return ALGORITHM_CODES[self.algorithm], _number_text(self.count), _number_text(period)

    @property
    def script_text(self) -> str:
        """As a limit set live holds it (``lua/set_limit.lua``): ``"f1000/3600000000"``."""
        algorithm, count, period = self.script_args
        return f"{algorithm}{count}/{period}"

    def __str__(self) -> str:
        if self.algorithm == TOKEN_BUCKET:
            return f"{self.text} (burst {_number_text(self.count)})"
        return f"{self.text} ({self.algorithm.replace('_', ' ')})"


@dataclass(frozen=True)
class Limit:
    """A domain's budget: ``rate`` requests per second on average, at most ``burst`` at once,
    and the ``quotas`` it has on top, checked together in one call."""

    rate: float
    burst: int
    text: str = field(compare=False)
    quotas: tuple[Quota, ...] = ()
    windowed: bool = field(default=False, compare=False)
    """The domain has only windows: its token bucket is the one they imply (never stricter,
    see :func:`parse_limit`), shown as them."""

    @property
    def interval_us(self) -> float:
        """Microseconds to refill one token, the unit the Lua script takes."""
        return 1e6 / self.rate

    @property
    def sustained_rate(self) -> float:
        """Requests per second in the long run: the slowest of the rate and the quotas'."""
        return min([self.rate, *(quota.rate for quota in self.quotas)])

    @property
    def max_cost(self) -> float:
        """The largest cost a request can have: the burst, or a smaller quota's count."""
        return min([self.burst, *(quota.count for quota in self.quotas)])

    def __str__(self) -> str:
        parts = [] if self.windowed else [f"{self.text} (burst {self.burst})"]
        return " and ".join(parts + [str(quota) for quota in self.quotas])


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


def parse_rate(value: object, *, source: str) -> float:
    """Return requests per second from ``"5/s"``, ``"100/m"``, ``"1/10s"``, ``"3/min"`` or a number.

    *source* names where the value came from, for the error message.
    """
    count, period = _rate_parts(value, source=source)
    return count / period


def _rate_parts(value: object, *, source: str) -> tuple[float, float]:
    """A rate as (requests, per that many seconds): ``"1000/h"`` is (1000, 3600), a number of
    requests per second *n* is (n, 1)."""
    if isinstance(value, bool):
        raise ThrottleConfigError(f"{source}: invalid rate {value!r}")
    if isinstance(value, (int, float)) or (isinstance(value, str) and _PER_SECOND_RE.match(value)):
        count, period = float(value), 1.0
    elif isinstance(value, str):
        match = _RATE_RE.match(value.lower())
        if match is None:
            raise ThrottleConfigError(
                f"{source}: invalid rate {value!r}; expected e.g. '5/s', '100/m', '1000/h', "
                f"'1/10s', '2/d' or a number of requests per second"
            )
        unit = _UNITS.get(match["unit"])
        if unit is None:
            raise ThrottleConfigError(
                f"{source}: invalid rate {value!r}: unknown time unit {match['unit']!r} "
                f"(use s, m, h or d)"
            )
        period = float(match["multiplier"] or 1) * unit
        if period <= 0:
            raise ThrottleConfigError(f"{source}: invalid rate {value!r}: the period is zero")
        count = float(match["count"])
    else:
        raise ThrottleConfigError(
            f"{source}: invalid rate {value!r}: expected a string like '5/s' or a number"
        )
    if not (math.isfinite(count / period) and count > 0):
        raise ThrottleConfigError(f"{source}: rate must be positive and finite, got {value!r}")
    if period > MAX_PERIOD or count / period < 1 / MAX_PERIOD:
        raise ThrottleConfigError(
            f"{source}: rate {value!r} is too slow: at least one request per 365 days, over a "
            f"period of at most 365 days"
        )
    return count, period


def parse_positive_int(value: object, *, source: str, what: str) -> int:
    """An integer >= 1; digit strings (from ``scrapy crawl -s NAME=3``) are accepted."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ThrottleConfigError(f"{source}: {what} must be an integer >= 1, got {value!r}")
    return value


def parse_burst(value: object, *, source: str) -> int:
    return parse_positive_int(value, source=source, what="burst")


def parse_limit(value: object, *, default_burst: int, source: str) -> Limit | None:
    """Parse a limit: ``"5/s"``, a number, ``{"rate": ..., "burst": ..., "algorithm": ...}``, a
    list of those (every one applies), or ``None`` / ``"unlimited"`` for no limit (returned as
    ``None``).

    The first token bucket is the domain's own (see :class:`Limit`); the others are its quotas.
    A token bucket after the first item of a list is a quota: its burst is its count unless set
    ("1000/h" may spend 1000 at once, as redis_rate's ``PerHour(1000)``).
    A domain with only windows gets the token bucket they imply, which never refuses what they
    allow: N per W allows at most N + N * T / W requests in any T seconds when it slides, at most
    2N + N * T / W when fixed: a bucket of rate N / W and burst N, or 2N.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == UNLIMITED):
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ThrottleConfigError(f"{source}: an empty list of limits (use None for none)")
        if len(value) > MAX_LIMITS:
            raise ThrottleConfigError(
                f"{source}: {len(value)} limits; a domain has at most {MAX_LIMITS}"
            )
        parsed = [
            _parse_quota(item, None if n else default_burst, f"{source}[{n}]")
            for n, item in enumerate(value)
        ]
    else:
        parsed = [_parse_quota(value, default_burst, source)]
    quotas = [quota for quota, _ in parsed]
    for own, (quota, rate) in enumerate(parsed):
        if quota.algorithm == TOKEN_BUCKET:
            others = tuple(quotas[:own] + quotas[own + 1 :])
            return Limit(rate, int(quota.count), quota.text, others)
    first, rate = parsed[0]
    burst = first.count if first.algorithm == SLIDING_WINDOW else 2 * first.count
    return Limit(rate, int(burst), first.text, tuple(quotas), windowed=True)


def _parse_quota(value: object, default_burst: int | None, source: str) -> tuple[Quota, float]:
    """The quota *value* describes, and its rate in requests per second. A token bucket's burst
    is *default_burst*, or its rate's count when None."""
    algorithm, burst, rate = TOKEN_BUCKET, default_burst, value
    if isinstance(value, Mapping):
        unknown = set(value) - {"rate", "burst", "algorithm"}
        if unknown:
            raise ThrottleConfigError(
                f"{source}: unknown key(s) {sorted(map(str, unknown))} in {dict(value)!r}; "
                f"allowed: 'rate', 'burst', 'algorithm'"
            )
        if "rate" not in value:
            raise ThrottleConfigError(f"{source}: {dict(value)!r} has no 'rate'")
        rate, algorithm = value["rate"], value.get("algorithm", TOKEN_BUCKET)
        if algorithm not in ALGORITHM_CODES:
            raise ThrottleConfigError(
                f"{source}: unknown algorithm {algorithm!r}; expected one of "
                f"{', '.join(map(repr, ALGORITHM_CODES))}"
            )
        if "burst" in value and algorithm != TOKEN_BUCKET:
            raise ThrottleConfigError(
                f"{source}: a {algorithm} has no burst (it allows the rate's count at once), "
                f"got {dict(value)!r}"
            )
        if "burst" in value:
            burst = parse_burst(value["burst"], source=source)
    count, period = _rate_parts(rate, source=source)
    text = _rate_text(rate, count / period)
    if algorithm == TOKEN_BUCKET:
        size = max(1, math.floor(count)) if burst is None else burst
        return Quota(algorithm, float(size), period / count, text), count / period
    if not count.is_integer():
        raise ThrottleConfigError(
            f"{source}: a {algorithm} counts whole requests: expected e.g. '10/2s', got {rate!r}"
        )
    if algorithm == SLIDING_WINDOW and count > MAX_SLIDING_COUNT:
        raise ThrottleConfigError(
            f"{source}: a sliding_window logs each request of its window in Redis: at most "
            f"{MAX_SLIDING_COUNT:,} per window, got {rate!r} (a fixed_window or a token bucket "
            f"counts any number)"
        )
    return Quota(algorithm, count, period, text), count / period


def _number_text(number: float) -> str:
    """*number* with every digit, and without ``.0`` when whole."""
    return str(int(number)) if number.is_integer() else repr(number)


def format_rate(rate: float) -> str:
    """*rate* (requests per second) for people: ``"2.5/s"``, or ``"1/60s"`` below one a second."""
    return f"{rate:.3g}/s" if rate >= 1 else f"1/{1 / rate:.3g}s"


def _rate_text(value: object, rate: float) -> str:
    if isinstance(value, str) and not _PER_SECOND_RE.match(value):
        return value.strip()
    return f"{rate:g}/s"


def normalize_key(name: str) -> str:
    """A throttle key (a host name, or a ``redis_throttle_key`` group), or a pattern's name, as
    requests carry it: lower case, without the trailing dot of a fully qualified name
    (``shop.example.`` is ``shop.example``), non-ASCII labels in IDNA (Scrapy's requests carry
    ``bücher.example`` as ``xn--bcher-kva.example``). ValueError (UnicodeError) for a name IDNA
    refuses (an empty or too long label)."""
    name = name.lower().removesuffix(".")
    return name if name.isascii() else name.encode("idna").decode("ascii")


def _parse_pattern(pattern: object, *, source: str) -> str:
    invalid = ThrottleConfigError(
        f"{source}: invalid domain pattern {pattern!r}; expected a host name like "
        f"'shop.example' or a wildcard like '*.cdn.example'"
    )
    if not isinstance(pattern, str) or not _PATTERN_RE.match(pattern):
        raise invalid
    wildcard, name = ("*.", pattern[2:]) if pattern.startswith("*.") else ("", pattern)
    try:
        return wildcard + normalize_key(name)
    except ValueError:
        raise invalid from None


@dataclass(frozen=True)
class LimitTable:
    """Which limit applies to a key (normally the host name; see :meth:`lookup`)."""

    exact: Mapping[str, Limit | None]
    wildcards: Mapping[str, Limit | None]  # "cdn.example" for the pattern "*.cdn.example"
    default: Limit | None

    def lookup(self, key: str) -> Limit | None:
        """Return the limit for *key*, ``None`` meaning unthrottled.

        Precedence: an exact entry, then the longest matching wildcard (``*.cdn.example``
        matches ``a.cdn.example`` and ``a.b.cdn.example``, not ``cdn.example``), then the default.
        """
        key = key.lower()
        if key in self.exact:
            return self.exact[key]
        dot = key.find(".")
        while dot != -1:
            suffix = key[dot + 1 :]
            if suffix in self.wildcards:
                return self.wildcards[suffix]
            dot = key.find(".", dot + 1)
        return self.default

    def largest_burst(self) -> int:
        """The largest burst of the limits configured (0: every domain is unlimited)."""
        limits = [*self.exact.values(), *self.wildcards.values(), self.default]
        return max((limit.burst for limit in limits if limit is not None), default=0)

    def describe(self) -> list[str]:
        def show(limit: Limit | None) -> str:
            return str(limit) if limit else UNLIMITED

        lines = [f"{host}: {show(limit)}" for host, limit in sorted(self.exact.items())]
        lines += [f"*.{suffix}: {show(limit)}" for suffix, limit in sorted(self.wildcards.items())]
        lines.append(f"other domains: {show(self.default)}")
        return lines


def _build_table(
    entries: list[tuple[str, Mapping[Any, Any]]], default: Limit | None, default_burst: int
) -> LimitTable:
    exact: dict[str, Limit | None] = {}
    wildcards: dict[str, Limit | None] = {}
    for source, mapping in entries:  # later sources override earlier ones
        for raw_pattern, spec in mapping.items():
            where = f"{source}[{raw_pattern!r}]"
            pattern = _parse_pattern(raw_pattern, source=where)
            limit = parse_limit(spec, default_burst=default_burst, source=where)
            if pattern.startswith("*."):
                wildcards[pattern[2:]] = limit
            else:
                exact[pattern] = limit
    return LimitTable(exact, wildcards, default)


@dataclass(frozen=True)
class Sentinel:
    """Redis Sentinel: the sentinels to ask for the current primary of *service*."""

    addresses: tuple[tuple[str, int], ...]
    service: str
    params: Mapping[str, Any]
    """Connection parameters for the sentinels themselves (a password, TLS, ...)."""

    def __str__(self) -> str:
        where = ", ".join(f"{host}:{port}" for host, port in self.addresses)
        return f"the primary of {self.service!r} (Redis Sentinel at {where})"


@dataclass(frozen=True)
class Cluster:
    """Redis Cluster: nodes to discover it from (any one that answers will do)."""

    addresses: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        where = ", ".join(f"{host}:{port}" for host, port in self.addresses)
        return f"Redis Cluster (seed nodes {where})"


def redact_url(url: str) -> str:
    """*url* with its password replaced, for logs and errors: the one after the user name (up
    to the last ``@``, which a password with an unencoded ``#`` or ``?`` hides from URL
    parsers) and a ``password=`` in the query (its name maybe percent-encoded). Where redis-py
    would still read a password that shows, only the scheme is shown."""
    # redis-py drops these wherever they are.
    url = url.translate(_DROPPED)
    shown = url
    scheme, separator, rest = url.partition("://")
    userinfo, at, location = rest.rpartition("@")
    if separator and at and ":" in userinfo:
        shown = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{location}"
    base, question, query = shown.partition("?")
    if question:
        shown = f"{base}?" + "&".join(
            f"{pair.partition('=')[0]}=***" if _is_password(pair) else pair
            for pair in query.split("&")
        )
    try:
        password = parse_url(url).get("password")  # type: ignore[no-untyped-call]
    except Exception:  # not a URL redis-py reads: no password it would use
        password = None
    return f"{scheme}://***" if password and str(password) in shown else shown


_DROPPED = str.maketrans("", "", "\t\r\n")


def _is_password(pair: str) -> bool:
    return unquote_plus(pair.partition("=")[0]).strip().lower() == "password"


@dataclass(frozen=True)
class CrawlSettings:
    """Scrapy's own per-process politeness settings, which can fight the shared budget (see
    :func:`.startup.setup_warnings`)."""

    download_delay: float
    autothrottle: bool
    concurrent_requests: int
    per_domain: int
    per_ip: int

    @classmethod
    def from_settings(cls, settings: BaseSettings) -> CrawlSettings:
        return cls(
            download_delay=settings.getfloat("DOWNLOAD_DELAY"),
            autothrottle=settings.getbool("AUTOTHROTTLE_ENABLED"),
            concurrent_requests=settings.getint("CONCURRENT_REQUESTS"),
            per_domain=settings.getint("CONCURRENT_REQUESTS_PER_DOMAIN"),
            per_ip=settings.getint("CONCURRENT_REQUESTS_PER_IP"),
        )


@dataclass(frozen=True)
class ThrottleConfig:
    limits: LimitTable
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
    report_interval: float
    """Seconds between two reports of this worker's activity to Redis (0: none)."""
    gc_freeze: bool
    """Freeze the start-up's objects out of Python's garbage collector at the spider's
    opening (see :mod:`scrapy_redis_throttle.gc_freeze`)."""

    @property
    def redis_location(self) -> str:
        """The throttle's Redis for logs and messages (no password)."""
        return str(self.sentinel or self.cluster or redact_url(self.redis_url))

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> ThrottleConfig:
        """Read the crawler's settings and its spider's ``redis_throttle_rates`` attribute.

        Raises :exc:`~scrapy.exceptions.NotConfigured` when ``REDIS_THROTTLE_ENABLED`` is off.
        """
        rates = getattr(crawler.spider, SPIDER_ATTRIBUTE, None)
        return cls.from_settings(crawler.settings, spider_rates=rates)

    @classmethod
    def from_settings(cls, settings: BaseSettings, spider_rates: object = None) -> ThrottleConfig:
        if not _flag(settings, "REDIS_THROTTLE_ENABLED", default=True):
            raise NotConfigured("REDIS_THROTTLE_ENABLED is False")

        default_burst = parse_burst(
            _get(settings, "REDIS_THROTTLE_DEFAULT_BURST", DEFAULT_BURST),
            source="REDIS_THROTTLE_DEFAULT_BURST",
        )
        default = parse_limit(
            _get(settings, "REDIS_THROTTLE_DEFAULT_RATE", DEFAULT_RATE),
            default_burst=default_burst,
            source="REDIS_THROTTLE_DEFAULT_RATE",
        )
        entries = [("REDIS_THROTTLE_RATES", _getdict(settings, "REDIS_THROTTLE_RATES"))]
        if spider_rates is not None:
            if not isinstance(spider_rates, Mapping):
                raise ThrottleConfigError(
                    f"spider attribute {SPIDER_ATTRIBUTE} must be a dict of domain pattern to "
                    f"rate, got {spider_rates!r}"
                )
            entries.append((f"spider attribute {SPIDER_ATTRIBUTE}", spider_rates))

        key_prefix = _get(settings, "REDIS_THROTTLE_KEY_PREFIX", DEFAULT_KEY_PREFIX)
        if not isinstance(key_prefix, str) or not key_prefix or "{" in key_prefix:
            raise ThrottleConfigError(
                f"REDIS_THROTTLE_KEY_PREFIX must be a non-empty string without '{{', "
                f"got {key_prefix!r}"
            )
        on_redis_error = _get(settings, "REDIS_THROTTLE_ON_REDIS_ERROR", FALLBACK_LOCAL)
        policies = (FALLBACK_LOCAL, FALLBACK_OPEN, FALLBACK_WAIT)
        if on_redis_error not in policies:
            raise ThrottleConfigError(
                f"REDIS_THROTTLE_ON_REDIS_ERROR must be one of {', '.join(map(repr, policies))}, "
                f"got {on_redis_error!r}"
            )

        redis_url = _redis_url(settings)
        redis_params = _redis_params(settings)
        sentinel = _sentinel(settings)
        return cls(
            on_redis_error=on_redis_error,
            fallback_workers=_fallback_workers(settings),
            probe_interval=_seconds(
                settings, "REDIS_THROTTLE_PROBE_INTERVAL", DEFAULT_PROBE_INTERVAL, minimum=0.1
            ),
            max_hold=_seconds(settings, "REDIS_THROTTLE_MAX_HOLD", DEFAULT_MAX_HOLD, minimum=0),
            report_interval=_seconds(
                settings, "REDIS_THROTTLE_REPORT_INTERVAL", DEFAULT_REPORT_INTERVAL, minimum=0
            ),
            max_reserve=_seconds(
                settings, "REDIS_THROTTLE_MAX_RESERVE", DEFAULT_MAX_RESERVE, minimum=1
            ),
            penalty_codes=_status_codes(settings, "REDIS_THROTTLE_PENALTY_HTTP_CODES"),
            backoff=Backoff(
                first=_seconds(
                    settings, "REDIS_THROTTLE_PENALTY_BACKOFF", DEFAULT_PENALTY_BACKOFF, 0.001
                ),
                longest=_seconds(settings, "REDIS_THROTTLE_MAX_PAUSE", DEFAULT_MAX_PAUSE, 0.001),
                decay=_seconds(
                    settings, "REDIS_THROTTLE_PENALTY_DECAY", DEFAULT_PENALTY_DECAY, 0.001
                ),
            ),
            adaptive=_adaptive(settings),
            crawl_delay=_flag(settings, "REDIS_THROTTLE_CRAWL_DELAY_ENABLED", default=True),
            gc_freeze=_flag(settings, "REDIS_THROTTLE_GC_FREEZE", default=True),
            max_crawl_delay=_seconds(
                settings, "REDIS_THROTTLE_MAX_CRAWL_DELAY", DEFAULT_MAX_CRAWL_DELAY, minimum=0.001
            ),
            limits=_build_table(entries, default, default_burst),
            redis_url=redis_url,
            redis_params=redis_params,
            sentinel=sentinel,
            cluster=_cluster(settings, redis_url, redis_params, sentinel),
            key_prefix=key_prefix,
        )


def _fallback_workers(settings: BaseSettings) -> int | None:
    value = _get(settings, "REDIS_THROTTLE_FALLBACK_WORKERS", DEFAULT_FALLBACK_WORKERS)
    if value is None:
        return None
    return parse_positive_int(
        value, source="REDIS_THROTTLE_FALLBACK_WORKERS", what="the number of workers"
    )


def _seconds(settings: BaseSettings, name: str, default: float, minimum: float) -> float:
    return _number(
        settings,
        name,
        default,
        lambda seconds: math.isfinite(seconds) and seconds >= minimum,
        f"a number of seconds >= {minimum:g}",
    )


def _number(
    settings: BaseSettings,
    name: str,
    default: float,
    valid: Callable[[float], bool],
    expected: str,
) -> float:
    """The setting as a float, when *valid* (NaN, from anything that is no number, is not)."""
    value = _get(settings, name, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not valid(number):
        raise ThrottleConfigError(f"{name} must be {expected}, got {value!r}")
    return number


def _adaptive(settings: BaseSettings) -> Adaptive | None:
    if not _flag(settings, "REDIS_THROTTLE_ADAPTIVE_ENABLED", default=False):
        return None
    decrease = _number(
        settings,
        "REDIS_THROTTLE_ADAPTIVE_DECREASE",
        DEFAULT_ADAPTIVE_DECREASE,
        lambda number: 0 < number < 1,
        "a number between 0 and 1 (both excluded)",
    )
    return Adaptive(
        min_rate=parse_rate(
            _get(settings, "REDIS_THROTTLE_ADAPTIVE_MIN_RATE", DEFAULT_ADAPTIVE_MIN_RATE),
            source="REDIS_THROTTLE_ADAPTIVE_MIN_RATE",
        ),
        decrease=decrease,
        recovery=_seconds(
            settings, "REDIS_THROTTLE_ADAPTIVE_RECOVERY", DEFAULT_ADAPTIVE_RECOVERY, 0.001
        ),
    )


def _status_codes(settings: BaseSettings, name: str) -> frozenset[int]:
    value = _get(settings, name, DEFAULT_PENALTY_HTTP_CODES)
    try:
        codes = settings.getlist(name, list(DEFAULT_PENALTY_HTTP_CODES))
        statuses = frozenset(int(code) for code in codes)
    except (TypeError, ValueError):
        statuses = frozenset({0})
    if isinstance(value, (bool, int)) or not all(100 <= code <= 599 for code in statuses):
        raise ThrottleConfigError(
            f"{name} must be a list of HTTP status codes (100-599), got {value!r}"
        )
    return statuses


def _flag(settings: BaseSettings, name: str, *, default: bool) -> bool:
    try:
        return settings.getbool(name, default)
    except ValueError as exc:  # Scrapy's message does not name the setting
        raise ThrottleConfigError(
            f"{name} must be True or False (or 1, 0, 'true', 'false'), got {settings[name]!r}"
        ) from exc


def _get(settings: BaseSettings, name: str, default: object) -> Any:
    """The setting's value, *default* only when it is not set at all (``settings.get`` would also
    replace an explicit ``None``, which means "unlimited" for a rate)."""
    return settings[name] if settings.getpriority(name) is not None else default


def _getdict(settings: BaseSettings, name: str) -> Mapping[Any, Any]:
    try:
        return settings.getdict(name)
    except (ValueError, TypeError) as exc:  # not a dict, nor a JSON object string
        value = settings.get(name)
        # Connection parameters may hold a password: their type only.
        shown = f"a {type(value).__name__}" if name.endswith("PARAMS") else repr(value)
        raise ThrottleConfigError(f"{name} must be a dict, got {shown}") from exc


def _redis_url(settings: BaseSettings, own_setting: str | None = "REDIS_THROTTLE_URL") -> str:
    """The Redis scrapy-redis uses: *own_setting*, else REDIS_URL, else REDIS_PARAMS' url, else
    REDIS_HOST/PORT/DB (or REDIS_PARAMS' host/port/db), as scrapy-redis reads them."""
    shared_params = _getdict(settings, "REDIS_PARAMS")
    candidates = [
        ("REDIS_URL", settings.get("REDIS_URL")),
        ("REDIS_PARAMS['url']", shared_params.get("url")),
    ]
    if own_setting:
        candidates.insert(0, (own_setting, settings.get(own_setting)))
    for name, url in candidates:
        if url:
            if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "unix"):
                shown = redact_url(url) if isinstance(url, str) else type(url).__name__
                raise ThrottleConfigError(
                    f"{name} must be a redis://, rediss:// or unix:// URL, got {shown!r}"
                )
            return url
    host = settings.get("REDIS_HOST") or shared_params.get("host") or "localhost"
    port = settings.get("REDIS_PORT") or shared_params.get("port") or 6379
    db = settings.get("REDIS_DB") or shared_params.get("db") or 0
    return f"redis://{host}:{port}/{db}"


def queue_redis_connection(settings: BaseSettings) -> tuple[str, dict[str, Any]]:
    """URL and asyncio client parameters of scrapy-redis's own Redis (its queue), read as
    ``scrapy_redis.connection.get_redis_from_settings`` reads them: with scrapy-redis's
    scheduler, the parking area lives there, with the queue (see :mod:`.parking`)."""
    from scrapy_redis import defaults

    params = {**defaults.REDIS_PARAMS, **_getdict(settings, "REDIS_PARAMS")}
    allowed = _connection_parameters() - {"encoding", "decode_responses"}  # members are bytes
    return _redis_url(settings, own_setting=None), {
        key: value for key, value in params.items() if key in allowed
    }


@functools.cache
def _connection_parameters() -> frozenset[str]:
    """Every keyword argument the throttle's redis.asyncio connections accept."""
    from redis.asyncio import connection

    names: set[str] = set()
    for cls in (connection.AbstractConnection, connection.Connection, connection.SSLConnection):
        names.update(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "kwargs", *_SET_BY_THE_THROTTLE, *_PART_OF_THE_URL})


def _addresses(settings: BaseSettings, name: str) -> list[tuple[str, int]]:
    """The setting's "host:port" entries (a list, or a string separated by commas)."""
    value = _get(settings, name, [])
    try:
        entries = settings.getlist(name, [])
    except (TypeError, ValueError) as exc:
        raise ThrottleConfigError(f"{name} must be a list of 'host:port', got {value!r}") from exc
    addresses = []
    for entry in entries:
        host, _, port = str(entry).strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ThrottleConfigError(
                f"{name} must be a list of 'host:port', got {value!r} ({entry!r})"
            )
        addresses.append((host, int(port)))
    return addresses


def _sentinel(settings: BaseSettings) -> Sentinel | None:
    """REDIS_THROTTLE_SENTINELS ("host:port" each), REDIS_THROTTLE_SENTINEL_SERVICE and
    REDIS_THROTTLE_SENTINEL_PARAMS; None without sentinels."""
    name = "REDIS_THROTTLE_SENTINELS"
    addresses = _addresses(settings, name)
    service = _get(settings, "REDIS_THROTTLE_SENTINEL_SERVICE", None)
    if not addresses:
        if service is not None:
            raise ThrottleConfigError(
                f"REDIS_THROTTLE_SENTINEL_SERVICE is {service!r} but {name} lists no sentinel"
            )
        return None
    if not isinstance(service, str) or not service:
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_SENTINEL_SERVICE must name the primary the sentinels watch "
            f"(their 'sentinel monitor <name> ...'), got {service!r}"
        )
    params = {**DEFAULT_REDIS_PARAMS, **_getdict(settings, "REDIS_THROTTLE_SENTINEL_PARAMS")}
    unknown = set(params) - _connection_parameters()
    if unknown:
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_SENTINEL_PARAMS: unknown redis-py connection parameter(s) "
            f"{sorted(unknown)}"
        )
    return Sentinel(tuple(addresses), service, params)


def _cluster(
    settings: BaseSettings,
    redis_url: str,
    redis_params: Mapping[str, Any],
    sentinel: Sentinel | None,
) -> Cluster | None:
    """REDIS_THROTTLE_CLUSTER_NODES ("host:port" each); None without them. The URL and the
    parameters must suit a cluster client."""
    name = "REDIS_THROTTLE_CLUSTER_NODES"
    addresses = _addresses(settings, name)
    if not addresses:
        return None
    if sentinel is not None:
        raise ThrottleConfigError(
            f"{name} and REDIS_THROTTLE_SENTINELS are both set: the throttle's Redis is either "
            f"a cluster or a Sentinel-managed primary"
        )
    url = urlsplit(redis_url)
    if url.scheme == "unix":
        raise ThrottleConfigError(
            f"{name}: a cluster is reached over TCP, but the URL is {redact_url(redis_url)!r} "
            f"(REDIS_THROTTLE_URL gives the cluster's user, password and TLS)"
        )
    if url.path.strip("/") not in ("", "0"):
        raise ThrottleConfigError(
            f"{name}: a cluster has database 0 alone, but the URL is {redact_url(redis_url)!r} "
            f"(REDIS_THROTTLE_URL gives the cluster's user, password and TLS)"
        )
    unknown = set(redis_params) - _cluster_parameters()
    if unknown:
        raise ThrottleConfigError(
            f"{name}: redis-py's cluster client does not take the connection parameter(s) "
            f"{sorted(unknown)} (of REDIS_THROTTLE_PARAMS or REDIS_PARAMS)"
        )
    return Cluster(tuple(addresses))


@functools.cache
def _cluster_parameters() -> frozenset[str]:
    """Every keyword argument redis-py's asyncio cluster client accepts."""
    from redis.asyncio import RedisCluster

    return frozenset(inspect.signature(RedisCluster.__init__).parameters)


def _redis_params(settings: BaseSettings) -> dict[str, Any]:
    """Client parameters: our defaults < scrapy-redis's REDIS_PARAMS < REDIS_THROTTLE_PARAMS.

    From REDIS_PARAMS, what only scrapy-redis's client should use (its 30 s timeouts among them)
    is left out."""
    params: dict[str, Any] = dict(DEFAULT_REDIS_PARAMS)
    allowed = _connection_parameters()
    for name in ("REDIS_PARAMS", "REDIS_THROTTLE_PARAMS"):
        own = name == "REDIS_THROTTLE_PARAMS"
        for key, value in _getdict(settings, name).items():
            if key in _SET_BY_THE_THROTTLE and own:
                raise ThrottleConfigError(
                    f"{name}: {key!r} is set by the throttle itself ({_SET_BY_THE_THROTTLE[key]})"
                )
            if not own and key in _NOT_SHARED_WITH_SCRAPY_REDIS:
                continue
            if key in allowed:
                params[key] = value
            else:
                raise ThrottleConfigError(
                    f"{name}: unknown redis-py connection parameter {key!r}"
                    + (" (host, port and db go in the URL)" if key in _PART_OF_THE_URL else "")
                )
    return params
