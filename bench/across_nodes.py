"""Several scopes on a Redis Cluster: what deciding a request costs when its buckets are on
different nodes (``scrapy_redis_throttle/across_nodes.py``: a peek and a reservation in each
bucket), side by side with one Redis, in one run, on this machine.

Part 1, the cost of a check, with limits so high that none is refused: ``ResilientBucket.acquire``
(what the middleware awaits for every request) under 1, 2 and 3 scopes (the domain's bucket, a
host's, one of 10 proxies'), on one Redis and on a cluster of 3 primaries (with a replica each)
on which the buckets of a request are spread by their names. Columns: acquires/s with one caller
awaiting each in turn and their latency (p50, p99), acquires/s with 16 concurrent callers, and
script calls per acquire (INFO commandstats of every primary).

Part 2, a budget many requests want at once: 3 workers (each its own connection pool, as
processes would have) with 16 concurrent requests each, 960 requests of one site through one
proxy, whose 200/s binds. A request refused (its moment beyond REDIS_THROTTLE_MAX_RESERVE, or
taken by another worker in every round) asks again when told. Columns: script calls per request
(give-backs included), and utilisation: the proxy's rate over the rate its requests' moments
keep (1.00: every moment used; a moment given back too late to be taken out is lost).

Run: ``./run bench across_nodes`` (about a minute; ``--calls N`` per measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))
sys.path.insert(0, str(ROOT / "tests"))

from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from redis_topologies import LocalCluster  # noqa: E402
from scrapy.settings import Settings  # noqa: E402
from scrapy.statscollectors import MemoryStatsCollector  # noqa: E402
from scrapy.utils.test import get_crawler  # noqa: E402

from scrapy_redis_throttle.budgets import Budget  # noqa: E402
from scrapy_redis_throttle.clock import Clock  # noqa: E402
from scrapy_redis_throttle.config import ThrottleConfig  # noqa: E402
from scrapy_redis_throttle.connection import close, connect  # noqa: E402
from scrapy_redis_throttle.rates import Limit  # noqa: E402
from scrapy_redis_throttle.resilience import ResilientBucket  # noqa: E402

if TYPE_CHECKING:
    import redis

DOMAINS = [f"www.shop-{n}.example.com" for n in range(1000)]
PROXIES = [f"proxy-{n}.example:8080" for n in range(10)]
CONCURRENT_CALLERS = 16
NEVER_BINDS = Limit(rate=1e6, burst=1_000_000, text="never binds")
WORKERS, REQUESTS = 3, 960
SITE, SITE_LIMIT = "shop.example", Limit(rate=1000, burst=1, text="1000/s")
PROXY, PROXY_LIMIT = "proxy.example:8080", Limit(rate=200, burst=1, text="200/s")


def others(domain: str, scopes: int) -> list[Budget]:
    """A request's other budgets under *scopes* scopes: its host's, and one of 10 proxies'."""
    budgets = [
        Budget(f"img.{domain}", NEVER_BINDS),
        Budget(PROXIES[zlib.crc32(domain.encode()) % len(PROXIES)], NEVER_BINDS),
    ]
    return budgets[: scopes - 1]


class Worker:
    """A worker's decisions (``ResilientBucket``), with a connection pool of its own."""

    def __init__(self, settings: dict[str, Any]) -> None:
        config = ThrottleConfig.from_settings(Settings(settings))
        self._client = connect(config)
        self.bucket = ResilientBucket(
            self._client, config, MemoryStatsCollector(get_crawler()), dict, Clock()
        )

    async def stop(self) -> None:
        await self.bucket.aclose()
        await close(self._client)


def script_calls(primaries: list[redis.Redis]) -> int:
    """Script calls every primary ran so far."""
    return sum(
        int(stats.get("calls", 0))
        for primary in primaries
        for command, stats in primary.info("commandstats").items()
        if command in ("cmdstat_evalsha", "cmdstat_eval")
    )


