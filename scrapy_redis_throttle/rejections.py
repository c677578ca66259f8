"""Values a site sent that the throttle refused (a ``Retry-After`` it cannot read, a robots.txt
``Crawl-delay`` that is no number of seconds): each counted, and logged once per domain; and
:class:`Once`, what every part that logs a thing once keeps of what it logged."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .stats import STATS_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy.statscollectors import StatsCollector

logger = logging.getLogger(__name__)

# Domains a kind of rejection was logged for, at the most: past them it is only counted, so that
# a crawl that meets 100,000 hostile hosts keeps a bounded memory (and log).
LOGGED_DOMAINS = 1000


class Once:
    """The things logged once already, by kind: each key once, and at most LOGGED_DOMAINS keys
    of a kind (past them nothing more of it is logged), so that memory and the log stay
    bounded however many domains a crawl meets."""

    def __init__(self) -> None:
        self._logged: dict[str, set[str]] = {}

    def done(self, kind: str, key: str = "") -> bool:
        """Whether *key* of *kind* is not to be logged: it was, or the kind has all it may."""
        return key in self._logged.get(kind, ()) or self.full(kind)

    def first(self, kind: str, key: str = "") -> bool:
        """Whether *key* of *kind* is to be logged now (then it is not again)."""
        if self.done(kind, key):
            return False
        self._logged.setdefault(kind, set()).add(key)
        return True

    def full(self, kind: str) -> bool:
        """Whether *kind* has all the keys it may: the last one logged was its last."""
        return len(self._logged.get(kind, ())) >= LOGGED_DOMAINS


class Rejections:
    """Counts each refused value in ``redis_throttle/rejected/<kind>`` and logs the first of
    each kind per domain, as a WARNING that says what the throttle does instead."""

    def __init__(self, stats: StatsCollector, log_extra: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        """Where they are counted (and what else the values' readers count)."""
        self._log_extra = log_extra
        self._once = Once()

    def reject(self, kind: str, domain: str, reason: str, instead: str) -> None:
        """Count a value of *kind* from *domain* refused for *reason*; *instead*: what the
        throttle does."""
        stat = f"{STATS_PREFIX}/rejected/{kind}"
        self.stats.inc_value(stat)
        if not self._once.first(kind, domain):
            return
        more = (
            f"; no more are logged (counted in {stat})"
            if self._once.full(kind)
            else f" (logged once per domain, counted in {stat})"
        )
        logger.warning(
            "Redis throttle: ignored %(reason)s from %(domain)r: %(instead)s%(more)s",
            {"reason": reason, "domain": domain, "instead": instead, "more": more},
            extra=self._log_extra(),
        )
