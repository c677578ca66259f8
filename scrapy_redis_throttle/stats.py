"""The throttle's names in Scrapy's stats: every stat is ``redis_throttle/<name>``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scrapy.statscollectors import StatsCollector

STATS_PREFIX = "redis_throttle"


def redis_error_stat(error: str) -> str:
    """The stat that counts the failed Redis calls that raised *error* (an exception's name)."""
    return f"{STATS_PREFIX}/redis_errors/{error}"


def redis_errors(stats: StatsCollector) -> dict[str, int]:
    """Failed Redis calls by exception name, as counted in *stats*."""
    prefix = redis_error_stat("")
    return {
        key[len(prefix) :]: int(value)
        for key, value in list(stats.get_stats().items())
        if key.startswith(prefix)
    }
