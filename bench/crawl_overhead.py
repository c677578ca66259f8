"""What the throttle costs a crawl when its limits do not bind, side by side in one run.

One Scrapy process crawls a fast local site (``fast_site.py``, its own process, never the
bottleneck) of several domains, with limits far above what it can reach, in three set-ups:

* without the middleware;
* with it, Redis on loopback;
* with it, Redis behind a TCP proxy that holds every byte back ``--latency`` seconds each way
  (1 ms: a 2 ms round trip, like a Redis in another zone): the reactor must not wait for it.

Each round runs the three set-ups one after the other (every other round in reverse order); the
table shows the medians over the rounds of pages/s (from the first response to the last), of the
crawler's CPU per page (both from the first response to the last, so that start-up and imports
are left out), and of the throttle's Redis calls per page (its ``redis_calls`` stat).
The ratio is each round's pages/s over that round's without the middleware: this machine's speed
drifts by more than 10% between rounds, so only set-ups run side by side are compared.

Run: ``./run bench crawl_overhead`` (about 4 minutes; ``--pages``, ``--rounds``, ``--latency``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from processes import finish_crawl_workers, start_crawl_worker  # noqa: E402
from tcp_proxy import TcpProxy  # noqa: E402

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
NEVER_BINDS = 100_000  # requests per second, and burst
WITHOUT = "without the middleware"

SETTINGS: dict[str, Any] = {
    "CONCURRENT_REQUESTS": 32,
    "CONCURRENT_REQUESTS_PER_DOMAIN": 8,
    "DOWNLOAD_DELAY": 0,
    "ROBOTSTXT_OBEY": False,
    "TELNETCONSOLE_ENABLED": False,
    "LOG_LEVEL": "INFO",
    "CLOSESPIDER_TIMEOUT": 300,
}


class FastSite:
    """``fast_site.py`` in a process of its own."""

    def __init__(self, hosts: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("fast_site.py")), "--hosts", *hosts],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("READY "), f"fast_site.py did not start: {line!r}"
        self.port = int(line.split()[1])

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def crawl(urls: list[str], throttle_url: str | None) -> dict[str, Any]:
    """One crawl in a new process; returns its stats."""
    settings = dict(SETTINGS)
    if throttle_url is not None:
        settings |= {
            "DOWNLOADER_MIDDLEWARES": {"scrapy_redis_throttle.RedisThrottleMiddleware": 950},
            "REDIS_THROTTLE_URL": throttle_url,
            "REDIS_THROTTLE_DEFAULT_RATE": NEVER_BINDS,
            "REDIS_THROTTLE_DEFAULT_BURST": NEVER_BINDS,
        }
    worker = start_crawl_worker({"settings": settings, "requests": [{"url": u} for u in urls]})
    [stats] = finish_crawl_workers([worker], timeout=600)
    assert stats.get("test/responses") == len(urls), f"not every page came back: {stats}"
    return stats


async def measure(pages: int, rounds: int, latency: float) -> list[dict[str, Any]]:
    site = FastSite(HOSTS)
    with RedisServer() as redis_server, TcpProxy(redis_server.port) as proxy:
        proxy.latency = latency
        urls = [f"http://{HOSTS[n % len(HOSTS)]}:{site.port}/page/{n}" for n in range(pages)]
        setups = {
            WITHOUT: None,
            "with it, Redis on loopback": redis_server.url,
            f"with it, Redis {2 * latency * 1000:g} ms away": proxy.url,
        }
        try:
            crawl(urls[:200], None)  # warm up: imports, page cache
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
            for round_number in range(rounds):
                # Every other round backwards, so that a drift of the machine's speed during a
                # round favours no set-up.
                order = list(setups.items())[:: 1 if round_number % 2 == 0 else -1]
                for name, url in order:
                    stats = crawl(urls, url)
                    samples[name].append(
                        {
                            "pages_per_s": (pages - 1) / stats["worker/download_seconds"],
                            "cpu_us_per_page": stats["worker/download_cpu_seconds"]
                            / (pages - 1)
                            * 1e6,
                            "redis_calls_per_page": stats.get("redis_throttle/redis_calls", 0)
                            / pages,
                        }
                    )
        finally:
            site.close()
    rows = []
    for name, runs in samples.items():
        # Each round's own ratio (the set-ups of one round ran side by side), then the median.
        ratios = [
            run["pages_per_s"] / without["pages_per_s"]
            for run, without in zip(runs, samples[WITHOUT], strict=True)
        ]
        row: dict[str, Any] = {
            "setup": name,
            **{key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]},
            "vs_without": round(statistics.median(ratios), 3),
            "vs_without_runs": [round(ratio, 2) for ratio in ratios],
        }
        print(
            f"{name:<28} {row['pages_per_s']:>8.0f} {row['vs_without']:>7.2f}x "
            f"{row['cpu_us_per_page']:>11.0f} {row['redis_calls_per_page']:>16.2f}   "
            f"{' '.join(f'{ratio:.2f}' for ratio in row['vs_without_runs'])}"
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pages", type=int, default=1500, help="pages per crawl")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--latency", type=float, default=0.001, help="seconds, each way")
    args = parser.parse_args()
    run_benchmark(
        "crawl_overhead",
        f"{'setup':<28} {'pages/s':>8} {'ratio':>8} {'CPU µs/page':>11} {'Redis calls/page':>16}"
        "   ratio in each round",
        lambda: measure(args.pages, args.rounds, args.latency),
        f"{args.pages} pages over {len(HOSTS)} domains, CONCURRENT_REQUESTS 32 (8 per domain), "
        f"limits of {NEVER_BINDS:,}/s;\nratio: pages/s over those without the middleware in the "
        "same round; CPU: the crawler process's, per page.\nMedians of the rounds; each "
        "round's ratio last.",
    )


if __name__ == "__main__":
    main()
