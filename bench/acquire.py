"""The acquire path: what one rate-limit check costs, side by side in one run, on one Redis.

Contenders, each doing one check per call on keys spread over 1,000 domains, with limits so high
that no check is refused (the cost of the check, not of waiting):

* minimal bucket: a raw EVALSHA of the smallest useful token bucket (TIME, HMGET, HSET, PEXPIRE),
  the floor any Redis rate limiter pays;
* ours: ``ResilientBucket.acquire``, what the middleware awaits for every request (circuit
  breaker, stats and local bookkeeping included), with the adaptive rate off (the default) and
  on (each call then also reads the domain's lowered rate, none here), with a sliding and a
  fixed window on top of the bucket (the same quota: a domain's quotas), and under 2 and 3 scopes
  (``REDIS_THROTTLE_SCOPE``: the domain's bucket and a host's, and a proxy's of 10, each call
  deciding for all of them at once);
* limits: its moving window on redis-py (``limits.aio``, ``implementation="redispy"``);
* throttled-py: its GCRA limiter on redis-py (``throttled.asyncio``).

Columns: calls/s and latency (p50/p99) with one caller awaiting each call in turn, calls/s with
16 concurrent callers, client CPU per call (this process), Redis CPU per call (the calls' own time
in INFO commandstats, and the whole server's CPU in INFO cpu, I/O included), round trips per call
(commands sent by the client, counted with MONITOR) and memory per key (used_memory over 10,000
new keys). Each round runs every contender (every other round in reverse order); each figure
is the median of the rounds, and the Redis CPU ratio the median of each round's ratio.

Run: ``./run bench acquire`` (about 2 minutes; ``--calls N`` per round, ``--rounds R``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_project"))

from harness import run_benchmark  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from scrapy.settings import Settings  # noqa: E402
from scrapy.statscollectors import MemoryStatsCollector  # noqa: E402
from scrapy.utils.test import get_crawler  # noqa: E402

from scrapy_redis_throttle.budgets import Budget  # noqa: E402
from scrapy_redis_throttle.clock import Clock  # noqa: E402
from scrapy_redis_throttle.config import ThrottleConfig  # noqa: E402
from scrapy_redis_throttle.connection import connect_url  # noqa: E402
from scrapy_redis_throttle.rates import MAX_SLIDING_COUNT, Limit  # noqa: E402
from scrapy_redis_throttle.redis_schema import bucket_key  # noqa: E402
from scrapy_redis_throttle.resilience import ResilientBucket  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from redis.asyncio import Redis

DOMAINS = [f"www.shop-{n}.example.com" for n in range(1000)]
CONCURRENT_CALLERS = 16
MEMORY_KEYS = 10_000
MONITORED_CALLS = 200

# The floor: a token bucket in a hash (tokens, last refill), on the server's clock.
MINIMAL_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local time = redis.call("TIME")
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000
local state = redis.call("HMGET", KEYS[1], "tokens", "ts")
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + (now - ts) * rate / 1000)
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call("HSET", KEYS[1], "tokens", tokens, "ts", now)
redis.call("PEXPIRE", KEYS[1], math.ceil((burst - tokens) * 1000 / rate) + 1)
return allowed
"""


@dataclass
class Contender:
    name: str
    check: Callable[[str], Awaitable[object]]
    close: Callable[[], Awaitable[object]]


@dataclass(frozen=True)
class Quota:
    requests: int
    per_seconds: int

    @property
    def rate(self) -> float:
        return self.requests / self.per_seconds


# Timings: never binds. Memory: one request keeps each key for 100 s.
FAST = Quota(1_000_000, 1)
SLOW = Quota(1, 100)


