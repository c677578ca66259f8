"""Redis calls when the limits bind: many requests queued for a few throttled domains.

Two worker processes crawl three domains of a local site, limited to 20/s, 10/s and 5/s (burst
1), with requests for ``--seconds`` of each limit queued at once, in three set-ups: waiting
requests held in the downloader (Scrapy's scheduler), parked in this process
(Scrapy's scheduler), parked in Redis for the fleet (scrapy-redis's scheduler). The throttle
has a Redis of its own and scrapy-redis another, so each one's calls are counted apart (INFO
commandstats, on the server).

Columns: the throttle's script calls per downloaded request (mean, and how many requests needed
1, 2, 3 or more, counted per request by a counting subclass of the middleware), the parking
area's script calls per request (park and unpark, and with leases the queue's pops and the
leases' renewals, in scrapy-redis's Redis), every call there per request (``queue``: what leases
add shows against the set-up without them, whose queue class the throttle does not lease), and
each domain's achieved rate over its limit, measured where the requests arrive.

Run: ``./run bench binding`` (about 1 minute; ``--seconds``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from demo_site import DemoSite  # noqa: E402
from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from processes import finish_crawl_workers, start_crawl_workers  # noqa: E402

RATES = {"127.0.0.2": 20, "127.0.0.3": 10, "127.0.0.4": 5}
WORKERS = 2
SCRAPY_REDIS = {
    "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
    "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
}
# Each set-up's own settings. Held: no wait is long enough to be parked.
SETUPS: dict[str, dict[str, Any]] = {
    "held (Scrapy's scheduler)": {"REDIS_THROTTLE_MAX_HOLD": 1e9},
    "parked (Scrapy's scheduler)": {},
    "parked in Redis (scrapy-redis's scheduler)": SCRAPY_REDIS,
    # The same without leases (see unleased_queue.py), for what leases cost.
    "parked in Redis, no leases": {
        **SCRAPY_REDIS,
        "SCHEDULER_QUEUE_CLASS": "unleased_queue.UnleasedPriorityQueue",
    },
}


def calls(server: RedisServer, names: tuple[str, ...] | None = None) -> int:
    """Calls of the commands *names* the server ran (None: of every command)."""
    with server.client() as client:
        stats = client.info("commandstats")
    return sum(
        counts.get("calls", 0)
        for name, counts in stats.items()
        if names is None or name.removeprefix("cmdstat_") in names
    )


def script_calls(server: RedisServer) -> int:
    return calls(server, ("evalsha", "eval"))


def crawl(
    setup: dict[str, Any], throttle: RedisServer, queue: RedisServer, seconds: float
) -> dict[str, Any]:
    for server in (throttle, queue):
        with server.client() as client:
            client.flushall()
            client.config_resetstat()
    counts = {host: int(seconds * rate) for host, rate in RATES.items()}
    with DemoSite(list(RATES), pages=max(counts.values())) as site:
        urls = [site.url(h, f"/page/{n}") for h, count in counts.items() for n in range(count)]
        settings = {
            "DOWNLOADER_MIDDLEWARES": {"counting_middleware.CountingThrottleMiddleware": 950},
            "REDIS_URL": queue.url,
            "REDIS_THROTTLE_URL": throttle.url,
            "REDIS_THROTTLE_RATES": {host: f"{rate}/s" for host, rate in RATES.items()},
            "CONCURRENT_REQUESTS": 16,
            "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
            "ROBOTSTXT_OBEY": False,
            "TELNETCONSOLE_ENABLED": False,
            "LOG_LEVEL": "INFO",
            "CLOSESPIDER_TIMEOUT": 10 * seconds,
            **setup,
        }
        jobs = [
            {"settings": settings, "requests": [{"url": url} for url in urls[n::WORKERS]]}
            for n in range(WORKERS)
        ]
        all_stats = finish_crawl_workers(start_crawl_workers(queue.url, jobs), timeout=20 * seconds)
        per_request: Counter[int] = Counter()
        for stats in all_stats:
            for key, count in stats.items():
                if key.startswith("bench/redis_calls_per_request/"):
                    per_request[int(key.rsplit("/", 1)[1])] += count
        downloaded = sum(per_request.values())
        assert downloaded == len(urls), f"{downloaded} of {len(urls)} requests downloaded"
        rates = {}
        for host, rate in RATES.items():
            times = sorted(arrival.time for arrival in site.arrivals(host))
            rates[host] = (len(times) - 1) / (times[-1] - times[0]) / rate  # burst 1
    return {
        "throttle_calls_per_request": script_calls(throttle) / downloaded,
        "calls_1": per_request[1] / downloaded,
        "calls_2": per_request[2] / downloaded,
        "calls_3_or_more": sum(n for calls, n in per_request.items() if calls >= 3) / downloaded,
        "parking_calls_per_request": script_calls(queue) / downloaded,
        "queue_calls_per_request": calls(queue) / downloaded,
        "rate_vs_limit": rates,
    }


async def measure(seconds: float) -> list[dict[str, Any]]:
    # The workers import the counting middleware from this folder.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
    )
    rows = []
    with RedisServer() as throttle, RedisServer() as queue:
        for name, setup in SETUPS.items():
            row = {"setup": name, **crawl(setup, throttle, queue, seconds)}
            print(
                f"{name:<42} {row['throttle_calls_per_request']:>6.2f} "
                f"{row['calls_1']:>6.0%} {row['calls_2']:>6.0%} {row['calls_3_or_more']:>6.0%} "
                f"{row['parking_calls_per_request']:>8.2f} "
                f"{row['queue_calls_per_request']:>6.2f}   "
                + "  ".join(f"{ratio:.3f}" for ratio in row["rate_vs_limit"].values())
            )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=10, help="of requests queued per domain")
    args = parser.parse_args()
    run_benchmark(
        "binding",
        f"{'setup':<42} {'calls':>6} {'1':>6} {'2':>6} {'3+':>6} {'parking':>8} {'queue':>6}   "
        "rate / limit: " + ", ".join(f"{host} {rate}/s" for host, rate in RATES.items()),
        lambda: measure(args.seconds),
        f"{WORKERS} workers, CONCURRENT_REQUESTS 16; calls: the throttle's script calls per "
        "downloaded request (INFO commandstats), then the share of requests\nthat needed 1, 2, "
        "3 or more; parking: the script calls per request in scrapy-redis's Redis (parking, "
        "leases);\nqueue: every call there per request (scrapy-redis's own too); rate / limit: "
        "achieved at the site, after the first request.",
    )


if __name__ == "__main__":
    main()
