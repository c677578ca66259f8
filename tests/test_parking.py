"""Parking: requests that must wait long leave the downloader, so slow domains starve no one,
whatever the scheduler (Scrapy's, scrapy-redis's, a subclass of either, or this package's)."""

from __future__ import annotations

import logging
import pickle
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from scrapy import Request, signals
from scrapy.exceptions import IgnoreRequest
from scrapy_redis.scheduler import Scheduler as ScrapyRedisScheduler
from support import achieved_rate, assert_paced, async_test, crawl_settings, run_crawl

from scrapy_redis_throttle.parking import TICKET_META
from scrapy_redis_throttle.scripts import load_script

SLOW, FREE, _ = HOSTS
SCRAPY_REDIS = {
    "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
    "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
}


class SubclassedScheduler(ScrapyRedisScheduler):  # type: ignore[misc]
    """A project's own scheduler."""

    def next_request(self) -> Any:
        return super().next_request()


SCHEDULERS = {
    "scrapy": {"SCHEDULER": "scrapy.core.scheduler.Scheduler"},
    "scrapy-0.1-alias": {"SCHEDULER": "scrapy_redis_throttle.ThrottleScheduler"},
    "scrapy-redis-priority": SCRAPY_REDIS,
    "scrapy-redis-0.1-alias": {
        **SCRAPY_REDIS,
        "SCHEDULER": "scrapy_redis_throttle.RedisThrottleScheduler",
    },
    "scrapy-redis-subclass": {**SCRAPY_REDIS, "SCHEDULER": f"{__name__}.SubclassedScheduler"},
    "scrapy-redis-fifo": {**SCRAPY_REDIS, "SCHEDULER_QUEUE_CLASS": "scrapy_redis.queue.FifoQueue"},
    "scrapy-redis-lifo": {**SCRAPY_REDIS, "SCHEDULER_QUEUE_CLASS": "scrapy_redis.queue.LifoQueue"},
}


def requests(site: DemoSite, host: str, count: int) -> list[dict[str, Any]]:
    return [{"url": site.url(host, f"/page/{n}")} for n in range(count)]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@async_test
async def test_a_slow_domain_does_not_starve_the_others(
    redis_server: RedisServer, site: DemoSite, scheduler: str
) -> None:
    """The measured scenario: 4 concurrent requests, one domain at one request per 3 s."""
    crawler = await run_crawl(
        crawl_settings(
            redis_server.url, CONCURRENT_REQUESTS=4, REDIS_THROTTLE_DEFAULT_RATE=None,
            **SCHEDULERS[scheduler],
        ),
        requests(site, SLOW, 4) + requests(site, FREE, 40),
        redis_throttle_rates={SLOW: "1/3s"},
    )  # fmt: skip

    slow = sorted(a.time for a in site.arrivals(SLOW))
    free = sorted(a.time for a in site.arrivals(FREE))
    # Every free request went before the slow domain's second token (3 s in): nothing held
    # the 4 download slots meanwhile.
    assert free[-1] < slow[1], f"the free domain finished {free[-1] - slow[1]:.2f} s after"
    for host, count in ((SLOW, 4), (FREE, 40)):
        paths = Counter(a.path for a in site.arrivals(host))
        assert sorted(paths) == sorted(f"/page/{n}" for n in range(count)), f"{host}: lost"
        assert max(paths.values()) == 1, f"{host}: fetched twice"
    assert_paced(slow, rate=1 / 3, burst=1, what=SLOW)
    assert achieved_rate(slow, burst=1) >= 0.9 / 3
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/park_requests"] == 3
    assert stats["redis_throttle/parked"] == 3
    assert stats["redis_throttle/requests"] == 4
    assert stats["redis_throttle/redis_calls"] == 4, "one call per request: tokens reserved"
    assert "redis_throttle/missed_moments" not in stats
    assert "redis_throttle/parked_not_crawled" not in stats, "nothing left parked at the close"