async def minimal_bucket(url: str, quota: Quota) -> Contender:
    client = connect_url(url, {}, CONCURRENT_CALLERS)
    sha = await client.script_load(MINIMAL_BUCKET)

    async def check(key: str) -> object:
        # The same key as ours: the memory column compares the states, not the names.
        return await client.evalsha(
            sha, 1, bucket_key("redis_throttle", key), quota.rate, quota.requests
        )

    return Contender("minimal bucket (raw EVALSHA)", check, client.aclose)


async def ours(
    url: str, quota: Quota, adaptive: bool = False, windows: bool = False, scopes: int = 1
) -> Contender:
    rate: object = quota.rate
    if windows:  # the same quota again, as each window algorithm
        # (A sliding window logs each request: at most MAX_SLIDING_COUNT, which no domain of
        # the 1,000 reaches here.)
        per = f"{min(quota.requests, MAX_SLIDING_COUNT)}/{quota.per_seconds}s"
        rate = [
            rate,
            {"rate": per, "algorithm": "sliding_window"},
            {"rate": per, "algorithm": "fixed_window"},
        ]
    settings = Settings(
        {
            "REDIS_THROTTLE_URL": url,
            "REDIS_THROTTLE_DEFAULT_RATE": rate,
            "REDIS_THROTTLE_DEFAULT_BURST": quota.requests,
            "REDIS_THROTTLE_ADAPTIVE_ENABLED": adaptive,
        }
    )
    config = ThrottleConfig.from_settings(settings)
    client = connect_url(url, config.redis_params, CONCURRENT_CALLERS)
    bucket = ResilientBucket(
        client, config, MemoryStatsCollector(get_crawler()), lambda: {}, Clock()
    )
    limit = config.limits.lookup("any")
    assert limit is not None

    # The other scopes' budgets: the key's host (at the same limit), and one of 10 proxies,
    # which every key shares (at a limit that never binds, for the memory column's too).
    proxies = [f"proxy-{n}.example:8080" for n in range(10)]
    proxy_limit = Limit(FAST.rate, FAST.requests, "never binds")

    def others(key: str) -> list[Budget]:
        budgets = [
            Budget(f"img.{key}", limit),
            Budget(proxies[zlib.crc32(key.encode()) % len(proxies)], proxy_limit),
        ]
        return budgets[: scopes - 1]

    async def check(key: str) -> object:
        return await bucket.acquire(key, limit, 1, others(key))

    async def close() -> None:
        await bucket.aclose()
        await client.aclose()

    name = "scrapy-redis-throttle" + (", adaptive" if adaptive else "")
    name += f", {scopes} scopes" if scopes > 1 else ""
    return Contender(name + (", + 2 windows" if windows else ""), check, close)


async def ours_adaptive(url: str, quota: Quota) -> Contender:
    return await ours(url, quota, adaptive=True)


async def ours_windows(url: str, quota: Quota) -> Contender:
    return await ours(url, quota, windows=True)


async def ours_two_scopes(url: str, quota: Quota) -> Contender:
    return await ours(url, quota, scopes=2)


async def ours_three_scopes(url: str, quota: Quota) -> Contender:
    return await ours(url, quota, scopes=3)


async def limits_moving_window(url: str, quota: Quota) -> Contender:
    from limits import RateLimitItemPerSecond
    from limits.aio.storage import RedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter

    storage = RedisStorage(
        url.replace("redis://", "async+redis://"),
        implementation="redispy",
        max_connections=CONCURRENT_CALLERS,
    )
    limiter = MovingWindowRateLimiter(storage)
    item = RateLimitItemPerSecond(quota.requests, quota.per_seconds)

    async def check(key: str) -> object:
        return await limiter.hit(item, key)

    async def close() -> None:
        await storage.reset()

    return Contender("limits (moving window)", check, close)


async def throttled_gcra(url: str, quota: Quota) -> Contender:
    from throttled.asyncio import RedisStore, Throttled, per_duration

    store = RedisStore(server=url, options={"MAX_CONNECTIONS": CONCURRENT_CALLERS})
    limiter = Throttled(
        using="gcra",
        quota=per_duration(timedelta(seconds=quota.per_seconds), quota.requests),
        store=store,
    )

    async def check(key: str) -> object:
        return await limiter.limit(key)

    async def nothing() -> None:
        pass

    return Contender("throttled-py (GCRA)", check, nothing)


