"""The demo: a fleet of scrapy-redis workers crawls a local 4-domain site, twice.

1. "shared budget": the workers use scrapy-redis-throttle, one budget per domain in Redis.
2. "baseline": the same fleet with the throttle off and plain Scrapy politeness instead: each
   worker waits the same per-domain interval (DOWNLOAD_SLOTS delay), on its own.

It starts a private redis-server (unless --redis-url is given) and the demo site on 127.0.0.2-5,
seeds the start URLs, runs --workers ``scrapy crawl shop`` processes for --duration seconds per
run, and prints, per domain, the configured limit next to what the site actually received. It also
draws the requests per second of both runs into a PNG chart.

The fourth domain, 127.0.0.5, takes less than its configured limit: it answers 429 (Retry-After:
2) to more than 3 requests a second. With the shared budget, each 429 pauses it for the whole
fleet and halves its rate (the adaptive rate), which then climbs back; the baseline keeps
sending.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

PROJECT = Path(__file__).resolve().parent
sys.path.insert(0, str(PROJECT))

import redis  # noqa: E402
from demo_site import (  # noqa: E402
    HOSTS,
    OVERLOAD,
    OVERLOADED_HOST,
    DemoSite,
    loopback_hosts_available,
)
from local_redis import RedisServer  # noqa: E402
from scrapy.settings import Settings  # noqa: E402
from shop.spiders.shop import ShopSpider  # noqa: E402

from scrapy_redis_throttle import Limit, ThrottleConfig  # noqa: E402
from scrapy_redis_throttle.config import DEFAULT_KEY_PREFIX  # noqa: E402
from scrapy_redis_throttle.rates import FIXED_WINDOW, SLIDING_WINDOW, TOKEN_BUCKET  # noqa: E402
from scrapy_redis_throttle.redis_schema import rate_key  # noqa: E402

DEMO_HOSTS = [*HOSTS, OVERLOADED_HOST]
PROGRESS_EVERY = 2.0
# After the run's time, a worker gets this long to close cleanly, then as long again after a
# second SIGINT (Scrapy's forced stop), and is then killed.
STOP_GRACE = 5.0


@dataclass(frozen=True)
class Run:
    name: str
    settings: dict[str, str]


@dataclass(frozen=True)
class Arrivals:
    """What one domain received in one run."""

    times: list[float]
    """Seconds from the start of the run of each request answered 200, in order."""
    refused: int
    """Requests answered 429."""
    adaptive_rate: float | None
    """The rate the fleet last lowered the domain to, if it has not climbed back yet."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per run (default 20)")
    parser.add_argument("--pages", type=int, default=500, help="pages per domain (default 500)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline run")
    parser.add_argument(
        "--redis-url",
        help="use this Redis instead of starting one (its keys shop:* and redis_throttle:* "
        "are deleted first)",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("demo-output"), help="where logs go (demo-output/)"
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
    return {host: config.limits.lookup(host) for host in DEMO_HOSTS}


def runs(limits: dict[str, Limit | None], baseline: bool) -> list[Run]:
    shared = Run("shared budget", {})
    # Plain Scrapy: every worker waits the limit's interval between requests to a domain.
    slots = {host: {"delay": 1 / limit.sustained_rate} for host, limit in limits.items() if limit}
    per_process = Run(
        "baseline",
        {
            "REDIS_THROTTLE_ENABLED": "False",
            "DOWNLOAD_SLOTS": json.dumps(slots),
            "DOWNLOAD_DELAY_JITTER": "0",
        },
    )
    return [shared, per_process] if baseline else [shared]


def reset_redis(redis_url: str, site: DemoSite) -> None:
    """An empty frontier and no buckets, then the start URLs."""
    with redis.Redis.from_url(redis_url) as client:
        for pattern in ("shop:*", "redis_throttle:*"):
            for key in client.scan_iter(pattern):
                client.delete(key)
        client.lpush("shop:start_urls", *(site.url(host) for host in site.hosts))


def start_workers(
    run: Run, count: int, redis_url: str, output: Path
) -> list[subprocess.Popen[bytes]]:
    settings = {
        "REDIS_URL": redis_url,
        "LOG_LEVEL": "INFO",
        **run.settings,
    }
    workers = []
    for index in range(count):
        log = output / f"{run.name.replace(' ', '-')}-worker-{index + 1}.log"
        command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-s", f"LOG_FILE={log}"]
        for name, value in settings.items():
            command += ["-s", f"{name}={value}"]
        # A session of their own, so that Ctrl-C reaches only this script, which stops them.
        workers.append(subprocess.Popen(command, cwd=PROJECT, start_new_session=True))
    return workers


def stop_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    for attempt in ("SIGINT", "SIGINT again", "SIGKILL"):
        running = [w for w in workers if w.poll() is None]
        for worker in running:
            worker.send_signal(signal.SIGKILL if attempt == "SIGKILL" else signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE
        for worker in running:
            with suppress(subprocess.TimeoutExpired):
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))


