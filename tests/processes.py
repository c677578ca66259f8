"""Crawls in OS processes of their own (``crawl_worker.py``), the command line tool in one, and
bounded waits: for the tests and the benchmarks alike (so no pytest here)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

WORKER = Path(__file__).with_name("crawl_worker.py")


def wait_until(
    predicate: Callable[[], object], timeout: float, message: str, interval: float = 0.02
) -> None:
    """Poll *predicate* until it is true; fail with *message* after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s: {message}")
        time.sleep(interval)


# ``scrapy-redis-throttle``'s command line, in a process of its own.
TOOL = [sys.executable, "-m", "scrapy_redis_throttle.cli"]


def tool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``scrapy-redis-throttle`` in a process of its own, until it ends."""
    return subprocess.run(
        [*TOOL, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        check=False,
    )


def start_crawl_worker(job: dict[str, Any]) -> subprocess.Popen[str]:
    """Start one ``crawl_worker.py`` process for *job* (given on its standard input)."""
    worker = subprocess.Popen(
        [sys.executable, str(WORKER)],
        cwd=WORKER.parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None
    worker.stdin.write(json.dumps(job))
    worker.stdin.close()
    worker.stdin = None  # sent: communicate() must not flush it again
    return worker


def start_crawl_workers(redis_url: str, jobs: list[dict[str, Any]]) -> list[subprocess.Popen[str]]:
    """Start one ``crawl_worker.py`` OS process per job and let them all go at once (their
    spiders wait at a barrier in Redis until every one is ready)."""
    barrier = {"redis_url": redis_url, "key": "test:barrier"}
    workers = [
        start_crawl_worker(
            {**job, "spider_attributes": {**job.get("spider_attributes", {}), "barrier": barrier}}
        )
        for job in jobs
    ]
    with redis.Redis.from_url(redis_url) as client:
        wait_until(lambda: client.llen("test:barrier:ready") == len(jobs), 60, "every worker ready")
        client.rpush("test:barrier:go", *[1] * len(jobs))
    return workers


def finish_crawl_workers(
    workers: list[subprocess.Popen[str]], timeout: float, logs: list[str] | None = None
) -> list[dict[str, Any]]:
    """Wait for the workers to end; check each ended well and return each one's crawl stats
    (and add each one's log to *logs*)."""
    outputs = [worker.communicate(timeout=timeout) for worker in workers]
    all_stats = []
    for worker, (stdout, stderr) in zip(workers, outputs, strict=True):
        if logs is not None:
            logs.append(stderr)
        assert worker.returncode == 0, stderr[-3000:]
        all_stats.append(json.loads(stdout.strip().splitlines()[-1].removeprefix("STATS ")))
    return all_stats
