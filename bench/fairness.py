"""Does a slow domain starve the others? Side by side, in one run, on one machine.

For each scenario, the free (unthrottled) domains' completion time is measured alone and with the
slow domains present, for four ways of being polite to the slow domains:

* holding: the plugin with parking off (``REDIS_THROTTLE_MAX_HOLD`` longer than any wait: a
  waiting request holds a download slot), as 0.1 behaved without its schedulers;
* parking: the plugin with Scrapy's default scheduler (parked requests wait in the process);
* parking (redis): the plugin with scrapy-redis's scheduler (parked requests wait in Redis);
* DOWNLOAD_SLOTS: no plugin, Scrapy's own per-slot delay (per process only).

Scenarios: "1 slow": CONCURRENT_REQUESTS=4, one domain at 1 request / 3 s (8 requests) and 40
requests to one free domain; "5 of 50 slow": CONCURRENT_REQUESTS=16, 5 domains at 1 request / 3 s
(8 requests each) and 45 free domains (8 requests each).

Run: ``./run bench fairness`` (about 3 minutes). Prints a table, then one JSON line.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from demo_site import DemoSite  # noqa: E402
from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from run_demo import busiest_window  # noqa: E402
from scrapy.crawler import CrawlerRunner  # noqa: E402
from scrapy.utils.defer import maybe_deferred_to_future  # noqa: E402
from spiders import UrlListSpider  # noqa: E402

SLOW_INTERVAL = 3.0
SLOW_REQUESTS = 8
SOLO_RUNS = 3


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    slow_hosts: list[str]
    free_hosts: list[str]
    free_requests: int  # per free host


def hosts(first: int, count: int) -> list[str]:
    return [f"127.0.0.{n}" for n in range(first, first + count)]


SCENARIOS = [
    Scenario("1 slow", 4, hosts(2, 1), hosts(3, 1), 40),
    Scenario("5 of 50 slow", 16, hosts(2, 5), hosts(7, 45), 8),
]
MODES = ["holding", "parking", "parking (redis)", "DOWNLOAD_SLOTS"]


def settings_for(mode: str, scenario: Scenario, redis_url: str) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "CONCURRENT_REQUESTS": scenario.concurrency,
        "CONCURRENT_REQUESTS_PER_DOMAIN": scenario.concurrency,
        "DOWNLOAD_DELAY": 0,
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "LOG_ENABLED": False,
        "REDIS_URL": redis_url,
    }
    if mode == "DOWNLOAD_SLOTS":
        slots = {host: {"delay": SLOW_INTERVAL, "concurrency": 1} for host in scenario.slow_hosts}
        return {**settings, "DOWNLOAD_SLOTS": slots, "DOWNLOAD_DELAY_JITTER": 0}
    settings["DOWNLOADER_MIDDLEWARES"] = {"scrapy_redis_throttle.RedisThrottleMiddleware": 950}
    settings["REDIS_THROTTLE_DEFAULT_RATE"] = "unlimited"
    settings["REDIS_THROTTLE_RATES"] = {h: f"1/{SLOW_INTERVAL:g}s" for h in scenario.slow_hosts}
    if mode == "holding":
        settings["REDIS_THROTTLE_MAX_HOLD"] = 1e9
    elif mode == "parking (redis)":
        settings["SCHEDULER"] = "scrapy_redis.scheduler.Scheduler"
        settings["DUPEFILTER_CLASS"] = "scrapy_redis.dupefilter.RFPDupeFilter"
    return settings


async def crawl(
    scenario: Scenario, mode: str, with_slow: bool, redis: RedisServer
) -> dict[str, Any]:
    with redis.client() as client:
        client.flushall()
    all_hosts = scenario.slow_hosts + scenario.free_hosts
    pages = max(SLOW_REQUESTS, scenario.free_requests)
    with DemoSite(all_hosts, pages=pages) as site:
        requests = []
        if with_slow:  # first in line: the worst case for holding
            requests += [
                {"url": site.url(h, f"/page/{n}")}
                for n in range(SLOW_REQUESTS)
                for h in scenario.slow_hosts
            ]
        requests += [
            {"url": site.url(h, f"/page/{n}")}
            for n in range(scenario.free_requests)
            for h in scenario.free_hosts
        ]
        runner = CrawlerRunner(settings_for(mode, scenario, redis.url))
        crawler = runner.create_crawler(UrlListSpider)
        started = time.monotonic()
        await maybe_deferred_to_future(runner.crawl(crawler, requests=requests))
        free = [a.time for a in site.arrivals() if a.host in scenario.free_hosts]
        slow_kept = (
            all(
                # 1 request per SLOW_INTERVAL, burst 1: at most 1 + W / interval in any window W
                busiest_window(sorted(a.time for a in site.arrivals(h)), w)
                <= 1 + w / SLOW_INTERVAL + 0.05
                for h in scenario.slow_hosts
                for w in (1.0, SLOW_INTERVAL, 10.0)
            )
            if with_slow
            else None
        )
        fetched = Counter(site.url(a.host, a.path) for a in site.arrivals())
    return {
        "free_done_s": max(free) - started,
        "slow_limit_kept": slow_kept,
        "all_fetched_once": fetched == Counter(r["url"] for r in requests),
    }


async def main() -> list[dict[str, Any]]:
    rows = []
    with RedisServer() as redis:
        for scenario in SCENARIOS:
            for mode in MODES:
                # The machine is noisy: the median of a few short runs alone.
                alone = statistics.median(
                    [
                        (await crawl(scenario, mode, with_slow=False, redis=redis))["free_done_s"]
                        for _ in range(SOLO_RUNS)
                    ]
                )
                mixed = await crawl(scenario, mode, with_slow=True, redis=redis)
                row = {
                    "scenario": scenario.name,
                    "mode": mode,
                    "free_alone_s": round(alone, 2),
                    "free_with_slow_s": round(mixed["free_done_s"], 2),
                    "ratio": round(mixed["free_done_s"] / alone, 2),
                    "slow_limit_kept": mixed["slow_limit_kept"],
                    "all_fetched_once": mixed["all_fetched_once"],
                }
                rows.append(row)
                print(
                    f"{row['scenario']:<13} {row['mode']:<16} {row['free_alone_s']:>8.2f} "
                    f"{row['free_with_slow_s']:>10.2f} {row['ratio']:>6.2f}x "
                    f"{'yes' if row['slow_limit_kept'] else 'NO':>10} "
                    f"{'yes' if row['all_fetched_once'] else 'NO':>9}",
                    flush=True,
                )
    return rows


def run() -> None:
    run_benchmark(
        "fairness",
        (
            f"{'scenario':<13} {'mode':<16} {'alone s':>8} {'with slow':>10} {'ratio':>7} "
            f"{'limit kept':>10} {'all once':>9}"
        ),
        main,
        (
            "'alone s'/'with slow': seconds until the free domains' last request, without and with "
            "the slow\ndomains; 'ratio': how much the slow domains delay the free ones."
        ),
    )


if __name__ == "__main__":
    run()
