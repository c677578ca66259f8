"""A worker that cannot start says why in one ERROR line of its log (the one README's start
command prints), before Scrapy's traceback, and its crawl ends: a setting that is none
of the throttle's, and scrapy-redis's Redis not answering (its queue is there: the worker
cannot crawl). Real ``scrapy crawl`` processes of the example project."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE_PROJECT
from redis_topologies import UNUSED_URL


def crawl(tmp_path: Path, *settings: str) -> list[str]:
    """Run ``scrapy crawl shop`` with *settings* until it ends (Scrapy 2.14 exits with 0 even
    then, later ones with 1): the ERROR lines the throttle logged."""
    log = tmp_path / "worker.log"
    args = [f"-s{setting}" for setting in (f"LOG_FILE={log}", *settings)]
    subprocess.run(
        [sys.executable, "-m", "scrapy", "crawl", "shop", *args],
        cwd=EXAMPLE_PROJECT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = log.read_text(encoding="utf-8").splitlines()
    return [line for line in lines if "ERROR: Redis throttle" in line]


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        (
            ("REDIS_THROTTLE_RATE=5/s",),
            "the worker stops: REDIS_THROTTLE_RATE is no setting of scrapy-redis-throttle: did "
            "you mean REDIS_THROTTLE_RATES?",
        ),
        (
            (f"REDIS_URL={UNUSED_URL}",),
            "the worker stops: scrapy_redis.scheduler.Scheduler cannot reach its Redis at "
            f"{UNUSED_URL} (REDIS_URL): ConnectionError",
        ),
    ],
    ids=["unknown-setting", "scrapy-redis-redis-down"],
)
def test_a_worker_that_cannot_start_says_why_in_one_line(
    tmp_path: Path, settings: tuple[str, ...], error: str
) -> None:
    errors = crawl(tmp_path, *settings)
    assert len(errors) == 1, errors
    assert f"ERROR: Redis throttle: {error}" in errors[0], errors[0]
