"""The syntax of rates and limits (``"5/s"``, ``{"rate": ..., "burst": ...}``, lists of them)
and the table of domain patterns they are given for, parsed into frozen :class:`Limit` objects.

Where the value comes from (a setting, the spider attribute, the command-line tool) is the
caller's: *source* names it in errors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ThrottleConfigError
from .redis_schema import ALGORITHM_CODES

UNLIMITED = "unlimited"
# The longest period of a rate or window, and the slowest rate (one request per it), in seconds:
# the scripts keep moments in µs, exact in a double (lua/token_bucket.lua takes up to 1e14 µs).
MAX_PERIOD = 365 * 86400.0

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
# host:port (an IPv6 address has more colons, unless in brackets).
HOST_PORT = re.compile(r"([^:]*|\[.*\]):[^:]*")


# Bounds on a domain's limits, as lua/token_bucket.lua keeps its work per call bounded: at most
# this many in a list...
MAX_LIMITS = 16
# ...and a sliding window's count (its log in Redis holds a member per request of the window).
MAX_SLIDING_COUNT = 10_000

TOKEN_BUCKET = "token_bucket"
FIXED_WINDOW = "fixed_window"
SLIDING_WINDOW = "sliding_window"


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


def limit_in_force(limit: Limit, rate: float | None) -> str:
    """The limit a request went under, for the log: the *rate* Redis paced it at (None: not
    told) where that is another than its token bucket's (a reservation's step is the bucket's,
    not the quotas'), else the configured *limit*."""
    if rate is None or format_rate(rate) == format_rate(limit.rate):
        return str(limit)
    return f"{format_rate(rate)} in force ({limit} configured)"


def normalize_domain(name: str) -> str:
    """A domain (a host name, or a ``redis_throttle_key`` group), or a pattern's name, as
    requests carry it: lower case, without the trailing dot of a fully qualified name
    (``shop.example.`` is ``shop.example``), non-ASCII labels in IDNA (Scrapy's requests carry
    ``bücher.example`` as ``xn--bcher-kva.example``). ValueError (UnicodeError) for a name IDNA
    refuses (an empty or too long label)."""
    name = name.lower().removesuffix(".")
    return name if name.isascii() else name.encode("idna").decode("ascii")


def refuse_port(name: str, *, proxies: bool, source: str) -> None:
    """A site's limit is kept under its host alone: a limit's key *name* with a port names a
    proxy (see :func:`.scopes.proxy_budget`), which only a project whose scopes count proxies
    (*proxies*) has. ThrottleConfigError, naming *source*, for any other."""
    host = name.rpartition(":")[0]
    if "/" not in name and HOST_PORT.fullmatch(name) and host and not proxies:
        raise ThrottleConfigError(
            f"{source}: {name!r:.200} has a port, but the workers keep a site's limit under its "
            f"host alone ({host!r:.200}); a host:port names a proxy, in a project whose "
            f"REDIS_THROTTLE_SCOPE counts proxies"
        )


def _parse_pattern(pattern: object, *, source: str, proxies: bool) -> str:
    invalid = ThrottleConfigError(
        f"{source}: invalid domain pattern {pattern!r:.200}; expected a host name like "
        f"'shop.example' or a wildcard like '*.cdn.example' (no scheme, no path)"
    )
    if not isinstance(pattern, str) or not _PATTERN_RE.match(pattern):
        raise invalid
    refuse_port(pattern, proxies=proxies, source=source)
    wildcard, name = ("*.", pattern[2:]) if pattern.startswith("*.") else ("", pattern)
    try:
        return wildcard + normalize_domain(name)
    except ValueError:
        raise invalid from None


@dataclass(frozen=True)
class LimitTable:
    """Which limit applies to a domain (normally the host name; see :meth:`lookup`)."""

    exact: Mapping[str, Limit | None]
    wildcards: Mapping[str, Limit | None]  # "cdn.example" for the pattern "*.cdn.example"
    default: Limit | None

    def lookup(self, domain: str, itself: bool = False) -> Limit | None:
        """Return the limit for *domain*, ``None`` meaning unthrottled.

        Precedence: an exact entry, then the longest matching wildcard (``*.cdn.example``
        matches ``a.cdn.example`` and ``a.b.cdn.example``, not ``cdn.example`` unless *itself*:
        a registrable domain, whose hosts the wildcard names), then the default.
        """
        domain = domain.lower()
        if domain in self.exact:
            return self.exact[domain]
        if itself and domain in self.wildcards:
            return self.wildcards[domain]
        dot = domain.find(".")
        while dot != -1:
            suffix = domain[dot + 1 :]
            if suffix in self.wildcards:
                return self.wildcards[suffix]
            dot = domain.find(".", dot + 1)
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


def build_table(
    entries: list[tuple[str, Mapping[Any, Any]]],
    default: Limit | None,
    default_burst: int,
    proxies: bool = False,
) -> LimitTable:
    """The limits of *entries* (later ones override earlier ones), keyed by domain pattern;
    a key with a port only where the scopes count proxies (*proxies*)."""
    exact: dict[str, Limit | None] = {}
    wildcards: dict[str, Limit | None] = {}
    for source, mapping in entries:  # later sources override earlier ones
        for raw_pattern, spec in mapping.items():
            where = f"{source}[{raw_pattern!r}]"
            pattern = _parse_pattern(raw_pattern, source=where, proxies=proxies)
            limit = parse_limit(spec, default_burst=default_burst, source=where)
            if pattern.startswith("*."):
                wildcards[pattern[2:]] = limit
            else:
                exact[pattern] = limit
    return LimitTable(exact, wildcards, default)
