"""Redis Sentinel (part of #9): real sentinel and replica processes, crawls through them, and a
failover under a running fleet."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer, free_port
from support import (
    assert_paced,
    crawl_settings,
    finish_crawl_workers,
    pages,
    start_crawl_workers,
    wait_until,
)

from scrapy_redis_throttle.bucket import bucket_key

A = HOSTS[0]
SERVICE = "throttle"
# Nothing listens there: with sentinels, the URL's host and port are not used.
UNUSED_URL = "redis://127.0.0.1:1/0"


@dataclass
class SentinelSetup:
    primary: RedisServer
    replica: RedisServer
    sentinel_port: int
    sentinel: subprocess.Popen[bytes]

    def sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_timeout=5)

    def primary_port(self) -> int:
        with self.sentinel_client() as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    def settings(self, **overrides: Any) -> dict[str, Any]:
        return crawl_settings(
            UNUSED_URL,
            REDIS_THROTTLE_SENTINELS=[f"127.0.0.1:{self.sentinel_port}"],
            REDIS_THROTTLE_SENTINEL_SERVICE=SERVICE,
            **overrides,
        )


@pytest.fixture
def sentinel_setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    """A primary, its replica, and one sentinel that fails over after 1 s without the primary."""
    # Directories of their own: a primary and its replica write snapshots when they sync.
    for name in ("primary", "replica"):
        (tmp_path / name).mkdir()
    primary = RedisServer("--dir", str(tmp_path / "primary")).start()
    replica = RedisServer(
        "--dir", str(tmp_path / "replica"), "--replicaof", "127.0.0.1", str(primary.port)
    ).start()
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 1\n"
        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
        f"sentinel failover-timeout {SERVICE} 5000\n"
    )
    sentinel = subprocess.Popen(
        [replica.executable, str(config), "--sentinel"], stdout=subprocess.DEVNULL
    )
    setup = SentinelSetup(primary, replica, port, sentinel)
    try:
        with setup.sentinel_client() as client:

            def knows_the_replica() -> bool:
                try:
                    return bool(client.execute_command("SENTINEL", "REPLICAS", SERVICE))
                except redis.RedisError:
                    return False

            wait_until(knows_the_replica, 30, "the sentinel to know the primary and its replica")
        yield setup
    finally:
        sentinel.kill()
        sentinel.wait(timeout=10)
        replica.stop()
        primary.stop()


def test_a_fleet_through_sentinel_keeps_the_limit(sentinel_setup: SentinelSetup) -> None:
    """Two worker processes find the primary through the sentinel: 30 pages at 5/s."""
    key = bucket_key("redis_throttle", A)
    with sentinel_setup.primary.client() as client:
        # A limit set live lives on in the bucket's value: the workers' calls move its time.
        client.set(key, "1 5.0 - 0")
    with DemoSite(HOSTS, pages=30) as site:
        jobs = [
            {
                "settings": sentinel_setup.settings(),
                "requests": pages(site, A, 15, first=worker * 15),
                "spider_attributes": {"redis_throttle_rates": {A: "5/s"}},
            }
            for worker in range(2)
        ]
        workers = start_crawl_workers(sentinel_setup.primary.url, jobs)  # (the start barrier)
        all_stats = finish_crawl_workers(workers, 120)
        times = [arrival.time for arrival in site.arrivals(A)]
    assert len(times) == 30
    assert_paced(times, rate=5, burst=1, what=A)
    for stats in all_stats:
        assert not [name for name in stats if "errors" in name or "fallback" in name]
    with sentinel_setup.primary.client() as client:
        tat, live = client.get(key).split(b" ", 1)
    assert live == b"5.0 - 0"
    assert int(tat) > 1, "the workers took their tokens in the primary the sentinel named"


@pytest.mark.parametrize("how", ["asked", "primary killed"])
def test_a_fleet_goes_on_through_a_failover(sentinel_setup: SentinelSetup, how: str) -> None:
    """Two worker processes crawl A at 10/s; the sentinel fails the primary over to its
    replica, asked to or because the primary died. Every page is fetched once, the limit holds
    (while there is no primary, as the "local" policy paces: each worker at 10/s / 2 on its
    own, so two may go together; and one moment may be handed out twice), and the fleet does
    not pause."""
    # Two requests at a time per worker: they ask Redis all along, through the failover.
    settings = sentinel_setup.settings(REDIS_THROTTLE_FALLBACK_WORKERS=2, CONCURRENT_REQUESTS=2)
    with DemoSite(HOSTS, pages=80) as site:
        jobs = [
            {
                "settings": settings,
                "requests": pages(site, A, 40, first=worker * 40),
                "spider_attributes": {"redis_throttle_rates": {A: "10/s"}},
            }
            for worker in range(2)
        ]
        workers = start_crawl_workers(sentinel_setup.primary.url, jobs)
        wait_until(lambda: len(site.arrivals(A)) >= 20, 60, "20 arrivals before the failover")
        old_primary = sentinel_setup.primary_port()
        failing_over = time.monotonic()
        if how == "asked":
            with sentinel_setup.sentinel_client() as client:
                client.execute_command("SENTINEL", "FAILOVER", SERVICE)
        else:
            assert sentinel_setup.primary.process is not None
            sentinel_setup.primary.process.kill()
        wait_until(lambda: sentinel_setup.primary_port() != old_primary, 30, "the failover")
        switched = time.monotonic()
        all_stats = finish_crawl_workers(workers, 120)
        arrivals = site.arrivals(A)

    paths = Counter(arrival.path for arrival in arrivals)
    assert len(paths) == 80
    assert max(paths.values()) == 1, "no page fetched twice"
    times = sorted(arrival.time for arrival in arrivals)
    fallback = sum(stats.get("redis_throttle/fallback/local", 0) for stats in all_stats)
    if how == "primary killed":
        assert fallback >= 2, "requests asked while there was no primary"
    if fallback:
        # The old primary's last writes may not have reached its replica: a moment it reserved
        # may be handed out again (README, "Redis Sentinel").
        assert_paced(times, rate=10, burst=2, what=A, extra=1)
    else:
        assert_paced(times, rate=10, burst=1, what=A)
    around = [t for t in times if failing_over - 1 < t < switched + 5]
    pause = max(later - earlier for earlier, later in itertools.pairwise(around))
    assert pause < 0.5, (
        f"the fleet paused {pause:.2f} s (failover: {switched - failing_over:.2f} s)"
    )


def test_the_tool_finds_the_primary_through_the_sentinel(sentinel_setup: SentinelSetup) -> None:
    sentinels = ["--sentinels", f"127.0.0.1:{sentinel_setup.sentinel_port}", "--service", SERVICE]
    done = subprocess.run(
        [sys.executable, "-m", "scrapy_redis_throttle.cli", "--redis-url", UNUSED_URL,
         *sentinels, "set", A, "2/s"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, f"{A}: 2/s (workers' burst)\n"), done.stderr
    with sentinel_setup.primary.client() as client:
        assert client.get(bucket_key("redis_throttle", A)).endswith(b" 2.0 - 0")
