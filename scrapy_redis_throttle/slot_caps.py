"""Scrapy's per-process caps of a domain's download slot, against its shared budget.

``DOWNLOAD_DELAY`` lets each worker send a domain one request per delay, and
``CONCURRENT_REQUESTS_PER_DOMAIN`` (or ``_PER_IP``) so many at a time: on top of the shared
budget, they hold a fleet below it (Scrapy's project template sets both to 1). The add-on sends
the paced requests through a download slot of their own instead (``REDIS_THROTTLE_DOWNLOAD_SLOT``);
without it, each domain whose budget they hold down is named in one WARNING, with the cap and
the setting.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .rates import format_rate
from .rejections import Once

if TYPE_CHECKING:
    from collections.abc import Callable

    from .config import CrawlSettings
    from .fleet import Fleet
    from .rates import Limit

logger = logging.getLogger(__name__)


class SlotCaps:
    """Warns once per domain whose budget *crawl*'s slot settings hold the fleet (of
    *fleet*'s workers, this one if unknown) below."""

    def __init__(
        self,
        crawl: CrawlSettings,
        fleet: Fleet,
        log_extra: Callable[[], dict[str, Any]],
    ) -> None:
        self._crawl = crawl
        self._fleet = fleet
        self._log_extra = log_extra
        self._once = Once()

    def check(self, domain: str, limit: Limit, latency: float | None) -> None:
        """Warn if the slot settings hold *domain*, limited to *limit*, below it, a response
        having taken *latency* seconds (None: not known)."""
        if self._once.done("slot_cap", domain):
            return
        workers = self._fleet.fleet_size or 1
        cap = self._cap(workers, latency)
        if cap is None or cap[0] >= limit.sustained_rate:
            return
        self._once.first("slot_cap", domain)
        rate, setting, per_worker = cap
        logger.warning(
            "Redis throttle: %(setting)s lets each worker send %(domain)r %(per_worker)s: with "
            "%(workers)d worker(s), at most %(rate)s, below its shared limit %(limit)s; remove "
            "it, or enable the add-on (ADDONS), which lifts it for the domains the throttle "
            "paces (logged once per domain)",
            {
                "setting": setting,
                "domain": domain,
                "per_worker": per_worker,
                "workers": workers,
                "rate": format_rate(rate),
                "limit": limit,
            },
            extra=self._log_extra(),
        )

    def _cap(self, workers: int, latency: float | None) -> tuple[float, str, str] | None:
        """The lowest cap of a fleet of *workers* on a domain (requests per second), its
        setting, and what it lets one worker do."""
        crawl = self._crawl
        caps = []
        if crawl.download_delay > 0:
            caps.append(
                (
                    workers / crawl.download_delay,
                    f"DOWNLOAD_DELAY = {crawl.download_delay:g}",
                    f"one request every {crawl.download_delay:g} s",
                )
            )
        name, concurrency = (
            ("CONCURRENT_REQUESTS_PER_IP", crawl.per_ip)
            if crawl.per_ip
            else ("CONCURRENT_REQUESTS_PER_DOMAIN", crawl.per_domain)
        )
        if concurrency > 0 and latency:
            caps.append(
                (
                    workers * concurrency / latency,
                    f"{name} = {concurrency}",
                    f"{concurrency} request(s) at a time, each answered in {latency:.2f} s",
                )
            )
        return min(caps, default=None)
