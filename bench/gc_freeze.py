"""What ``REDIS_THROTTLE_GC_FREEZE`` does to a fleet: worker stalls, and squeezes at the site.

Three ``crawl_worker.py`` processes crawl the demo site with the one-line set-up (the throttle
middleware beside scrapy-redis's scheduler, Scrapy's default concurrency) and the "even"
frontier of tests/test_default_setup.py: domains limited to 0.5/s, 2/s and 20/s, burst 1,
about 12 s of work each, crawled to the end. Crawls alternate between the default
(``REDIS_THROTTLE_GC_FREEZE = True``) and ``False``, so both see the same machine.

Each row, one crawl: the workers' event-loop stalls over 20 ms and the longest (a probe task
that sleeps 5 ms at a time, from the first response to the close: see
``tests/crawl_worker.py``); ``redis_throttle/missed_moments`` summed over the workers; the
worst squeeze at the site, the least ``jitter`` that ``assert_paced`` (tests/support.py) needs
for every domain's arrivals, i.e. how much shorter than the limit allows the tightest run of
arrivals was (the tests allow 100 ms); 429s; and the least utilisation of a domain.

Run: ``./run bench gc_freeze`` (about 3 minutes; ``--runs N`` crawls of each set-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from demo_site import HOSTS, DemoSite  # noqa: E402
from fleet_runs import (  # noqa: E402
    DOMAINS,
    EVEN,
    FRONTIER_DEADLINE,
    RATES,
    check_ended_well,
    fetched,
    fleet,
    fleet_jobs,
    one_line_settings,
    progress,
    refused,
    wait_for,
    wait_for_workers,
)
from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from support import achieved_rate  # noqa: E402

SETUPS = {"freeze (default)": True, "no freeze": False}


def squeeze(times: list[float], rate: float, burst: int) -> float:
    """The least jitter (seconds) with which no window of *times* holds more than ``burst +
    rate * (its length + jitter)`` arrivals (0: none is over the limit)."""
    times = sorted(times)
    worst = 0.0
    for i, first in enumerate(times):
        for j in range(i + burst, len(times)):
            worst = max(worst, (j - i + 1 - burst) / rate - (times[j] - first))
    return worst


def crawl(freeze: bool, redis: RedisServer) -> dict[str, Any]:
    with redis.client() as client:
        client.flushall()
    settings = one_line_settings(redis.url, None, REDIS_THROTTLE_GC_FREEZE=freeze)
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    with DemoSite(HOSTS, pages=EVEN, overload=overload) as site:
        jobs = [{**job, "loop_probe": True} for job in fleet_jobs(site, settings, EVEN, RATES)]
        with fleet(redis.url, jobs) as workers:
            done = wait_for(
                lambda: all(len(fetched(site.arrivals(h))) == n for h, n in EVEN.items()),
                FRONTIER_DEADLINE,
            )
            if not done:
                unfinished = progress(site, EVEN)
                raise SystemExit(f"not every page in {FRONTIER_DEADLINE:g} s: {unfinished}")
            ends = wait_for_workers(workers, 30, "the last page")
        arrivals = {domain.host: site.arrivals(domain.host) for domain in DOMAINS}
    check_ended_well(ends)
    stats = [end.stats for end in ends]
    return {
        "stalls": sum(s["worker/loop_stalls"] for s in stats),
        "longest_stall_ms": max(s["worker/loop_stall_max_ms"] for s in stats),
        "missed_moments": sum(s.get("redis_throttle/missed_moments", 0) for s in stats),
        "squeeze_ms": 1000
        * max(squeeze([a.time for a in arrivals[d.host]], d.rate, d.burst) for d in DOMAINS),
        "429s": sum(refused(a) for a in arrivals.values()),
        "utilisation": min(
            achieved_rate([a.time for a in arrivals[d.host]], d.burst) / d.rate for d in DOMAINS
        ),
        "frozen": min(s.get("redis_throttle/gc_frozen_objects", 0) for s in stats),
    }


async def measure(runs: int) -> list[dict[str, Any]]:
    rows = []
    with RedisServer() as redis:
        for run in range(1, runs + 1):
            for setup, freeze in SETUPS.items():
                row = {"setup": setup, "run": run, **crawl(freeze, redis)}
                rows.append(row)
                print(
                    f"{setup:<17} {run:>3} {row['stalls']:>7} {row['longest_stall_ms']:>10.0f} "
                    f"{row['missed_moments']:>7} {row['squeeze_ms']:>8.0f} {row['429s']:>5} "
                    f"{row['utilisation']:>6.2f} {row['frozen']:>7}",
                    flush=True,
                )
    print()
    for setup in SETUPS:
        mine = [row for row in rows if row["setup"] == setup]
        print(
            f"{setup}: median stalls {statistics.median(r['stalls'] for r in mine):g}, median "
            f"longest {statistics.median(r['longest_stall_ms'] for r in mine):.0f} ms, median "
            f"squeeze {statistics.median(r['squeeze_ms'] for r in mine):.0f} ms, squeezes over "
            f"100 ms {sum(r['squeeze_ms'] > 100 for r in mine)}/{len(mine)}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=4, help="crawls of each set-up")
    args = parser.parse_args()
    run_benchmark(
        "gc_freeze",
        f"{'set-up':<17} {'run':>3} {'stalls':>7} {'longest ms':>10} {'missed':>7} "
        f"{'squeeze':>8} {'429s':>5} {'util':>6} {'frozen':>7}",
        lambda: measure(args.runs),
        "stalls: the 3 workers' event-loop wake-ups over 20 ms late (a 5 ms probe), first "
        "response to close; longest ms: the longest;\nmissed: redis_throttle/missed_moments; "
        "squeeze: ms by which the tightest run of arrivals at the site was shorter than the "
        "limit allows\n(any domain; the tests allow 100); util: the least achieved rate / limit "
        "of a domain; frozen: objects each worker froze (the least).",
    )


if __name__ == "__main__":
    main()
