"""Redis AUTH (password, ACL user with the documented minimal rights) and TLS, in real crawls."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from metrics_scrape import samples, value
from prometheus_client import CollectorRegistry, generate_latest
from support import async_test, crawl_settings, documented_acl_rules, run_crawl, tool

from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.fleet_exporter import FleetCollector
from scrapy_redis_throttle.redis_schema import fleet_key, parked_counts_key, report_key

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

A = HOSTS[0]
# Every script's command in use: a bucket, a fixed window, and a sliding window that refuses the
# third request of three.
RATES = {
    A: [
        "20/s",
        {"rate": "100/m", "algorithm": "fixed_window"},
        {"rate": "2/0.3s", "algorithm": "sliding_window"},
    ]
}
# The same with the parked requests counted too: the third request waits 1 s, parked for half of
# it (RELEASE_AHEAD), while the reports go every 0.1 s.
PARKED_RATES = {A: [*RATES[A][:2], {"rate": "2/s", "algorithm": "sliding_window"}]}
PARKING = {
    "SCHEDULER": "scrapy_redis_throttle.ThrottleScheduler",
    "REDIS_THROTTLE_MAX_HOLD": 0,
    "REDIS_THROTTLE_REPORT_INTERVAL": 0.1,
}


def assert_shared(crawler: Crawler) -> None:
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 5
    assert stats["redis_throttle/redis_calls"] >= 5
    errors = {key: value for key, value in stats.items() if "errors" in key}
    assert errors == {}
    assert "redis_throttle/outages" not in stats


@async_test
async def test_acl_user_with_the_documented_minimal_rights(site: DemoSite) -> None:
    rules = documented_acl_rules()
    with RedisServer(password="admin-secret") as server:
        server.add_user("throttle-worker", "worker-secret", *rules)
        url = f"redis://throttle-worker:worker-secret@127.0.0.1:{server.port}/0"
        crawler = await run_crawl(
            crawl_settings(url, **PARKING),
            [{"url": site.url(A, f"/page/{n}")} for n in range(5)],
            redis_throttle_rates=PARKED_RATES,
        )
        with server.client() as admin:
            # A cold script cache (a restart, a failover) needs SCRIPT LOAD, also allowed.
            admin.script_flush()
        crawler_after_flush = await run_crawl(
            crawl_settings(url, **PARKING),
            [{"url": site.url(A, f"/page/{n}")} for n in range(5, 10)],
            redis_throttle_rates=PARKED_RATES,
        )
        with server.client() as admin:
            parked_counts = admin.exists(parked_counts_key("redis_throttle"))
    assert_shared(crawler)
    assert_shared(crawler_after_flush)
    assert crawler_after_flush.stats.get_value("redis_throttle/parked") >= 1
    assert parked_counts == 0, "every request parked came back: no count left"


# Used only by the listener for other workers' pauses, and by the activity reports: without
# them, the crawl still has Redis.
# +zcard and +zrem: only to count the fleet (fleet.lua), whose refusal the crawl goes on without.
# +ping: only by the check at the start, which then says Redis is unavailable; the first read
# of the fleet's secret, which Redis answers, ends that outage, maybe before any request.
RIGHTS_BESIDE_THE_BUCKETS = {
    "+ping",
    "+subscribe",
    "&redis_throttle:penalties",
    "+del",
    "+hincrby",
    "+hdel",
    "+zcard",
    "+zrem",
}
# Used only to count parked requests.
PARKING_RIGHTS = {"+hincrby", "+hdel"}


@pytest.mark.parametrize("dropped", [rule for rule in documented_acl_rules() if rule[0] in "+~&"])
@async_test
async def test_each_documented_right_is_needed(dropped: str) -> None:
    """Without any one of them the throttle cannot work fully (it says why; it falls back when
    it cannot acquire). The crawl gets a 429, so that the penalty's rights are used too."""
    rules = [rule for rule in documented_acl_rules() if rule != dropped]
    errors = {(A, "/page/0"): [(429, {"Retry-After": "0"})]}
    with (
        RedisServer(password="admin-secret") as server,
        DemoSite(HOSTS, pages=5, errors=errors) as site,
    ):
        server.add_user("throttle-worker", "worker-secret", *rules)
        url = f"redis://throttle-worker:worker-secret@127.0.0.1:{server.port}/0"
        parking = dropped in PARKING_RIGHTS
        crawler = await run_crawl(
            crawl_settings(
                url,
                REDIS_THROTTLE_PROBE_INTERVAL=0.1,
                # One worker alone: it paces locally though it may never read the fleet's size.
                REDIS_THROTTLE_FALLBACK_WORKERS=1,
                **(PARKING if parking else {}),
            ),
            [{"url": site.url(A, f"/page/{n}")} for n in range(3)],
            redis_throttle_rates=PARKED_RATES if parking else RATES,
        )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 3
    # NoPermissionError, or a ResponseError for a command inside the script.
    error_stats = tuple(
        f"redis_throttle/{errors}_errors/" for errors in ("redis", "listener", "activity")
    )
    assert sum(v for k, v in stats.items() if k.startswith(error_stats)) >= 1
    if dropped not in RIGHTS_BESIDE_THE_BUCKETS:
        assert stats["redis_throttle/fallback/local"] >= 1


