"""What the throttle tells the user at start-up: one line on what this set-up will do, the
limits, and a warning for each per-process setting that fights the shared budget; and, last,
the start-up's objects frozen out of the garbage collector (see :mod:`.gc_freeze`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .gc_freeze import freeze_startup_objects
from .rates import format_rate
from .redis_parking import RedisParking
from .scopes import HOST, IP, PROXY, REGISTRABLE_DOMAIN
from .stats import STATS_PREFIX

if TYPE_CHECKING:
    from scrapy.statscollectors import StatsCollector

    from .config import ThrottleConfig
    from .crawl_delay import CrawlDelays
    from .fallback import Fallback
    from .parking import ParkingArea

logger = logging.getLogger(__name__)

_SCOPES = {
    HOST: "each host",
    REGISTRABLE_DOMAIN: "each registrable domain",
    IP: "each server address",
    PROXY: "each proxy",
}


def announce(
    config: ThrottleConfig,
    stats: StatsCollector,
    parking: ParkingArea | None,
    fallback: Fallback,
    crawl_delays: CrawlDelays,
    extra: dict[str, Any],
) -> None:
    """Log the start-up's lines and warnings (see :func:`describe_setup`), then freeze the
    start-up's objects (last, once the whole crawler is built: its objects are frozen too),
    with REDIS_THROTTLE_GC_FREEZE."""
    for line in describe_setup(config, parking, fallback, crawl_delays):
        logger.info("Redis throttle: %s", line, extra=extra)
    for warning in setup_warnings(config, parking):
        logger.warning("Redis throttle: %s", warning, extra=extra)
    frozen = freeze_startup_objects() if config.gc_freeze else 0
    if frozen:
        stats.set_value(f"{STATS_PREFIX}/gc_frozen_objects", frozen)
        logger.debug(
            "Redis throttle: %(frozen)d objects of the start-up frozen out of the garbage "
            "collector (REDIS_THROTTLE_GC_FREEZE)",
            {"frozen": frozen},
            extra=extra,
        )


def describe_setup(
    config: ThrottleConfig,
    parking: ParkingArea | None,
    fallback: Fallback,
    crawl_delays: CrawlDelays,
) -> list[str]:
    """The log lines of the start-up, the first one saying what this set-up will do (waiting
    requests are held in *parking*, else in the downloader; *fallback* says what happens while
    Redis fails)."""
    if parking is None:
        waiting = "waiting requests are held in the downloader"
    elif isinstance(parking.store, RedisParking):
        waiting = (
            f"requests that must wait over {config.max_hold:g} s are parked for the fleet in "
            f"scrapy-redis's Redis ({parking.store.key})"
        )
    else:
        waiting = f"requests that must wait over {config.max_hold:g} s are parked in this process"
    codes = "/".join(map(str, sorted(config.penalty_codes)))
    lines = [
        f"one budget per domain (a domain: {_SCOPES.get(config.scope.name, config.scope.name)}"
        + "".join(
            f"; and one per {_SCOPES.get(scope.name, scope.name).removeprefix('each ')}"
            for scope in config.other_scopes
        )
        + f", REDIS_THROTTLE_SCOPE) shared in {config.redis_location} (key prefix "
        f"{config.key_prefix!r}); {waiting}; "
        + (f"a {codes} pauses its domain for every worker; " if codes else "")
        + f"if Redis fails, {fallback.describe()}",
        "limits:\n  " + "\n  ".join(config.limits.describe()),
    ]
    slot = _slot_line(config)
    if slot is not None:
        lines.append(slot)
    crawl_delay = crawl_delays.describe()
    if crawl_delay is not None:
        lines.append(crawl_delay)
    adaptive = config.adaptive
    if adaptive is not None:
        lines.append(
            f"adaptive rate: each {f'pause after a {codes} and each ' if codes else ''}"
            f"download timeout multiplies a domain's rate by {adaptive.decrease:g} (down to "
            f"{format_rate(adaptive.min_rate)}); it climbs back to the configured rate within "
            f"{adaptive.recovery:g} s without failures"
        )
    return lines


def setup_warnings(config: ThrottleConfig, parking: ParkingArea | None) -> list[str]:
    """What in this set-up works against a fleet sharing its budgets, each with the setting to
    change: a scheduler whose queue is this process's (requests parked in memory: the workers
    share no queue), and Scrapy's per-process politeness settings that fight the shared budget
    (the slot settings that hold a domain below its budget are warned of per domain, see
    :mod:`.slot_caps`)."""
    warnings = []
    if parking is not None and not isinstance(parking.store, RedisParking):
        warnings.append(
            "the scheduler is not scrapy-redis's: each worker crawls a queue of its own, and "
            "the workers do not share one (they share the budgets only): set SCHEDULER = "
            "'scrapy_redis.scheduler.Scheduler' for a fleet"
        )
    if config.crawl.autothrottle:
        warnings.append(
            "AUTOTHROTTLE_ENABLED = True sets each worker's own delay per download slot from "
            "its own latencies, which fights the shared budget: set AUTOTHROTTLE_ENABLED = "
            "False (REDIS_THROTTLE_ADAPTIVE_ENABLED = True slows a struggling domain down for "
            "the whole fleet)"
        )
    return warnings


def _slot_line(config: ThrottleConfig) -> str | None:
    """What the throttle's own download slot takes over from Scrapy's slot settings."""
    if config.download_slot is None:
        return None
    crawl = config.crawl
    lifted = [f"DOWNLOAD_DELAY = {crawl.download_delay:g}"] if crawl.download_delay else []
    lifted += [
        f"{name} = {value}"
        for name, value in (
            ("CONCURRENT_REQUESTS_PER_DOMAIN", crawl.per_domain),
            ("CONCURRENT_REQUESTS_PER_IP", crawl.per_ip),
        )
        if 0 < value < crawl.concurrent_requests
    ]
    settings = f" ({', '.join(lifted)} apply to the others)" if lifted else ""
    return (
        f"the requests it paces go through the download slot {config.download_slot!r} "
        "(REDIS_THROTTLE_DOWNLOAD_SLOT), without Scrapy's per-domain delay and concurrency: "
        f"the shared budget paces them{settings}"
    )