async def check_costs(
    topology: str, settings: dict[str, Any], primaries: list[redis.Redis], calls: int
) -> list[dict[str, Any]]:
    rows = []
    for scopes in (1, 2, 3):
        one = Worker(settings)
        bucket = one.bucket
        try:
            await bucket.start()
            latencies = []
            before = script_calls(primaries)
            started = time.perf_counter()
            for n in range(calls):
                domain = DOMAINS[n % len(DOMAINS)]
                sent = time.perf_counter()
                await bucket.acquire(domain, NEVER_BINDS, 1, others(domain, scopes))
                latencies.append(time.perf_counter() - sent)
            sequential = calls / (time.perf_counter() - started)
            per_acquire = (script_calls(primaries) - before) / calls

            async def caller(offset: int, scopes: int = scopes, bucket: Any = bucket) -> None:
                for n in range(offset, calls, CONCURRENT_CALLERS):
                    domain = DOMAINS[n % len(DOMAINS)]
                    await bucket.acquire(domain, NEVER_BINDS, 1, others(domain, scopes))

            started = time.perf_counter()
            await asyncio.gather(*(caller(offset) for offset in range(CONCURRENT_CALLERS)))
            concurrent = calls / (time.perf_counter() - started)
        finally:
            await one.stop()
        quantiles = statistics.quantiles(latencies, n=100)
        row = {
            "part": "check",
            "redis": topology,
            "scopes": scopes,
            "acquires_per_s": round(sequential),
            "p50_us": round(quantiles[49] * 1e6),
            "p99_us": round(quantiles[98] * 1e6),
            "concurrent_per_s": round(concurrent),
            "script_calls_per_acquire": round(per_acquire, 2),
        }
        print(
            f"{topology:<12} {scopes:>6} {row['acquires_per_s']:>10,} {row['p50_us']:>8} "
            f"{row['p99_us']:>8} {row['concurrent_per_s']:>12,} {per_acquire:>14.2f}"
        )
        rows.append(row)
    return rows


async def contended(
    topology: str, settings: dict[str, Any], primaries: list[redis.Redis]
) -> dict[str, Any]:
    workers = [Worker(settings) for _ in range(WORKERS)]
    moments: list[float] = []
    asks = 0

    async def request(bucket: ResilientBucket) -> None:
        nonlocal asks
        while True:
            asks += 1
            result = (
                await bucket.acquire(SITE, SITE_LIMIT, 1, [Budget(PROXY, PROXY_LIMIT)])
            ).result
            if result.allowed or result.reserved:
                assert result.moment_us is not None
                moments.append(result.moment_us)
                return
            await asyncio.sleep(result.retry_after)

    async def requests(bucket: ResilientBucket, offset: int) -> None:
        for _ in range(offset, REQUESTS // WORKERS, CONCURRENT_CALLERS):
            await request(bucket)

    try:
        for each in workers:
            await each.bucket.start()
        before = script_calls(primaries)
        await asyncio.gather(
            *(requests(each.bucket, n) for each in workers for n in range(CONCURRENT_CALLERS))
        )
        per_request = (script_calls(primaries) - before) / len(moments)
    finally:
        for each in workers:
            await each.stop()
    span = (max(moments) - min(moments)) / 1e6
    utilisation = (len(moments) - 1) / (span * PROXY_LIMIT.rate)
    print(
        f"{topology:<12} {len(moments):>9} {asks / len(moments):>13.2f} {per_request:>14.2f} "
        f"{utilisation:>12.2f}"
    )
    return {
        "part": "contended",
        "redis": topology,
        "requests": len(moments),
        "asks_per_request": round(asks / len(moments), 2),
        "script_calls_per_request": round(per_request, 2),
        "utilisation": round(utilisation, 3),
    }


async def measure(calls: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer().start()
        cluster = LocalCluster(Path(directory) / "cluster").start()
        try:
            one = {"REDIS_THROTTLE_URL": server.url}
            spread = {"REDIS_URL": server.url, **cluster.settings()}
            setups = [
                ("one Redis", one, [server.client()]),
                ("cluster of 3", spread, [node.client() for node in cluster.primaries()]),
            ]
            rows = []
            for topology, settings, primaries in setups:
                rows += await check_costs(topology, settings, primaries, calls)
            print(
                f"\n{'redis':<12} {'requests':>9} {'asks/request':>13} {'scripts/req.':>14} "
                f"{'utilisation':>12}"
            )
            for topology, settings, primaries in setups:
                rows.append(await contended(topology, settings, primaries))
            return rows
        finally:
            cluster.stop()
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="acquires per measurement")
    arguments = parser.parse_args()
    run_benchmark(
        "across_nodes",
        f"{'redis':<12} {'scopes':>6} {'acquires/s':>10} {'p50 µs':>8} {'p99 µs':>8} "
        f"{'16 callers/s':>12} {'scripts/acq.':>14}",
        lambda: measure(arguments.calls),
        "acquires/s and latency: one caller awaiting each acquire; 16 callers/s: concurrent "
        "callers; scripts/acq.: script calls per acquire (all primaries). Contended: 3 workers "
        f"x {CONCURRENT_CALLERS} requests of one site through one proxy at "
        f"{PROXY_LIMIT.rate:g}/s; asks/request: acquires per request (a refusal asks again); "
        "utilisation: the proxy's rate the requests' moments keep.",
    )


if __name__ == "__main__":
    main()