def allowed_in(limit: Limit, window: float) -> float:
    """The most requests *limit* lets go in any *window* seconds: the bucket's burst + rate x
    window, or fewer if a quota allows fewer."""
    allowed = [limit.burst + limit.rate * window]
    for quota in limit.quotas:
        windows = math.ceil(window / quota.period)
        allowed.append(
            {
                TOKEN_BUCKET: quota.count + window / quota.period,
                SLIDING_WINDOW: quota.count * windows,
                FIXED_WINDOW: quota.count * (windows + 1),
            }[quota.algorithm]
        )
    return min(allowed)


def busiest_window(times: list[float], window: float) -> int:
    """The most arrivals in any *window* seconds."""
    best = start = 0
    for end, t in enumerate(times):
        while t - times[start] >= window:
            start += 1
        best = max(best, end - start + 1)
    return best


def crawl(run: Run, args: argparse.Namespace, redis_url: str) -> dict[str, Arrivals]:
    """One run of the fleet; returns what each host received."""
    log_name = f"arrivals-{run.name.replace(' ', '-')}.jsonl"
    with (
        (args.output / log_name).open("w") as log,
        DemoSite(
            DEMO_HOSTS, pages=args.pages, log=log, overload={OVERLOADED_HOST: OVERLOAD}
        ) as site,
    ):
        reset_redis(redis_url, site)
        print(f"\n== {run.name}: {args.workers} workers for {args.duration:g} s ==")
        workers = start_workers(run, args.workers, redis_url, args.output)
        started = time.monotonic()
        endpoints: list[str] = []
        try:
            last = dict.fromkeys(DEMO_HOSTS, 0)
            while time.monotonic() - started < args.duration:
                time.sleep(PROGRESS_EVERY)  # the pace of the progress lines, not a synchronisation
                counts = {host: len(site.arrivals(host)) for host in DEMO_HOSTS}
                print(
                    f"  {time.monotonic() - started:5.1f} s  "
                    + "  ".join(
                        f"{h}: {counts[h]:4d} ({(counts[h] - last[h]) / PROGRESS_EVERY:4.1f}/s)"
                        for h in DEMO_HOSTS
                    ),
                    flush=True,
                )
                last = counts
                if not endpoints and (endpoints := metrics_endpoints(run, args.output)):
                    print(
                        f"  Prometheus can scrape each worker at {', '.join(endpoints)} (and "
                        "the fleet with `scrapy-redis-throttle exporter --port 9409`)"
                    )
                if all(w.poll() is not None for w in workers):
                    print(f"  all workers exited: see {args.output}/*-worker-*.log")
                    break
            if endpoints:
                acquired = scrape_acquired(endpoints)
                print(
                    "  the workers' /metrics now, requests acquired (the site's count): "
                    + "  ".join(
                        f"{h}: {acquired.get(h, 0):.0f} ({len(site.arrivals(h))})"
                        for h in DEMO_HOSTS
                    )
                )
        finally:
            stop_workers(workers)
        return {
            h: Arrivals(
                sorted(a.time - started for a in site.arrivals(h) if a.status == 200),
                sum(a.status == 429 for a in site.arrivals(h)),
                adaptive_rate(redis_url, h),
            )
            for h in DEMO_HOSTS
        }


def metrics_endpoints(run: Run, output: Path) -> list[str]:
    """The /metrics URLs the workers of *run* logged (see REDIS_THROTTLE_METRICS_PORT)."""
    logs = sorted(output.glob(f"{run.name.replace(' ', '-')}-worker-*.log"))
    found = [METRICS_AT.search(log.read_text(errors="replace")) for log in logs]
    return [match[1] for match in found if match]


METRICS_AT = re.compile(r"metrics at (http://\S+/metrics)")