@async_test
async def test_a_worker_that_may_not_count_itself_in_the_fleet_says_so_and_knows_no_share(
    site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL user of older docs, without ``+zcard`` (fleet.lua): the crawl is shared as
    usual, but the worker cannot know its share of the rates for an outage; it says so once,
    and under the "local" policy would wait for Redis rather than pace on a guess."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    rules = [rule for rule in documented_acl_rules() if rule != "+zcard"]
    with RedisServer(password="admin-secret") as server:
        server.add_user("throttle-worker", "worker-secret", *rules)
        url = f"redis://throttle-worker:worker-secret@127.0.0.1:{server.port}/0"
        crawler = await run_crawl(
            crawl_settings(url, REDIS_THROTTLE_REPORT_INTERVAL=0.1),
            [{"url": site.url(A, f"/page/{n}")} for n in range(5)],
            redis_throttle_rates={A: "10/s"},
        )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 5
    assert stats["redis_throttle/requests"] == 5, "shared as usual"
    assert "redis_throttle/outages" not in stats
    assert "redis_throttle/fleet_size" not in stats
    refused = sum(v for k, v in stats.items() if k.startswith("redis_throttle/activity_errors/"))
    assert refused >= 2, "it tried again"
    refusals = [r for r in caplog.records if "refused to count this worker" in r.getMessage()]
    assert len(refusals) == 1, "said once"
    assert crawler.spider is not None
    middleware = next(
        m
        for m in crawler.engine.downloader.middleware.middlewares
        if type(m).__name__ == "RedisThrottleMiddleware"
    )
    assert middleware.throttle.bucket.fallback.workers() is None


@async_test
async def test_password_in_the_url(site: DemoSite) -> None:
    with RedisServer(password="s3cret") as server:
        crawler = await run_crawl(
            crawl_settings(f"redis://:s3cret@127.0.0.1:{server.port}/0"),
            [{"url": site.url(A, f"/page/{n}")} for n in range(5)],
            redis_throttle_rates={A: "20/s"},
        )
    assert_shared(crawler)


@async_test
async def test_wrong_password_is_reported_and_the_crawl_goes_on(
    site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    with RedisServer(password="s3cret") as server:
        crawler = await run_crawl(
            # One worker alone: it paces locally though it never read the fleet's size.
            crawl_settings(
                f"redis://:wrong@127.0.0.1:{server.port}/0", REDIS_THROTTLE_FALLBACK_WORKERS=1
            ),
            [{"url": site.url(A, f"/page/{n}")} for n in range(5)],
            redis_throttle_rates={A: "20/s"},
        )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 5
    assert stats["redis_throttle/redis_errors/AuthenticationError"] >= 1
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "do not share one" not in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert "redis://:***@127.0.0.1" in warnings[0]
    assert "AuthenticationError" in warnings[0]
    assert "wrong" not in warnings[0]


@async_test
async def test_tls(site: DemoSite) -> None:
    with RedisServer(tls=True) as server:
        assert server.url.startswith("rediss://")
        crawler = await run_crawl(
            crawl_settings(server.url, REDIS_THROTTLE_PARAMS={"ssl_ca_certs": server.ca_file}),
            [{"url": site.url(A, f"/page/{n}")} for n in range(5)],
            redis_throttle_rates={A: "20/s"},
        )
    assert_shared(crawler)


def test_the_documented_monitoring_user_reads_the_fleet() -> None:
    """``status`` and the exporter with the read-only user of the docs: they read everything
    (a worker's report, a live limit, the fleet), and it may change nothing."""
    with RedisServer(password="admin-secret") as server:
        server.add_user(
            "throttle-monitor", "monitor-secret", *documented_acl_rules("throttle-monitor")
        )
        with server.client() as admin:
            control = LiveControl(admin, "redis_throttle")
            control.set(A, 3, None)
            admin.set(report_key("redis_throttle", "w1"), json.dumps({A: [12, 2]}))
            admin.zadd(fleet_key("redis_throttle"), {"w1": 2**52})
        url = f"redis://throttle-monitor:monitor-secret@127.0.0.1:{server.port}/0"
        done = tool("--redis-url", url, "status", "--json")
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["workers"] == 1
        rows = [(row["domain"], row["last_minute"], row["limit"]) for row in status["domains"]]
        assert rows == [(A, 12, "3/s (workers' burst)")]
        with redis.Redis.from_url(url) as monitor:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(FleetCollector(LiveControl(monitor, "redis_throttle"), 10, print))
            found = samples(generate_latest(registry).decode())
            with pytest.raises(redis.exceptions.NoPermissionError):
                LiveControl(monitor, "redis_throttle").set(A, 1, None)
    assert value(found, "scrapy_redis_throttle_exporter_redis_up") == 1
    assert value(found, "scrapy_redis_throttle_fleet_workers") == 1
    assert value(found, "scrapy_redis_throttle_achieved_rate", domain=A) == 12 / 60
    assert value(found, "scrapy_redis_throttle_live_rate", domain=A) == 3
