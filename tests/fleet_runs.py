"""Fleets of ``crawl_worker.py`` processes crawling the demo site through scrapy-redis's shared
queue, for test_default_setup.py and bench/one_line.py: the three domains and their limits, the
frontiers, the one-line set-up's settings, and starting, stopping and timing the workers."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from demo_site import HOSTS, Arrival, DemoSite
from processes import start_crawl_workers, wait_until
from releases import EXTENSION as RELEASES_EXTENSION
from support import ARRIVAL_JITTER, pages

WORKERS = 3
# How long the site asks a refused request's domain to wait (Retry-After, seconds).
RETRY_AFTER = 1


@dataclass(frozen=True)
class Domain:
    host: str
    rate: float
    burst: int

    @property
    def spec(self) -> dict[str, Any]:
        """Its entry of the spider's ``redis_throttle_rates``."""
        return {"rate": self.rate, "burst": self.burst}

    @property
    def site_budget(self) -> int:
        """The most arrivals the site lets in any 1 s (the last one included; one more is answered
        429). A GCRA bucket lets at most ``burst + rate x W`` requests go in any W seconds of
        Redis's clock; the site sees each window up to ARRIVAL_JITTER shorter (uneven latency),
        so in its 1 s window at most ``burst + rate x (1 + ARRIVAL_JITTER)``: what
        assert_paced allows too. A 429 so means the limit was broken, never bad luck."""
        return math.floor(self.burst + self.rate * (1 + ARRIVAL_JITTER))

    def overload(self, extra: int = 0) -> tuple[int, int]:
        """The site's ``overload`` entry for this domain (with *extra* arrivals tolerated)."""
        return self.site_budget + extra, RETRY_AFTER


# 127.0.0.2 sorts first in scrapy-redis's priority queue (its members are the pickled requests:
# for pages of equal length, by URL): the slow domain's requests are first in line.
SLOW = Domain(HOSTS[0], 0.5, 1)
MIDDLE = Domain(HOSTS[1], 2.0, 1)
FAST = Domain(HOSTS[2], 20.0, 1)
DOMAINS = [SLOW, MIDDLE, FAST]
RATES = {domain.host: domain.spec for domain in DOMAINS}

# Pages per domain. Even: about 12 s of work for each at its rate. Slow-rich: far more for the
# slow domain than it can serve in the run, 12 s for the fast one (the run ends when it is
# done), and more than that for the middle one (it still has work at the end).
EVEN = {SLOW.host: 7, MIDDLE.host: 25, FAST.host: 241}
SLOW_RICH = {SLOW.host: 150, MIDDLE.host: 40, FAST.host: 240}
FRONTIERS = {"even": EVEN, "slow-rich": SLOW_RICH}
# The fleet needs 12 s for either; 2.5 times that is plenty (a bound, not a pace).
FRONTIER_DEADLINE = 30.0


def one_line_settings(
    redis_url: str, per_domain: int | None, addon: bool = False, **overrides: Any
) -> dict[str, Any]:
    """The one-line set-up, the middleware line or the *addon*, with Scrapy's default
    CONCURRENT_REQUESTS (16)."""
    line = (
        {"ADDONS": {"scrapy_redis_throttle.Addon": 500}}
        if addon
        else {"DOWNLOADER_MIDDLEWARES": {"scrapy_redis_throttle.RedisThrottleMiddleware": 950}}
    )
    settings: dict[str, Any] = {
        **line,
        "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "SCHEDULER_PERSIST": True,
        "REDIS_URL": redis_url,
        "DOWNLOAD_DELAY": 0,
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "LOG_LEVEL": "INFO",
    }
    if per_domain is not None:
        settings["CONCURRENT_REQUESTS_PER_DOMAIN"] = per_domain
    return {**settings, **overrides}


def fleet_jobs(
    site: DemoSite,
    settings: dict[str, Any],
    counts: dict[str, int],
    rates: dict[str, Any],
    workers: int = WORKERS,
) -> list[dict[str, Any]]:
    """*workers* jobs that share *counts* pages per host between them, each page in one job,
    and report what their throttles did (see :mod:`releases`)."""
    requests = [spec for host, count in counts.items() for spec in pages(site, host, count)]
    return [
        {
            "settings": {**settings, "EXTENSIONS": RELEASES_EXTENSION},
            "requests": requests[worker::workers],
            "spider_attributes": {"redis_throttle_rates": rates},
        }
        for worker in range(workers)
    ]


