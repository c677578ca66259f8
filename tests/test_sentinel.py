"""Redis Sentinel (part of #9): real sentinel and replica processes, crawls through them, and a
failover under a running fleet."""

from __future__ import annotations

from typing import Any

import pytest
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from redis_topologies import SERVICE, UNUSED_URL, SentinelSetup
from support import (
    SCRAPY_REDIS,
    assert_released_paced,
    crawl_settings,
    crawl_through_failover,
    finish_crawl_workers,
    one_domain_jobs,
    start_crawl_workers,
    tool,
    wait_until,
)

from scrapy_redis_throttle.redis_schema import bucket_key

A = HOSTS[0]


def crawl_through(setup: SentinelSetup, **overrides: Any) -> dict[str, Any]:
    return crawl_settings(UNUSED_URL, **setup.settings(), **overrides)


def test_a_fleet_through_sentinel_keeps_the_limit(sentinel_setup: SentinelSetup) -> None:
    """Two worker processes find the primary through the sentinel: 30 pages at 5/s."""
    key = bucket_key("redis_throttle", A)
    with sentinel_setup.primary.client() as client:
        # A limit set live lives on in the bucket's value: the workers' calls move its time.
        client.set(key, "1 5.0 - 0")
    with DemoSite(HOSTS, pages=30) as site:
        jobs = one_domain_jobs(site, A, crawl_through(sentinel_setup), {A: "5/s"}, 2, 15)
        workers = start_crawl_workers(sentinel_setup.primary.url, jobs)  # (the start barrier)
        all_stats = finish_crawl_workers(workers, 120)
        arrivals = site.arrivals(A)
    assert len(arrivals) == 30
    assert_released_paced(all_stats, arrivals, 5, 1, A)
    for stats in all_stats:
        assert not [name for name in stats if "errors" in name or "fallback" in name]
    with sentinel_setup.primary.client() as client:
        tat, live = client.get(key).split(b" ", 1)
    assert live == b"5.0 - 0"
    assert int(tat) > 1, "the workers took their tokens in the primary the sentinel named"


@pytest.mark.parametrize("how", ["asked", "primary killed"])
def test_a_fleet_goes_on_through_a_failover(sentinel_setup: SentinelSetup, how: str) -> None:
    """The sentinel fails the primary over to its replica under a running fleet, asked to or
    because the primary died (see :func:`crawl_through_failover`)."""
    old_primary = sentinel_setup.primary_port()

    def fail_over() -> None:
        if how == "asked":
            with sentinel_setup.sentinel_client() as client:
                client.execute_command("SENTINEL", "FAILOVER", SERVICE)
        else:
            sentinel_setup.primary.stop()

    crawl_through_failover(
        crawl_through(sentinel_setup),
        sentinel_setup.primary.url,
        fail_over,
        lambda: sentinel_setup.primary_port() != old_primary,
        killed=how == "primary killed",
    )


def test_leased_requests_are_crawled_once_through_a_failover(
    sentinel_setup: SentinelSetup, redis_server: RedisServer
) -> None:
    """With scrapy-redis's scheduler: its queue, parking set and leases in its Redis, the
    buckets in the one the sentinel names. The buckets' primary dies under the fleet: the
    leases go on, and every page is fetched once."""
    old_primary = sentinel_setup.primary_port()

    def leasing() -> None:
        with redis_server.client() as client:
            wait_until(
                lambda: any(client.scan_iter("*:leases:*")), 10, "the workers to hold leases"
            )

    crawl_through_failover(
        # Persisted: the first worker done must not flush the queue the other still crawls.
        crawl_settings(
            redis_server.url, **sentinel_setup.settings(), **SCRAPY_REDIS, SCHEDULER_PERSIST=True
        ),
        redis_server.url,
        sentinel_setup.primary.stop,
        lambda: sentinel_setup.primary_port() != old_primary,
        killed=True,
        after_failover=leasing,
    )
    with redis_server.client() as client:
        assert list(client.scan_iter("*:leases:*")) == [], "every lease acknowledged"


def test_the_tool_finds_the_primary_through_the_sentinel(sentinel_setup: SentinelSetup) -> None:
    sentinels = ["--sentinels", f"127.0.0.1:{sentinel_setup.sentinel_port}", "--service", SERVICE]
    done = tool("--redis-url", UNUSED_URL, *sentinels, "set", A, "2/s")
    assert (done.returncode, done.stdout) == (0, f"{A}: 2/s (workers' burst)\n"), done.stderr
    with sentinel_setup.primary.client() as client:
        assert client.get(bucket_key("redis_throttle", A)).endswith(b" 2.0 - 0")
