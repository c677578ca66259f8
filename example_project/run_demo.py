"""The demo: a fleet of scrapy-redis workers crawls a local 3-domain site through one shared budget.

It starts a private redis-server (unless --redis-url is given), the demo site on 127.0.0.2-4,
seeds the start URLs, runs --workers ``scrapy crawl shop`` processes for --duration seconds, and
prints, per domain, the configured limit next to what the site actually received.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

PROJECT = Path(__file__).resolve().parent
sys.path.insert(0, str(PROJECT))

import redis  # noqa: E402
from demo_site import DemoSite, loopback_hosts_available  # noqa: E402
from local_redis import RedisServer  # noqa: E402
from scrapy.settings import Settings  # noqa: E402
from shop.spiders.shop import ShopSpider  # noqa: E402

from scrapy_redis_throttle import Limit, ThrottleConfig  # noqa: E402

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
PROGRESS_EVERY = 2.0
WORKER_STOP_TIMEOUT = 15.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds (default 20)")
    parser.add_argument("--pages", type=int, default=300, help="pages per domain (default 300)")
    parser.add_argument(
        "--redis-url",
        help="use this Redis instead of starting one (its keys shop:* and redis_throttle:* "
        "are deleted first)",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("demo-output"), help="logs go here (demo-output/)"
    )
    args = parser.parse_args()
    if args.workers < 1 or args.duration <= 0 or args.pages < 1:
        parser.error("--workers, --duration and --pages must be positive")
    return args


def configured_limits() -> dict[str, Limit | None]:
    """The limits the workers use, read by the plugin's own configuration code."""
    settings = Settings()
    settings.setmodule("shop.settings")
    config = ThrottleConfig.from_settings(settings, spider_rates=ShopSpider.redis_throttle_rates)
    return {host: config.limits.lookup(host) for host in HOSTS}


def seed(redis_url: str, site: DemoSite) -> None:
    with redis.Redis.from_url(redis_url) as client:
        for pattern in ("shop:*", "redis_throttle:*"):
            for key in client.scan_iter(pattern):
                client.delete(key)
        client.lpush("shop:start_urls", *(site.url(host) for host in HOSTS))


def start_workers(
    count: int, redis_url: str, duration: float, output: Path
) -> list[subprocess.Popen[bytes]]:
    workers = []
    for index in range(count):
        log = output / f"worker-{index + 1}.log"
        command = [
            sys.executable, "-m", "scrapy", "crawl", "shop",
            "-s", f"REDIS_URL={redis_url}",
            "-s", f"CLOSESPIDER_TIMEOUT={duration}",
            "-s", "LOG_LEVEL=INFO",
            "-s", f"LOG_FILE={log}",
        ]  # fmt: skip
        # A session of their own, so that Ctrl-C reaches only this script, which stops them.
        workers.append(subprocess.Popen(command, cwd=PROJECT, start_new_session=True))
    return workers


def stop_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGINT)  # Scrapy's graceful stop
    deadline = time.monotonic() + WORKER_STOP_TIMEOUT
    for worker in workers:
        try:
            worker.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def busiest_window(times: list[float], window: float) -> int:
    """The most arrivals in any *window* seconds."""
    best = start = 0
    for end, t in enumerate(times):
        while t - times[start] >= window:
            start += 1
        best = max(best, end - start + 1)
    return best


def show_progress(site: DemoSite, started: float, last: dict[str, int]) -> None:
    parts = []
    for host in HOSTS:
        count = len(site.arrivals(host))
        parts.append(f"{host}: {count:4d} ({(count - last.get(host, 0)) / PROGRESS_EVERY:4.1f}/s)")
        last[host] = count
    print(f"  {time.monotonic() - started:5.1f} s   " + "   ".join(parts), flush=True)


def report(
    site: DemoSite, limits: dict[str, Limit | None], workers: int
) -> list[dict[str, object]]:
    print(f"\nWhat the site received from {workers} workers sharing one budget per domain:\n")
    header = (
        f"{'domain':<11} {'limit':<18} {'requests':>8} {'achieved':>10} "
        f"{'busiest 1 s':>12} {'(max)':>6} {'busiest 10 s':>13} {'(max)':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for host in HOSTS:
        times = sorted(a.time for a in site.arrivals(host) if a.status == 200)
        limit = limits[host]
        burst = limit.burst if limit else 0
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        achieved = (len(times) - burst) / span if span > 0 else 0.0
        row = {
            "domain": host,
            "limit": str(limit) if limit else "unlimited",
            "requests": len(times),
            "achieved_per_s": round(achieved, 3),
            "busiest_1s": busiest_window(times, 1.0),
            "max_1s": round(burst + limit.rate * 1, 2) if limit else None,
            "busiest_10s": busiest_window(times, 10.0),
            "max_10s": round(burst + limit.rate * 10, 2) if limit else None,
        }
        rows.append(row)
        print(
            f"{host:<11} {row['limit']:<18} {len(times):>8} {achieved:>8.2f}/s "
            f"{row['busiest_1s']:>12} {row['max_1s']!s:>6} {row['busiest_10s']:>13} "
            f"{row['max_10s']!s:>6}"
        )
    print(
        "\n'achieved' is requests per second after the first burst, over the busy period; "
        "'(max)' is what the limit allows in that window (burst + rate x window)."
    )
    return rows


def main() -> int:
    args = parse_args()
    if not loopback_hosts_available(HOSTS):
        print(f"This machine does not route {', '.join(HOSTS)} (Linux does by default).")
        return 1
    args.output = args.output.resolve()  # the workers run in the project directory
    args.output.mkdir(parents=True, exist_ok=True)
    limits = configured_limits()
    with ExitStack() as stack:
        redis_url = args.redis_url
        if redis_url is None:
            try:
                redis_url = stack.enter_context(RedisServer()).url
            except RuntimeError as exc:
                print(exc)
                return 1
            print(f"Started a private redis-server at {redis_url}")
        arrivals_log = stack.enter_context((args.output / "arrivals.jsonl").open("w"))
        site = stack.enter_context(DemoSite(HOSTS, pages=args.pages, log=arrivals_log))
        print(f"Demo site: {', '.join(site.url(host) for host in HOSTS)} ({args.pages} pages each)")
        print("Limits:  " + "   ".join(f"{h}: {limits[h] or 'unlimited'}" for h in HOSTS))
        seed(redis_url, site)

        workers = start_workers(args.workers, redis_url, args.duration, args.output)
        stack.callback(stop_workers, workers)
        print(f"Running {args.workers} workers for {args.duration:g} s (logs: {args.output}/)\n")
        started = time.monotonic()
        last: dict[str, int] = {}
        try:
            while any(worker.poll() is None for worker in workers):
                time.sleep(PROGRESS_EVERY)  # the pace of the progress lines, not a synchronisation
                show_progress(site, started, last)
        except KeyboardInterrupt:
            print("\nInterrupted: stopping the workers.")
            stop_workers(workers)
        rows = report(site, limits, args.workers)
        failed = [w.returncode for w in workers if w.returncode not in (0, -signal.SIGINT)]
        if failed:
            print(f"\nSome workers failed (exit codes {failed}): see {args.output}/worker-*.log")
        (args.output / "summary.json").write_text(json.dumps(rows, indent=2))
        print(
            f"Arrival log: {args.output / 'arrivals.jsonl'}; table: {args.output / 'summary.json'}"
        )
        return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("SCRAPY_SETTINGS_MODULE", "shop.settings")
    sys.exit(main())