@contextmanager
def fleet(redis_url: str, jobs: list[dict[str, Any]]) -> Iterator[list[subprocess.Popen[str]]]:
    """The workers of *jobs*, let go at once; any still running on leaving are killed."""
    workers = start_crawl_workers(redis_url, jobs)
    try:
        yield workers
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
            for stream in (worker.stdout, worker.stderr):
                if stream is not None:
                    stream.close()


@dataclass(frozen=True)
class Ended:
    """A worker that ended: how, when (time.monotonic()), its crawl stats and its log."""

    returncode: int
    at: float
    stats: dict[str, Any]
    log: str


def wait_for_workers(
    workers: list[subprocess.Popen[str]], timeout: float, what: str
) -> list[Ended]:
    """Wait (each worker in a thread of its own, so each end is timed) at most *timeout* s for
    every worker to end."""

    def ended(worker: subprocess.Popen[str]) -> Ended:
        try:
            stdout, stderr = worker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            worker.kill()  # its log, to tell why it still ran
            _, stderr = worker.communicate()
            raise AssertionError(
                f"a worker still runs {timeout:g} s after {what}; the end of its log:\n"
                f"{stderr[-4000:]}"
            ) from None
        at = time.monotonic()
        lines = stdout.strip().splitlines()
        stats = json.loads(lines[-1].removeprefix("STATS ")) if lines else {}
        return Ended(worker.returncode, at, stats, stderr)

    with ThreadPoolExecutor(len(workers)) as pool:
        return list(pool.map(ended, workers))


def check_ended_well(ends: list[Ended]) -> None:
    for index, end in enumerate(ends):
        assert end.returncode == 0, f"worker {index}: exit {end.returncode}:\n{end.log[-3000:]}"
        assert end.stats, f"worker {index}: no stats:\n{end.log[-3000:]}"
        assert "Traceback" not in end.log, f"worker {index}:\n{end.log[-3000:]}"


def interrupt(workers: list[subprocess.Popen[str]]) -> list[float]:
    """SIGINT (Ctrl-C) every worker; return when each was sent (time.monotonic())."""
    sent = []
    for worker in workers:
        worker.send_signal(signal.SIGINT)
        sent.append(time.monotonic())
    return sent


def fetched(arrivals: list[Arrival]) -> Counter[str]:
    """How many times each path was answered 200."""
    return Counter(a.path for a in arrivals if a.status == 200)


def check_fetched_once(arrivals: list[Arrival], counts: dict[str, int]) -> None:
    """Every page of *counts* (pages per host) answered 200 exactly once."""
    paths = Counter((a.host, a.path) for a in arrivals if a.status == 200)
    twice = {where: n for where, n in paths.items() if n > 1}
    assert not twice, f"pages fetched more than once: {twice}"
    for host, total in counts.items():
        missing = {f"/page/{n}" for n in range(total)} - set(
            fetched([a for a in arrivals if a.host == host])
        )
        assert not missing, f"{host}: never fetched: {sorted(missing)}"


def refused(arrivals: list[Arrival]) -> int:
    return sum(a.status == 429 for a in arrivals)


def refusals(arrivals: list[Arrival]) -> str:
    """Each 429 with the arrivals of its host in the second before it (ms before it), to tell
    a squeezed second from a broken rate; empty when there was none."""
    lines = []
    for refusal in (a for a in arrivals if a.status == 429):
        before = sorted(
            a.time
            for a in arrivals
            if a.host == refusal.host and refusal.time - 1 < a.time < refusal.time
        )
        lines.append(
            f"429 at {refusal.host}{refusal.path}, {len(before)} arrivals in the second before"
            " it, ms before: " + " ".join(f"{(refusal.time - t) * 1000:.0f}" for t in before)
        )
    return "\n".join(lines)


def progress(site: DemoSite, counts: dict[str, int]) -> str:
    return ", ".join(
        f"{host}: {len(fetched(site.arrivals(host)))}/{count}" for host, count in counts.items()
    )


def wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    """Like wait_until, but say whether it happened instead of failing."""
    try:
        wait_until(predicate, timeout, "")
    except AssertionError:
        return False
    return True
