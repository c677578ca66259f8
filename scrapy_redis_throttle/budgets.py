"""What a request draws on, resolved once per request: its domain (see :mod:`.domains`) and that
domain's limit, the budgets of its other scopes (see :mod:`.scopes`), and its cost
(``redis_throttle_cost``), each checked here, so that what crosses into a request's turn is one
valid :class:`RequestBudget`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple
from weakref import WeakKeyDictionary

if TYPE_CHECKING:
    from scrapy import Request

    from .config import ThrottleConfig
    from .crawl_delay import CrawlDelays
    from .domains import Domains
    from .rates import Limit


class Budget(NamedTuple):
    """One bucket a request draws on: its *name* (a domain, or what another scope names, such
    as a proxy) and its *limit*."""

    name: str
    limit: Limit


@dataclass(frozen=True)
class RequestBudget:
    """What one throttled request draws on."""

    domain: str
    """The domain it is throttled under: its pauses, adaptive rate, Crawl-delay and logs."""
    limit: Limit
    """The domain's limit, after Crawl-delay."""
    others: tuple[Budget, ...] = ()
    """The budgets of its other scopes that have a limit, which must allow it too."""
    cost: float = 1.0
    """The tokens it takes of each (``redis_throttle_cost``)."""

    @property
    def other_names(self) -> list[str]:
        return [name for name, _ in self.others]


class Budgets:
    """Resolves each request's :class:`RequestBudget` by *config*'s limits, *domains* and the
    robots.txt *crawl_delays*; and, for a failure of a request it resolved, the domain and
    limit the failure counts against."""

    def __init__(self, config: ThrottleConfig, domains: Domains, crawl_delays: CrawlDelays) -> None:
        self._config = config
        self._domains = domains
        self._crawl_delays = crawl_delays
        # The domain each request in flight was throttled under: its failure counts against
        # that one (a new look might differ: the "ip" scope's DNS may answer otherwise).
        self._sent: WeakKeyDictionary[Request, str] = WeakKeyDictionary()

    async def of(self, request: Request) -> RequestBudget | None:
        """*request*'s budget (None: it is not throttled); :exc:`.InvalidThrottleMeta`
        (counted) for a meta value that names no budget, or a cost it could never pay."""
        domain = await self._domains.of(request)
        self._sent[request] = domain
        limit = self.limit(domain)
        if limit is None:
            return None
        others = await self._others(request, domain)
        return RequestBudget(domain, limit, others, self._cost(request, limit, others))

    def domain_of(self, request: Request) -> str | None:
        """The domain *request* was throttled under (None: not resolved)."""
        return self._sent.get(request)

    async def failed(self, request: Request) -> tuple[str, Limit | None]:
        """The domain and limit a failure of *request* counts against (no limit: against none,
        the request is not throttled or opted out)."""
        meta = request.meta
        if meta.get("dont_redis_throttle") or meta.get("redis_throttle_penalty", True) is False:
            return "", None
        domain = self._sent.get(request)
        if domain is None:
            domain = await self._domains.of(request)
        return domain, self.limit(domain)

    def limit(self, domain: str) -> Limit | None:
        """*domain*'s limit: configured, or stricter by its robots.txt (None: unthrottled; so
        is the domain "" of ``data:`` and ``file:`` URLs)."""
        if not domain:
            return None
        configured = self._config.limits.lookup(domain, self._config.scope.wildcards_cover_domains)
        return self._crawl_delays.limit(domain, configured)

    async def _others(self, request: Request, domain: str) -> tuple[Budget, ...]:
        """The budgets of the request's other scopes that have a limit (see
        :meth:`.Domains.others`): by their names, as a domain's, without Crawl-delay (a
        robots.txt sets its domain's)."""
        others = []
        for name, scope in await self._domains.others(request, domain):
            limit = self._config.limits.lookup(name, scope.wildcards_cover_domains)
            if limit is not None:
                others.append(Budget(name, limit))
        return tuple(others)

    def _cost(self, request: Request, limit: Limit, others: tuple[Budget, ...]) -> float:
        cost = request.meta.get("redis_throttle_cost", 1)
        if (
            isinstance(cost, bool)
            or not isinstance(cost, (int, float))
            or not math.isfinite(cost)
            or cost <= 0
        ):
            self._domains.bad_meta(
                request, f"redis_throttle_cost must be a positive number, got {cost!r}"
            )
        if cost > limit.max_cost:
            self._domains.bad_meta(
                request,
                f"redis_throttle_cost {cost!r} exceeds {limit.max_cost:g}, the burst or count "
                f"of {limit} for this domain, so the request could never go",
            )
        for name, other in others:
            if cost > other.burst:
                self._domains.bad_meta(
                    request,
                    f"redis_throttle_cost {cost!r} exceeds {other.burst}, the burst of {other} "
                    f"for {name!r}, so the request could never go",
                )
        return float(cost)
