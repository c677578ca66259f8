"""Test support: bounded waits, async tests, server-side pacing checks, a test spider."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import pytest_twisted
import redis
from scrapy.crawler import CrawlerRunner
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from spiders import BASE_SETTINGS, UrlListSpider
from twisted.internet.defer import Deferred

if TYPE_CHECKING:
    from scrapy.crawler import Crawler


def wait_until(
    predicate: Callable[[], object], timeout: float, message: str, interval: float = 0.02
) -> None:
    """Poll *predicate* until it is true; fail with *message* after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s: {message}")
        time.sleep(interval)


def async_test(func: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., Deferred[None]]:
    """Run an ``async def`` test as an asyncio task on the reactor's loop, the way Scrapy runs
    coroutines (pytest-twisted's own decorator cannot await asyncio futures)."""

    @pytest_twisted.inlineCallbacks  # type: ignore[untyped-decorator]
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Generator[Deferred[None], None, None]:
        yield deferred_from_coro(func(*args, **kwargs))

    return wrapper  # type: ignore[no-any-return]


# Server-side arrival times may be squeezed by this much by uneven network and thread latency.
ARRIVAL_JITTER = 0.1


def assert_paced(
    times: list[float],
    rate: float,
    burst: int,
    what: str,
    jitter: float = ARRIVAL_JITTER,
    extra: int = 0,
) -> None:
    """No window [t_i, t_j] of *times* holds more than ``burst + rate * (t_j - t_i)`` arrivals,
    give or take *jitter* seconds on the window's length and *extra* arrivals."""
    times = sorted(times)
    for i, first in enumerate(times):
        for j in range(i, len(times)):
            allowed = burst + rate * (times[j] - first + jitter) + extra
            assert j - i + 1 <= allowed, (
                f"{what}: {j - i + 1} arrivals within {times[j] - first:.3f} s "
                f"(limit {rate}/s, burst {burst}: at most {allowed:.2f})"
            )


def achieved_rate(times: list[float], burst: int) -> float:
    """Requests per second after the initial burst, over the busy period."""
    times = sorted(times)
    return (len(times) - burst) / (times[-1] - times[0])


def crawl_settings(redis_url: str, **overrides: Any) -> dict[str, Any]:
    return {**BASE_SETTINGS, "REDIS_URL": redis_url, **overrides}


async def run_crawl(
    settings: dict[str, Any], requests: list[dict[str, Any]], **spider_attributes: Any
) -> Crawler:
    """Run one in-process crawl to its end and return its crawler (for its stats)."""
    runner = CrawlerRunner(settings)
    crawler = runner.create_crawler(UrlListSpider)
    await maybe_deferred_to_future(runner.crawl(crawler, requests=requests, **spider_attributes))
    return crawler


WORKER = Path(__file__).with_name("crawl_worker.py")


def start_crawl_workers(redis_url: str, jobs: list[dict[str, Any]]) -> list[subprocess.Popen[str]]:
    """Start one ``crawl_worker.py`` OS process per job and let them all go at once (their
    spiders wait at a barrier in Redis until every one is ready)."""
    workers = []
    for job in jobs:
        spider_attributes = {
            **job.get("spider_attributes", {}),
            "barrier": {"redis_url": redis_url, "key": "test:barrier"},
        }
        workers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    json.dumps({**job, "spider_attributes": spider_attributes}),
                ],
                cwd=WORKER.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    with redis.Redis.from_url(redis_url) as client:
        wait_until(lambda: client.llen("test:barrier:ready") == len(jobs), 60, "every worker ready")
        client.rpush("test:barrier:go", *[1] * len(jobs))
    return workers


def finish_crawl_workers(
    workers: list[subprocess.Popen[str]], timeout: float
) -> list[dict[str, Any]]:
    """Wait for the workers to end; check each ended well and return each one's crawl stats."""
    outputs = [worker.communicate(timeout=timeout) for worker in workers]
    all_stats = []
    for worker, (stdout, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr[-3000:]
        all_stats.append(json.loads(stdout.strip().splitlines()[-1].removeprefix("STATS ")))
    return all_stats