CONTENDERS = [
    minimal_bucket,
    ours,
    ours_adaptive,
    ours_windows,
    ours_two_scopes,
    ours_three_scopes,
    limits_moving_window,
    throttled_gcra,
]


def redis_info(admin: Redis) -> Callable[[], Awaitable[dict[str, float]]]:
    async def read() -> dict[str, float]:
        info = await admin.info("all")
        script_usec = sum(
            info.get(f"cmdstat_{command}", {}).get("usec", 0) for command in ("evalsha", "eval")
        )
        return {
            "script_usec": float(script_usec),
            "cpu": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            "memory": float(info["used_memory"]),
        }

    return read


async def sequential(contender: Contender, calls: int) -> tuple[float, list[float], float]:
    """Calls/s, latencies and client CPU seconds of *calls* checks awaited one after another."""
    latencies = []
    cpu = time.process_time()
    started = time.perf_counter()
    for n in range(calls):
        before = time.perf_counter()
        await contender.check(DOMAINS[n % len(DOMAINS)])
        latencies.append(time.perf_counter() - before)
    elapsed = time.perf_counter() - started
    return calls / elapsed, latencies, time.process_time() - cpu


async def concurrent(contender: Contender, calls: int) -> float:
    async def caller(offset: int) -> None:
        for n in range(offset, calls, CONCURRENT_CALLERS):
            await contender.check(DOMAINS[n % len(DOMAINS)])

    started = time.perf_counter()
    await asyncio.gather(*(caller(offset) for offset in range(CONCURRENT_CALLERS)))
    return calls / (time.perf_counter() - started)


async def round_trips(server: RedisServer, admin: Redis, contender: Contender) -> float:
    """Commands the client sends per check, from MONITOR (commands run inside a script are
    shown as sent by "lua" and are not counted)."""
    monitor = await asyncio.create_subprocess_exec(
        "redis-cli", "-p", str(server.port), "monitor", stdout=asyncio.subprocess.PIPE
    )
    output = monitor.stdout
    assert output is not None
    try:
        # MONITOR shows what runs after it is attached: wait until it shows a marker.
        async def started() -> None:
            while True:
                await admin.echo("bench-start")
                if b"bench-start" in await output.readline():
                    return

        await asyncio.wait_for(started(), 10)
        for n in range(MONITORED_CALLS):
            await contender.check(DOMAINS[n])
        await admin.echo("bench-end")
        sent = 0
        while b"bench-end" not in (line := await output.readline()):
            if b"bench-start" not in line and b" lua]" not in line:
                sent += 1
        return sent / MONITORED_CALLS
    finally:
        monitor.terminate()
        await monitor.wait()


async def memory_per_key(make: Callable[[str, Quota], Awaitable[Contender]]) -> float:
    """used_memory per key of MEMORY_KEYS checks on new keys, in a Redis of its own (the buffers
    of the timing rounds' connections would shrink meanwhile and blur the figure)."""
    with RedisServer() as server:
        admin = connect_url(server.url, {}, 1)
        contender = await make(server.url, SLOW)
        try:
            await contender.check("warm-up")  # connections and script loaded
            before = (await redis_info(admin)())["memory"]
            for n in range(MEMORY_KEYS):
                await contender.check(f"www.site-{n}.example.org")
            # Let Redis finish growing its hash tables (it keeps the old and the new one for a
            # while): the memory of the keys, not of the moment.
            await asyncio.sleep(1)
            return ((await redis_info(admin)())["memory"] - before) / MEMORY_KEYS
        finally:
            await contender.close()
            await admin.aclose()