@async_test
async def test_redis_parked_requests_survive_the_close_for_the_next_run(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    settings = crawl_settings(redis_server.url, SCHEDULER_PERSIST=True, **SCRAPY_REDIS)
    started = time.monotonic()
    await run_crawl(
        {**settings, "CLOSESPIDER_TIMEOUT": 2},
        requests(site, SLOW, 3),
        redis_throttle_rates={SLOW: "1/30s"},
    )
    took = time.monotonic() - started
    assert took < 2 + 2, f"a 30 s wait delayed the close: the crawl took {took:.1f} s"

    assert len(site.arrivals(SLOW)) == 1
    with redis_server.client() as client:
        members = client.zrange("url_list:requests:parked", 0, -1)
        parked = [pickle.loads(member[16:]) for member in members]  # Request.to_dict() output
        assert len(parked) == 2, "both waiting requests are still in Redis"
        assert {r["url"] for r in parked} | {site.url(SLOW, site.arrivals(SLOW)[0].path)} == {
            site.url(SLOW, f"/page/{n}") for n in range(3)
        }
        assert all(r["meta"][TICKET_META][0] is True for r in parked), "reserved, in the meta"
        assert all(len(r["meta"][TICKET_META]) == 5 for r in parked)
        assert any(
            "2 parked requests are kept for the next run" in r.getMessage() for r in caplog.records
        )
        # As if the next run started a minute later: they are due, their reservations passed.
        client.zadd("url_list:requests:parked", dict.fromkeys(members, 0))
        client.delete(f"redis_throttle:{{{SLOW}}}")

    crawler = await run_crawl(settings, [], redis_throttle_rates={SLOW: "2/s"})
    assert sorted(a.path for a in site.arrivals(SLOW)) == [f"/page/{n}" for n in range(3)]
    assert crawler.stats.get_value("redis_throttle/requests") == 2
    assert crawler.stats.get_value("redis_throttle/missed_moments") == 2
    assert_paced([a.time for a in site.arrivals(SLOW)][1:], rate=2, burst=1, what=SLOW)
    with redis_server.client() as client:
        assert client.keys("*:parked") == []


@pytest.mark.parametrize("scheduler", ["scrapy", "scrapy-redis-priority"])
@async_test
async def test_parked_requests_not_kept_are_counted_and_logged(
    redis_server: RedisServer, site: DemoSite, scheduler: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    started = time.monotonic()
    crawler = await run_crawl(
        crawl_settings(redis_server.url, CLOSESPIDER_TIMEOUT=2, **SCHEDULERS[scheduler]),
        requests(site, SLOW, 3),
        redis_throttle_rates={SLOW: "1/30s"},
    )
    took = time.monotonic() - started
    assert took < 2 + 2, f"a 30 s wait delayed the close: the crawl took {took:.1f} s"
    assert len(site.arrivals(SLOW)) == 1
    assert crawler.stats.get_value("redis_throttle/parked_not_crawled") == 2
    assert any("2 parked requests were not crawled" in r.getMessage() for r in caplog.records)
    if scheduler != "scrapy":
        with redis_server.client() as client:
            assert client.exists("url_list:requests:parked") == 0, "dropped from Redis"


@async_test
async def test_jobdir_keeps_parked_requests_for_the_next_run(
    redis_server: RedisServer, site: DemoSite, tmp_path: Path
) -> None:
    settings = crawl_settings(redis_server.url, JOBDIR=str(tmp_path), **SCHEDULERS["scrapy"])
    first = await run_crawl(
        {**settings, "CLOSESPIDER_TIMEOUT": 2},
        requests(site, SLOW, 3),
        redis_throttle_rates={SLOW: "1/30s"},
    )
    assert len(site.arrivals(SLOW)) == 1
    assert "redis_throttle/parked_not_crawled" not in first.stats.get_stats()
    with redis_server.client() as client:  # as if the next run started a minute later
        client.delete(f"redis_throttle:{{{SLOW}}}")

    await run_crawl(settings, [], redis_throttle_rates={SLOW: "2/s"})
    assert sorted(a.path for a in site.arrivals(SLOW)) == [f"/page/{n}" for n in range(3)]


def test_parked_requests_come_back_from_a_redis_out_of_memory(redis_server: RedisServer) -> None:
    """unpark.lua only removes: a Redis out of memory (noeviction) still lets it run, as it
    lets scrapy-redis pop its queue, while it refuses new parks."""
    key = "shop:requests:parked"
    with redis_server.client() as client:
        assert client.eval(load_script("park.lua"), 1, key, "0", b"request") == 1
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")  # below what is used already: out of memory
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.eval(load_script("park.lua"), 1, key, "0", b"another")
            reply = client.eval(load_script("unpark.lua"), 1, key, "0", "10")
        finally:
            client.config_set("maxmemory", "0")
    assert reply[0] == 0, "none left"
    assert reply[2] == b"request"


@async_test
async def test_a_request_dropped_on_its_way_back_from_parking_is_counted_and_ends_nothing(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """A request_scheduled handler may drop (IgnoreRequest) a request the parking area gives
    back: it is counted and logged, and the crawl still ends when nothing else is left."""
    dropped = site.url(SLOW, "/page/1")
    scheduled: Counter[str] = Counter()

    def drop_on_the_way_back(request: Request, **_: Any) -> None:
        scheduled[request.url] += 1
        # Scheduled at the start, to be parked, and given back: the third time.
        if request.url == dropped and scheduled[request.url] == 3:
            raise IgnoreRequest("dropped on its way back")

    started = time.monotonic()
    crawler = await run_crawl(
        crawl_settings(redis_server.url),
        requests(site, SLOW, 2),
        {signals.request_scheduled: drop_on_the_way_back},
        redis_throttle_rates={SLOW: "1/2s"},
    )
    took = time.monotonic() - started

    stats = crawler.stats.get_stats()
    assert scheduled[dropped] == 3
    assert stats["redis_throttle/parked"] == 1
    assert stats["redis_throttle/parked_dropped"] == 1
    assert [a.path for a in site.arrivals(SLOW)] == ["/page/0"]
    assert stats["finish_reason"] == "finished"
    assert took < 10, f"the crawl took {took:.1f} s to end"
    assert any("back from the parking area, was dropped" in r.getMessage() for r in caplog.records)


@async_test
async def test_a_request_whose_park_failed_waits_in_the_downloader_not_parked_again(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """A park that fails (here the parked requests' key holds a string: WRONGTYPE) leaves the
    request in the downloader until its moment, once: parked again, it would fail again, and
    again, as fast as the engine turns."""

    def break_parking(**_: Any) -> None:
        with redis_server.client() as client:
            if not client.exists("url_list:requests:parked"):
                client.set("url_list:requests:parked", "not a sorted set")

    # After the start, when the parking area is attached; before the first park.
    crawler = await run_crawl(
        crawl_settings(redis_server.url, **SCRAPY_REDIS),
        requests(site, SLOW, 3),
        {signals.request_scheduled: break_parking},
        redis_throttle_rates={SLOW: "1/2s"},
    )

    stats = crawler.stats.get_stats()
    failures = [r for r in caplog.records if "could not park" in r.getMessage()]
    assert stats["redis_throttle/park_requests"] == 2
    assert len(failures) == 2, [r.getMessage() for r in failures]
    assert "redis_throttle/parked" not in stats
    assert sorted(a.path for a in site.arrivals(SLOW)) == [f"/page/{n}" for n in range(3)]
    assert_paced([a.time for a in site.arrivals(SLOW)], rate=0.5, burst=1, what=SLOW)
