"""What the throttle costs a crawl when its limits do not bind, side by side in one run.

A Scrapy process crawls a fast local site (``fast_site.py``, its own process, never the
bottleneck) of several domains, with limits far above what it can reach, in three set-ups: Redis
on loopback, Redis behind a TCP proxy that holds every byte back ``--latency`` seconds each way
(1 ms: a 2 ms round trip, like a Redis in another zone: the reactor must not wait for it), and a
Redis Cluster of 3 primaries (with a replica each) on loopback, whose client sends each call by
itself to the node of its domain.

This machine's speed drifts by 10-50% from one second to the next, and whole crawls run one
after the other are not comparable: the ratios of 16 rounds of separate crawls with and without
the middleware spread from 0.6 to 1.6, and their medians went from 0.81 to 1.00 from one run to
the next. So within each crawl the middleware is switched on and off in turns, every
``--chunk`` requests (``alternating_middleware.py``): an "off" request goes on at once, as if
the middleware were not there. Each "on" chunk's requests per second are compared with those of
the "off" chunks just before and after it, a second or so apart; the ratio is the median of
these. The table also shows the medians of the chunks' requests per second and of the
crawler's CPU per request, and the throttle's Redis calls per throttled request (its stats).
Every other crawl starts with an "on" chunk; the first two chunks of a crawl (start-up) are left
out. A fourth set-up measures the metrics (``REDIS_THROTTLE_METRICS_PORT``) the same way: the
throttle (Redis on loopback) is on all along and serves ``/metrics``, and its metrics are
recorded in every other chunk; its ratio is the chunks with metrics over those without.

On Linux with two or more CPUs, the crawler has one CPU to itself, and the site, Redis and the
proxy share the others: as in production, where Redis and the sites run on other machines, what
the crawler pays is not mixed with what they pay.

Run: ``./run bench crawl_overhead`` (about 5 minutes; ``--pages``, ``--chunk``, ``--rounds``,
``--latency``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from processes import finish_crawl_workers, start_crawl_worker  # noqa: E402
from redis_topologies import LocalCluster  # noqa: E402
from tcp_proxy import TcpProxy  # noqa: E402

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
NEVER_BINDS = 100_000  # requests per second, and burst
WITHOUT = "without the middleware"
METRICS = "metrics on, vs off (loopback)"

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


def crawler_cpus() -> set[int] | None:
    """The crawler's CPU, when it can have one to itself (see the module's docstring)."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    return {min(os.sched_getaffinity(0))}


CRAWLER_CPUS = crawler_cpus()
WARM_UP_CHUNKS = 2


def crawl(
    urls: list[str], throttle_redis: dict[str, Any], chunk: int, first_on: bool
) -> dict[str, Any]:
    """One crawl in a new process, the throttle (its Redis as the settings *throttle_redis*
    say; with ``BENCH_ALTERNATE``, its metrics) switched on and off every *chunk* requests;
    returns its stats."""
    settings = (
        SETTINGS
        | throttle_redis
        | {
            "DOWNLOADER_MIDDLEWARES": {"alternating_middleware.AlternatingThrottleMiddleware": 950},
            "BENCH_CHUNK": chunk,
            "BENCH_FIRST_ON": first_on,
            "REDIS_THROTTLE_DEFAULT_RATE": NEVER_BINDS,
            "REDIS_THROTTLE_DEFAULT_BURST": NEVER_BINDS,
        }
    )
    worker = start_crawl_worker({"settings": settings, "requests": [{"url": u} for u in urls]})
    if CRAWLER_CPUS is not None:  # before its crawl starts: it is still importing Scrapy
        os.sched_setaffinity(worker.pid, CRAWLER_CPUS)
    [stats] = finish_crawl_workers([worker], timeout=600)
    assert stats.get("test/responses") == len(urls), f"not every page came back: {stats}"
    return stats


def on_off_ratios(chunks: list[list[Any]]) -> list[float]:
    """Each "on" chunk's requests per second over the mean of its "off" neighbours'."""
    ratios = []
    for n, (on, _, rate) in enumerate(chunks):
        neighbours = [c[2] for c in chunks[max(n - 1, 0) : n + 2 : 2] if not c[0]]
        if on and neighbours:
            ratios.append(rate / statistics.mean(neighbours))
    return ratios