def scrape_acquired(endpoints: list[str]) -> dict[str, float]:
    """scrapy_redis_throttle_requests_total{result="acquired"} per domain, summed over the
    *endpoints* that answer (a worker that ended serves none)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    acquired: dict[str, float] = {}
    for url in endpoints:
        try:
            with urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (
                    sample.name == "scrapy_redis_throttle_requests_total"
                    and sample.labels["result"] == "acquired"
                ):
                    domain = sample.labels["domain"]
                    acquired[domain] = acquired.get(domain, 0.0) + sample.value
    return acquired


def adaptive_rate(redis_url: str, host: str) -> float | None:
    """The rate the fleet last lowered *host* to, if its key is still there (the rate has not
    climbed back to the configured one yet): see lua/slow_down.lua for the format."""
    with redis.Redis.from_url(redis_url) as client:
        state = client.get(rate_key(DEFAULT_KEY_PREFIX, host))
    return None if state is None else float(state.split()[0])


def report(
    results: dict[str, dict[str, Arrivals]], limits: dict[str, Limit | None], workers: int
) -> list[dict[str, object]]:
    print(f"\nWhat the site received from {workers} workers, per domain and run:\n")
    width = max(len(str(limit)) for limit in limits.values())
    header = (
        f"{'domain':<10} {'limit':<{width}} {'run':<14} {'requests':>8} {'429s':>5} "
        f"{'achieved':>9} {'x limit':>7} {'busiest 1 s':>11} {'(max)':>5} "
        f"{'busiest 10 s':>12} {'(max)':>5}"
    )
    print(header)
    print("-" * len(header))
    rows: list[dict[str, object]] = []
    for host in DEMO_HOSTS:
        limit = limits[host]
        assert limit is not None, "the demo spider limits every demo domain"
        for run_name, arrivals in results.items():
            times = arrivals[host].times
            # Rate after the first burst, over the busy period.
            span = times[-1] - times[0] if len(times) > 1 else 0.0
            achieved = (len(times) - limit.burst) / span if span > 0 else 0.0
            row = {
                "domain": host,
                "limit": str(limit),
                "run": run_name,
                "requests": len(times),
                "refused_429": arrivals[host].refused,
                "adaptive_rate": arrivals[host].adaptive_rate,
                "achieved_per_s": round(achieved, 3),
                "times_limit": round(len(times) / allowed_in(limit, span), 2),
                "busiest_1s": busiest_window(times, 1.0),
                "max_1s": round(allowed_in(limit, 1.0), 1),
                "busiest_10s": busiest_window(times, 10.0),
                "max_10s": round(allowed_in(limit, 10.0), 1),
            }
            rows.append(row)
            first = run_name == next(iter(results))
            print(
                f"{host if first else '':<10} {str(limit) if first else '':<{width}} "
                f"{run_name:<14} {row['requests']:>8} {row['refused_429']:>5} {achieved:>7.2f}/s "
                f"{row['times_limit']:>6}x "
                f"{row['busiest_1s']:>11} {row['max_1s']:>5} {row['busiest_10s']:>12} "
                f"{row['max_10s']:>5}"
            )
    print(
        "\n'requests': answered 200; '429s': refused by the site; 'achieved': requests per second "
        "after the first burst,\nover the busy period; 'x limit': the requests over what the "
        "limit allows in that period;\n'(max)': what the limit allows in that window (burst + "
        f"rate x window, or fewer with a quota).\n{OVERLOADED_HOST} takes at most "
        f"{OVERLOAD[0]} requests a second: each 429 (Retry-After: {OVERLOAD[1]}) pauses it for "
        "the whole fleet."
    )
    for row in rows:
        if row["adaptive_rate"] is not None:
            print(
                f"The {row['run']} fleet last lowered {row['domain']}'s rate to "
                f"{row['adaptive_rate']:.2f}/s (adaptive rate; it climbs back while no 429 comes)."
            )
    return rows


def rate_series(
    times: list[float], end: float, window: float = 5.0
) -> tuple[list[float], list[float]]:
    """Requests per second over the last *window* seconds, every 0.5 s up to *end*."""
    xs = [step / 2 for step in range(int(end * 2) + 1)]
    return xs, [sum(x - window < t <= x for t in times) / window for x in xs]


def chart(
    results: dict[str, dict[str, Arrivals]], limits: dict[str, Limit | None], path: Path
) -> bool:
    """Requests per second per domain over time, one panel per run, with each limit dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no chart)")
        return False
    figure, axes = plt.subplots(
        1, len(results), figsize=(6 * len(results), 4), sharey=True, squeeze=False
    )
    for axis, (run_name, arrivals) in zip(axes[0], results.items(), strict=True):
        end = max((a.times[-1] for a in arrivals.values() if a.times), default=0.0)
        for index, host in enumerate(DEMO_HOSTS):
            color = f"C{index}"
            axis.plot(*rate_series(arrivals[host].times, end), color=color, label=host)
            limit = limits[host]
            if limit is not None:
                axis.axhline(limit.sustained_rate, color=color, linestyle="--", linewidth=1)
        axis.set_title(f"{run_name}")
        axis.set_xlabel("seconds since the workers started")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("requests/s over the last 5 s (dashed: limit)")
    axes[0][-1].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def main() -> int:
    args = parse_args()
    if not loopback_hosts_available(DEMO_HOSTS):
        print(f"This machine does not route {', '.join(DEMO_HOSTS)} (Linux does by default).")
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
        print("Limits: " + "   ".join(f"{h}: {limits[h] or 'unlimited'}" for h in DEMO_HOSTS))
        results = {}
        try:
            for run in runs(limits, baseline=not args.no_baseline):
                results[run.name] = crawl(run, args, redis_url)
        except KeyboardInterrupt:
            print("\nInterrupted: the workers were stopped.")
            if not results:
                return 130
    rows = report(results, limits, args.workers)
    (args.output / "summary.json").write_text(json.dumps(rows, indent=2))
    print(f"\nTable: {args.output / 'summary.json'}; arrival logs: {args.output}/arrivals-*.jsonl")
    chart_path = args.output / "requests-per-second.png"
    if chart(results, limits, chart_path):
        print(f"Chart: {chart_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
