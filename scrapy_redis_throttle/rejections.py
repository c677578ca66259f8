"""Values a site sent that the throttle refused (a ``Retry-After`` it cannot read, a robots.txt
``Crawl-delay`` that is no number of seconds): each counted, and logged once per domain."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .config import STATS_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy.statscollectors import StatsCollector

logger = logging.getLogger(__name__)

# Domains a kind of rejection was logged for, at the most: past them it is only counted, so that
# a crawl that meets 100,000 hostile hosts keeps a bounded memory (and log).
LOGGED_DOMAINS = 1000


class Rejections:
    """Counts each refused value in ``redis_throttle/rejected/<kind>`` and logs the first of
    each kind per domain, as a WARNING that says what the throttle does instead."""

    def __init__(self, stats: StatsCollector, log_extra: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        """Where they are counted (and what else the values' readers count)."""
        self._log_extra = log_extra
        self._logged: dict[str, set[str]] = {}

    def reject(self, kind: str, domain: str, reason: str, instead: str) -> None:
        """Count a value of *kind* from *domain* refused for *reason*; *instead*: what the
        throttle does."""
        stat = f"{STATS_PREFIX}/rejected/{kind}"
        self.stats.inc_value(stat)
        logged = self._logged.setdefault(kind, set())
        if domain in logged or len(logged) >= LOGGED_DOMAINS:
            return
        logged.add(domain)
        more = (
            f"; no more are logged (counted in {stat})"
            if len(logged) == LOGGED_DOMAINS
            else f" (logged once per domain, counted in {stat})"
        )
        logger.warning(
            "Redis throttle: ignored %(reason)s from %(domain)r: %(instead)s%(more)s",
            {"reason": reason, "domain": domain, "instead": instead, "more": more},
            extra=self._log_extra(),
        )
