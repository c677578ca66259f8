"""How much of its budget each domain gets: the one-line set-up, the full recipe and 0.1's.

Three ``crawl_worker.py`` processes share scrapy-redis's queue and crawl the demo site, whose
three domains are limited (``redis_throttle_rates``, the spider attribute) to 0.5/s, 2/s and
20/s, burst 1; the site answers 429 above each domain's budget. Four set-ups:

* one-line, per-domain 1: only the throttle middleware in ``DOWNLOADER_MIDDLEWARES``, with
  scrapy-redis's own scheduler and dupefilter, ``DOWNLOAD_DELAY = 0``,
  ``CONCURRENT_REQUESTS_PER_DOMAIN = 1`` and Scrapy's default ``CONCURRENT_REQUESTS`` (16);
* one-line, per-domain default: the same with Scrapy's default per-domain concurrency (8);
* full recipe: ``ADDONS = {"scrapy_redis_throttle.Addon": 500}``, ``SCHEDULER =
  "scrapy_redis_throttle.RedisThrottleScheduler"`` and ``CONCURRENT_REQUESTS_PER_DOMAIN = 16``,
  what README's Quick start used to recommend;
* one-line, all held: the first with ``REDIS_THROTTLE_MAX_HOLD = 1e9``, so no request is
  parked: waiting ones are held in the downloader, as 0.1 behaved with scrapy-redis's scheduler.

Two frontiers (tests/fleet_runs.py): "even", about 12 s of work for each domain at its rate,
crawled to the end; "slow-rich", far more work for the slow domain than the run lasts, stopped
with SIGINT once the fast domain's pages are all fetched (or after 30 s). Each row: the fast
and the middle domain's achieved rate over their limit, from their first arrival to their last
(up to the SIGINT for slow-rich), as tests/test_default_setup.py judges them, and how many of
their pages they got (a domain starved after a good start is seen there, not in the rate);
429s; seconds from the SIGINT to the last worker's exit; pages fetched twice.

Run: ``./run bench one_line`` (about 3 minutes; ``--runs N`` repeats each crawl N times).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from demo_site import HOSTS, Arrival, DemoSite  # noqa: E402
from fleet_runs import (  # noqa: E402
    DOMAINS,
    FAST,
    FRONTIER_DEADLINE,
    FRONTIERS,
    MIDDLE,
    RATES,
    Domain,
    check_ended_well,
    fetched,
    fleet,
    fleet_jobs,
    interrupt,
    one_line_settings,
    progress,
    refused,
    wait_for,
    wait_for_workers,
)
from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from support import achieved_rate  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Callable

# How long the workers may take to exit: when idle (even) or after the SIGINT (slow-rich).
EXIT_TIMEOUT = 30.0


def full_recipe(redis_url: str) -> dict[str, Any]:
    settings = one_line_settings(
        redis_url,
        16,
        ADDONS={"scrapy_redis_throttle.Addon": 500},
        SCHEDULER="scrapy_redis_throttle.RedisThrottleScheduler",
    )
    del settings["DOWNLOADER_MIDDLEWARES"]  # the add-on enables the middleware
    return settings


SETUPS: dict[str, Callable[[str], dict[str, Any]]] = {
    "one-line, per-domain 1": lambda url: one_line_settings(url, 1),
    "one-line, per-domain default": lambda url: one_line_settings(url, None),
    "full recipe": full_recipe,
    "one-line, all held": lambda url: one_line_settings(url, 1, REDIS_THROTTLE_MAX_HOLD=1e9),
}


def figures(name: str, domain: Domain, arrivals: list[Arrival], pages: int) -> dict[str, Any]:
    """*domain*'s achieved rate over its limit, from its first arrival to its last of
    *arrivals*, and how many of its *pages* they fetched."""
    rate = None
    if len(arrivals) >= domain.burst + 2:
        rate = achieved_rate([a.time for a in arrivals], domain.burst) / domain.rate
    return {
        f"{name}_utilisation": rate,
        f"{name}_fetched": len(fetched(arrivals)),
        f"{name}_pages": pages,
    }


def crawl(settings: dict[str, Any], frontier: str, redis: RedisServer) -> dict[str, Any]:
    """One fleet's crawl of *frontier*, measured at the site."""
    with redis.client() as client:
        client.flushall()
    counts = FRONTIERS[frontier]
    # Even: crawled to the end (the workers close when idle). Slow-rich: until the fast domain
    # is done, then SIGINT. Either is stopped with SIGINT at the deadline.
    goal = counts if frontier == "even" else {FAST.host: counts[FAST.host]}
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    notes: list[str] = []
    stopped: float | None = None
    sent: list[float] = []
    closed: float | None = None
    exited = True
    with DemoSite(HOSTS, pages=counts, overload=overload) as site:
        with fleet(redis.url, fleet_jobs(site, settings, counts, RATES)) as workers:
            reached = wait_for(
                lambda: all(len(fetched(site.arrivals(h))) == n for h, n in goal.items()),
                FRONTIER_DEADLINE,
            )
            if not reached:
                notes.append(f"after {FRONTIER_DEADLINE:g} s: {progress(site, goal)}")
            if frontier != "even" or not reached:
                stopped = time.monotonic()
                sent = interrupt(workers)
            try:
                ends = wait_for_workers(workers, EXIT_TIMEOUT, "the SIGINT or the last page")
            except AssertionError as error:  # the workers are killed on leaving the fleet
                exited = False
                notes.append(str(error))
            else:
                if sent:
                    closed = max(end.at - at for end, at in zip(ends, sent, strict=True))
                try:
                    check_ended_well(ends)
                except AssertionError as error:
                    notes.append(str(error).splitlines()[0])
        arrivals = {domain.host: site.arrivals(domain.host) for domain in DOMAINS}
    # Slow-rich: judged on the arrivals up to the SIGINT.
    busy = {
        host: [a for a in host_arrivals if stopped is None or a.time <= stopped]
        for host, host_arrivals in arrivals.items()
    }
    after = sum(len(arrivals[host]) - len(busy[host]) for host in arrivals)
    if after:
        notes.append(f"arrivals after the SIGINT: {after}")
    return {
        **figures("fast", FAST, busy[FAST.host], counts[FAST.host]),
        **figures("middle", MIDDLE, busy[MIDDLE.host], counts[MIDDLE.host]),
        "429s": sum(refused(a) for a in arrivals.values()),
        "closed_after_sigint_s": closed,
        "all_exited": exited,
        "fetched_twice": sum(n > 1 for a in arrivals.values() for n in fetched(a).values()),
        "notes": notes,
    }


def cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


async def measure(runs: int) -> list[dict[str, Any]]:
    rows = []
    for frontier in FRONTIERS:
        for setup, settings in SETUPS.items():
            with RedisServer() as redis:
                for run in range(1, runs + 1):
                    row = {
                        "frontier": frontier,
                        "setup": setup,
                        "run": run,
                        **crawl(settings(redis.url), frontier, redis),
                    }
                    rows.append(row)
                    closed = cell(row["closed_after_sigint_s"], ".2f")
                    if not row["all_exited"] and frontier == "slow-rich":
                        closed = f">{EXIT_TIMEOUT:g}"
                    print(
                        f"{frontier:<10} {setup:<29} {run:>3} "
                        f"{cell(row['fast_utilisation'], '.2f'):>6} "
                        f"{row['fast_fetched']:>4}/{row['fast_pages']:<4}"
                        f"{cell(row['middle_utilisation'], '.2f'):>7} "
                        f"{row['middle_fetched']:>3}/{row['middle_pages']:<3} {row['429s']:>5} "
                        f"{closed:>8} {row['fetched_twice']:>6}  {'; '.join(row['notes'])}",
                        flush=True,
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=1, help="crawls of each set-up and frontier")
    args = parser.parse_args()
    run_benchmark(
        "one_line",
        f"{'frontier':<10} {'set-up':<29} {'run':>3} {'fast':>6} {'pages':>9}{'middle':>7} "
        f"{'pages':>7} {'429s':>5} {'closed s':>8} {'twice':>6}  notes",
        lambda: measure(args.runs),
        f"fast, middle: achieved rate / limit of {FAST.host} ({FAST.rate:g}/s) and {MIDDLE.host} "
        f"({MIDDLE.rate:g}/s), burst 1, from each one's first arrival to its last (up to the "
        "SIGINT for slow-rich),\nas tests/test_default_setup.py judges them: a domain that stops "
        "getting requests is not counted down for it, see pages;\npages: its pages fetched (by "
        "the SIGINT for slow-rich) of those in the frontier; 429s: the site's 429 answers, every "
        "domain;\nclosed s: from the SIGINT to the last worker's exit (killed if over "
        f"{EXIT_TIMEOUT:g} s); twice: pages fetched (200) more than once, every domain.",
    )


if __name__ == "__main__":
    main()