async def measure(calls: int, rounds: int) -> list[dict[str, Any]]:
    server = RedisServer().start()
    admin = connect_url(server.url, {}, 1)
    read_info = redis_info(admin)
    try:
        figures: dict[str, dict[str, list[float]]] = {}
        contenders = [await make(server.url, FAST) for make in CONTENDERS]
        for contender in contenders:  # warm up: connections, script caches
            for n in range(200):
                await contender.check(DOMAINS[n])
        for round_number in range(rounds):
            # Every other round backwards: a drift of the machine's speed favours no one.
            for contender in contenders[:: 1 if round_number % 2 == 0 else -1]:
                await admin.config_resetstat()
                before = await read_info()
                rate, latencies, client_cpu = await sequential(contender, calls)
                after = await read_info()
                series = figures.setdefault(contender.name, {})
                quantiles = statistics.quantiles(latencies, n=100)
                for name, value in (
                    ("calls_per_s", rate),
                    ("p50_us", quantiles[49] * 1e6),
                    ("p99_us", quantiles[98] * 1e6),
                    ("client_cpu_us", client_cpu / calls * 1e6),
                    ("redis_script_us", (after["script_usec"] - before["script_usec"]) / calls),
                    ("redis_cpu_us", (after["cpu"] - before["cpu"]) / calls * 1e6),
                    ("concurrent_calls_per_s", await concurrent(contender, calls)),
                ):
                    series.setdefault(name, []).append(value)
        rows = []
        floor_runs = figures[contenders[0].name]["redis_script_us"]
        for make, contender in zip(CONTENDERS, contenders, strict=True):
            medians: dict[str, float] = {
                name: statistics.median(values) for name, values in figures[contender.name].items()
            }
            medians["bytes_per_key"] = await memory_per_key(make)
            await admin.flushall()
            medians["round_trips"] = await round_trips(server, admin, contender)
            # Each round's own ratio (run side by side), then the median.
            medians["redis_script_vs_floor"] = statistics.median(
                ours / floor
                for ours, floor in zip(
                    figures[contender.name]["redis_script_us"], floor_runs, strict=True
                )
            )
            row = {"contender": contender.name, **{k: round(v, 2) for k, v in medians.items()}}
            print(
                f"{contender.name:<34} {medians['calls_per_s']:>7.0f} "
                f"{medians['p50_us']:>6.0f} {medians['p99_us']:>6.0f} "
                f"{medians['concurrent_calls_per_s']:>8.0f} {medians['client_cpu_us']:>7.0f} "
                f"{medians['redis_script_us']:>7.1f} ({medians['redis_script_vs_floor']:.2f}x) "
                f"{medians['redis_cpu_us']:>7.1f} {medians['round_trips']:>6.2f} "
                f"{medians['bytes_per_key']:>6.0f}"
            )
            rows.append(row)
        for contender in contenders:
            await contender.close()
        return rows
    finally:
        await admin.aclose()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000, help="checks per contender per round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    run_benchmark(
        "acquire",
        f"{'contender':<34} {'calls/s':>7} {'p50':>6} {'p99':>6} {'16 tasks':>8} "
        f"{'client':>7} {'redis script':>15} {'redis':>7} {'trips':>6} {'B/key':>6}",
        lambda: measure(args.calls, args.rounds),
        "calls/s, p50, p99 (µs): one caller awaiting each check; 16 tasks: calls/s with 16 "
        "concurrent callers;\nclient: CPU µs per call in this process; redis script: µs per call "
        "in INFO commandstats (x the minimal bucket's);\nredis: the server's CPU µs per call "
        "(INFO cpu, I/O included); trips: commands sent per call (MONITOR);\nB/key: used_memory "
        f"per check over {MEMORY_KEYS:,} checks on new domains (under 2 and 3 scopes, each "
        "also writes its host's bucket). Medians of the rounds.",
    )


if __name__ == "__main__":
    main()
