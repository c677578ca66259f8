"""Many domains: what the throttle's state costs Redis, and whether acquires slow down.

For each domain count, one request to each of that many distinct domains (``www.site-<n>.
example.org``, limited to 1 request / 10 s, so that each bucket stays in Redis for 10 s), sent
by 64 concurrent callers. Then, while the buckets are active: Redis's memory per domain
(used_memory over the count) and the latency of one acquire at a time on other domains, beside
the same measured in the empty Redis just before; then the time until the buckets have refilled
and their keys are gone (DBSIZE 0), and the memory left.

Run: ``./run bench scale`` (about 1 minute; ``--domains 10000 100000``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))

from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402

from scrapy_redis_throttle.bucket import TokenBucket  # noqa: E402
from scrapy_redis_throttle.connection import connect_url  # noqa: E402
from scrapy_redis_throttle.rates import Limit  # noqa: E402
from scrapy_redis_throttle.redis_schema import bucket_key  # noqa: E402
from scrapy_redis_throttle.redis_settings import DEFAULT_REDIS_PARAMS  # noqa: E402

if TYPE_CHECKING:
    from redis.asyncio import Redis

LIMIT = Limit(rate=0.1, burst=1, text="1/10s")
# The latency probes' buckets are full again within a millisecond: they leave nothing behind.
PROBE_LIMIT = Limit(rate=1e6, burst=1, text="1000000/s")
CALLERS = 64
LATENCY_SAMPLES = 2000
GONE_WITHIN = 60.0  # seconds after the buckets are full again
SETTLE = 1.0


async def latencies(bucket: TokenBucket, prefix: str) -> list[float]:
    """Seconds of each of LATENCY_SAMPLES acquires, one at a time, on new domains."""
    samples = []
    for n in range(LATENCY_SAMPLES):
        started = time.perf_counter()
        await bucket.acquire(f"{prefix}-{n}.example.net", PROBE_LIMIT)
        samples.append(time.perf_counter() - started)
    return samples


async def fill(bucket: TokenBucket, domains: int) -> None:
    async def caller(offset: int) -> None:
        for n in range(offset, domains, CALLERS):
            assert (await bucket.acquire(f"www.site-{n}.example.org", LIMIT)).allowed

    await asyncio.gather(*(caller(offset) for offset in range(CALLERS)))


async def floor_per_domain(admin: Redis, domains: int) -> float:
    """used_memory per domain of the cheapest state with an expiry: the same keys, each set to
    an integer with SET PX (pipelined, not through the script)."""
    await admin.flushall()
    before = await used_memory(admin)
    for start in range(0, domains, 1000):
        pipe = admin.pipeline(transaction=False)
        for n in range(start, min(start + 1000, domains)):
            key = bucket_key("redis_throttle", f"www.site-{n}.example.org")
            pipe.set(key, 93_000_000_000_000 + n, px=int(1000 / LIMIT.rate))
        await pipe.execute()
    await asyncio.sleep(SETTLE)
    floor = (await used_memory(admin) - before) / domains
    await admin.flushall()
    return floor


async def used_memory(admin: Redis) -> int:
    return int((await admin.info("memory"))["used_memory"])


async def measure(counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    with RedisServer() as server:
        admin = connect_url(server.url, {}, 1)
        bucket = TokenBucket(connect_url(server.url, DEFAULT_REDIS_PARAMS, 1), "redis_throttle")
        try:
            await latencies(bucket, "warm-up")  # the script loaded, the connection made
            for domains in counts:
                idle = await latencies(bucket, f"idle-{domains}")  # the same, side by side
                await admin.flushall()  # the probes' keys too, expired or not
                before = await used_memory(admin)
                await fill(bucket, domains)
                filled = time.monotonic()
                active = await admin.dbsize()
                # Let Redis finish growing its hash tables (incremental rehashing keeps the old
                # and the new table for a while): the memory of the domains, not of the moment.
                await asyncio.sleep(SETTLE)
                memory = await used_memory(admin) - before
                busy = await latencies(bucket, f"busy-{domains}")
                deadline = filled + 1 / LIMIT.rate + GONE_WITHIN
                while time.monotonic() < deadline:  # polled: expiry runs inside Redis
                    if not await admin.dbsize():
                        break
                    await asyncio.sleep(0.1)
                left = await admin.dbsize()
                gone_after = time.monotonic() - filled
                bytes_left = await used_memory(admin) - before
                row: dict[str, Any] = {
                    "domains": domains,
                    "keys_while_active": active,
                    "bytes_per_domain": round(memory / domains, 1),
                    "floor_bytes_per_domain": round(await floor_per_domain(admin, domains), 1),
                    "p50_us_empty": round(statistics.median(idle) * 1e6),
                    "p50_us_active": round(statistics.median(busy) * 1e6),
                    "p99_us_empty": round(statistics.quantiles(idle, n=100)[98] * 1e6),
                    "p99_us_active": round(statistics.quantiles(busy, n=100)[98] * 1e6),
                    "keys_left": left,
                    "gone_after_s": None if left else round(gone_after, 1),
                    "bytes_left": bytes_left,
                }
                print(
                    f"{domains:>8,} {active:>8,} {row['bytes_per_domain']:>9} "
                    f"{row['floor_bytes_per_domain']:>6} "
                    f"{row['p50_us_empty']:>5} / {row['p50_us_active']:<5} "
                    f"{row['p99_us_empty']:>5} / {row['p99_us_active']:<5} {left:>5} "
                    f"{row['gone_after_s'] or '-':>6} {row['bytes_left']:>8}"
                )
                rows.append(row)
        finally:
            await bucket.aclose()
            await admin.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--domains", type=int, nargs="+", default=[10_000, 100_000])
    args = parser.parse_args()
    run_benchmark(
        "scale",
        f"{'domains':>8} {'keys':>8} {'B/domain':>9} {'floor':>6} {'p50 empty/active':>17} "
        f"{'p99 empty/active':>17} {'left':>5} {'gone':>6} {'B left':>8}",
        lambda: measure(args.domains),
        "keys: DBSIZE once every domain has its bucket; B/domain: used_memory over the domains; "
        "floor: the same for the same keys\nset to an integer with SET PX (Redis's cheapest "
        "state with an expiry); p50, p99: µs of one acquire at a time,\nin an empty Redis and "
        "with the domains' buckets active; left: keys left once the buckets are full again "
        f"(give or take {GONE_WITHIN:g} s);\ngone: seconds from the last request until DBSIZE "
        "is 0; B left: used_memory then, over that in the empty Redis.",
    )


if __name__ == "__main__":
    main()