def row(name: str, chunks: list[list[Any]], ratios: list[float], calls: float) -> dict[str, Any]:
    result: dict[str, Any] = {
        "setup": name,
        "requests_per_s": round(statistics.median(c[2] for c in chunks), 1),
        "cpu_us_per_request": round(statistics.median(c[1] for c in chunks)),
        "redis_calls_per_request": round(calls, 3),
        "vs_without": round(statistics.median(ratios), 3),
        "vs_without_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
        "chunks": len(chunks),
    }
    low, _, high = result["vs_without_quartiles"]
    print(
        f"{name:<28} {result['requests_per_s']:>10.0f} {result['vs_without']:>7.3f}x "
        f"{low:>6.2f}-{high:<5.2f} {result['cpu_us_per_request']:>11} "
        f"{result['redis_calls_per_request']:>15.3f} {result['chunks']:>7}"
    )
    return result


async def measure(pages: int, chunk: int, rounds: int, latency: float) -> list[dict[str, Any]]:
    if CRAWLER_CPUS is not None:  # inherited by the site and Redis, and the proxy's threads
        os.sched_setaffinity(0, os.sched_getaffinity(0) - CRAWLER_CPUS)
    site = FastSite(HOSTS)
    with (
        RedisServer() as redis_server,
        TcpProxy(redis_server.port) as proxy,
        tempfile.TemporaryDirectory() as cluster_dir,
    ):
        proxy.latency = latency
        cluster = LocalCluster(Path(cluster_dir))
        urls = [f"http://{HOSTS[n % len(HOSTS)]}:{site.port}/page/{n}" for n in range(pages)]
        setups = {
            "with it, Redis on loopback": {"REDIS_THROTTLE_URL": redis_server.url},
            f"with it, Redis {2 * latency * 1000:g} ms away": {"REDIS_THROTTLE_URL": proxy.url},
            "with it, Redis Cluster": {
                "REDIS_THROTTLE_URL": redis_server.url,  # its host and port are not used
                **cluster.settings(),
            },
            # Served at /metrics all along; their recording switched on and off.
            METRICS: {
                "REDIS_THROTTLE_URL": redis_server.url,
                "REDIS_THROTTLE_METRICS_PORT": 0,
                "BENCH_ALTERNATE": "metrics",
            },
        }
        off: list[list[Any]] = []
        on: dict[str, list[list[Any]]] = {name: [] for name in setups}
        ratios: dict[str, list[float]] = {name: [] for name in setups}
        calls: dict[str, list[float]] = {name: [] for name in setups}
        try:
            cluster.start()
            for round_number in range(rounds):
                for name, throttle_redis in setups.items():
                    stats = crawl(urls, throttle_redis, chunk, first_on=round_number % 2 == 0)
                    chunks = stats["bench/chunks"][WARM_UP_CHUNKS:]
                    if name != METRICS:
                        off += [c for c in chunks if not c[0]]
                    on[name] += [c for c in chunks if c[0]]
                    ratios[name] += on_off_ratios(chunks)
                    calls[name].append(
                        stats["redis_throttle/redis_calls"] / stats["redis_throttle/requests"]
                    )
        finally:
            site.close()
            cluster.stop()
    return [
        row(WITHOUT, off, [1.0, 1.0], 0.0),
        *(row(name, on[name], ratios[name], statistics.mean(calls[name])) for name in setups),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pages", type=int, default=6000, help="pages per crawl")
    parser.add_argument("--chunk", type=int, default=200, help="requests per on or off chunk")
    parser.add_argument("--rounds", type=int, default=4, help="crawls per set-up")
    parser.add_argument("--latency", type=float, default=0.001, help="seconds, each way")
    args = parser.parse_args()
    # The crawlers import alternating_middleware from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
    )
    run_benchmark(
        "crawl_overhead",
        f"{'setup':<28} {'requests/s':>10} {'ratio':>8} {'quartiles':>11} {'CPU µs/req':>11} "
        f"{'Redis calls/req':>15} {'chunks':>7}",
        lambda: measure(args.pages, args.chunk, args.rounds, args.latency),
        f"{args.rounds} crawls per set-up of {args.pages} pages over {len(HOSTS)} domains, "
        f"CONCURRENT_REQUESTS 32 (8 per domain), limits of {NEVER_BINDS:,}/s, the middleware\n"
        f"on and off every {args.chunk} requests. ratio: an on chunk's requests/s over its off "
        "neighbours', median (and quartiles)\nof all; requests/s and CPU (the crawler "
        f"process's): medians of the chunks. {METRICS!r}: the throttle on all along,\n"
        "its metrics served, and recorded in every other chunk: the ratio of those chunks.",
    )


if __name__ == "__main__":
    main()
