"""Every Redis fault of tests/redis_faults.py under every policy, in one run: what the site saw.

For each fault x ``REDIS_THROTTLE_ON_REDIS_ERROR`` policy, one real crawl (one worker, a domain
at 10/s with burst 1, 60 requests through a TCP proxy in front of a private redis-server); the
fault starts after 8 arrivals and lasts 2 s, or until the throttle noticed it. Columns:

* lost / twice: requests never downloaded / downloaded twice (must be 0 / 0);
* finished: the crawl ended by itself (not by its 60 s CLOSESPIDER_TIMEOUT guard);
* busiest 1 s: most arrivals in one second of the fault, beside the policy's bound;
* back after: seconds from the end of the fault to shared limits again ("-": no outage was
  seen, or no request was left to see the end of it).

Run: ``./run bench faults`` (about 4 minutes). Prints a table, then one JSON line.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from demo_site import HOSTS, DemoSite  # noqa: E402
from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from redis_faults import FAULTS, REQUESTS, Lab, policy_bound, run_fault  # noqa: E402
from tcp_proxy import TcpProxy  # noqa: E402

POLICIES = ["local", "open", "wait"]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


async def main() -> list[dict[str, Any]]:
    rows = []
    for fault in FAULTS:
        for policy in POLICIES:
            with (
                RedisServer() as server,
                RedisServer() as spare,
                TcpProxy(server.port) as proxy,
                DemoSite(HOSTS, pages=REQUESTS) as site,
            ):
                run = await run_fault(Lab(server, proxy, spare), site, HOSTS[0], fault, policy)
            bound = policy_bound(policy)
            shown_bound = "-" if bound is None else f"{bound:g}"
            row = {
                "fault": fault.name,
                "policy": policy,
                "lost": len(run.lost),
                "twice": len(run.duplicated),
                "finished": run.stats.get("finish_reason") == "finished",
                "busiest_1s_during_fault": run.busiest_second_during_fault(),
                "bound": bound,
                "outages": run.outages,
                "back_after_s": run.return_time,
            }
            rows.append(row)
            print(
                f"{fault.name:<26} {policy:<6} {row['lost']:>4} {row['twice']:>5} "
                f"{'yes' if row['finished'] else 'NO':>8} "
                f"{row['busiest_1s_during_fault']:>7} / {shown_bound:<5} "
                f"{row['outages']:>7} {_seconds(run.return_time):>10}",
                flush=True,
            )
    return rows


def run() -> None:
    logging.getLogger("scrapy").setLevel(logging.ERROR)
    run_benchmark(
        "faults",
        (
            f"{'fault':<26} {'policy':<6} {'lost':>4} {'twice':>5} {'finished':>8} "
            f"{'busiest 1 s':>15} {'outages':>7} {'back after':>10}"
        ),
        main,
        (
            "'busiest 1 s': arrivals at the site in the busiest second of the fault / the policy's "
            "bound\n(10/s, burst 1, one more per switch between shared and local pacing)."
        ),
    )


if __name__ == "__main__":
    run()
