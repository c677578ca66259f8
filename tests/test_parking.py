"""Parking: requests that must wait long leave the downloader, so slow domains starve no one,
whatever the scheduler (Scrapy's, scrapy-redis's, a subclass of either, or this package's)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from scrapy import Request, signals
from scrapy.crawler import CrawlerRunner
from scrapy.exceptions import IgnoreRequest
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.test import get_crawler
from scrapy_redis.scheduler import Scheduler as ScrapyRedisScheduler
from spiders import UrlListSpider
from support import (
    SCRAPY_REDIS,
    achieved_rate,
    assert_never_early,
    assert_paced,
    assert_released_paced,
    async_test,
    crawl_settings,
    missed_moments,
    parked_member,
    redis_now_us,
    released,
    run_crawl,
    wait_until_async,
)
from tcp_proxy import TcpProxy

from scrapy_redis_throttle.clock import Clock
from scrapy_redis_throttle.connection import connect_url
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.parking_stores import MemoryParking
from scrapy_redis_throttle.pauses import Pause
from scrapy_redis_throttle.redis_parking import ParkUncertain, RedisParking, read_member
from scrapy_redis_throttle.redis_schema import EPOCH
from scrapy_redis_throttle.rejections import Rejections
from scrapy_redis_throttle.replies import Reservation
from scrapy_redis_throttle.scripts import load_script
from scrapy_redis_throttle.server_clock import ServerClock
from scrapy_redis_throttle.tickets import MOMENT_AGREES, TICKET_META, Ticket

SLOW, FREE, _ = HOSTS


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
    stats = crawler.stats.get_stats()
    assert_released_paced(stats, site.arrivals(SLOW), 1 / 3, 1, SLOW)
    assert achieved_rate(slow, 1, missed_moments(stats, SLOW)) >= 0.9 / 3
    # A request whose moment a busy worker missed asks anew, and waits parked again (seen
    # with two test suites side by side on 2 cores); with none missed, one call per request.
    missed = stats.get("redis_throttle/missed_moments", 0)
    assert stats["redis_throttle/park_requests"] == 3 + missed
    assert stats["redis_throttle/parked"] == 3 + missed
    assert stats["redis_throttle/requests"] == 4
    assert stats["redis_throttle/redis_calls"] == 4 + missed, "tokens reserved in the call"
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
        read = [read_member(member) for member in members]
        assert [(flag, key) for flag, key, _ in read] == [(b"r", SLOW)] * 2, "reserved moments"
        assert client.zcard("url_list:requests:parked:moments") == 2, "indexed by moment"
        parked = [json.loads(encoded) for _, _, encoded in read]  # Request.to_dict(), as JSON
        assert len(parked) == 2, "both waiting requests are still in Redis"
        assert {r["url"] for r in parked} | {site.url(SLOW, site.arrivals(SLOW)[0].path)} == {
            site.url(SLOW, f"/page/{n}") for n in range(3)
        }
        assert all(r["meta"][TICKET_META][0] is True for r in parked), "reserved, in the meta"
        # With the moments Redis gave them, by its clock: 30 and 60 s after the first request's.
        now_us = redis_now_us(client)
        moments = sorted(r["meta"][TICKET_META][5] for r in parked)
        assert [round((moment - now_us) / 30e6) for moment in moments] == [1, 2], moments
        assert moments[1] - moments[0] == pytest.approx(30e6, abs=1)
        assert any(
            "2 parked requests are kept for the next run" in r.getMessage() for r in caplog.records
        )
        # As if the next run started a minute later: they are due, their reservations passed
        # (each due at 0, in the index of moments too: "<length><key><due><reserved_at><id>").
        client.zadd("url_list:requests:parked", dict.fromkeys(members, 0))
        due_at = slice(5 + len(SLOW), 5 + len(SLOW) + 17)
        for entry in client.zrange("url_list:requests:parked:moments", 0, -1):
            client.zrem("url_list:requests:parked:moments", entry)
            overdue = entry[: due_at.start] + b"0" * 17 + entry[due_at.stop :]
            client.zadd("url_list:requests:parked:moments", {overdue: 0})
        client.delete(f"redis_throttle:{{{SLOW}}}")

    crawler = await run_crawl(settings, [], redis_throttle_rates={SLOW: "2/s"})
    assert sorted(a.path for a in site.arrivals(SLOW)) == [f"/page/{n}" for n in range(3)]
    assert crawler.stats.get_value("redis_throttle/requests") == 2
    assert crawler.stats.get_value("redis_throttle/missed_moments") == 2
    # The first page went in the first run.
    assert_released_paced(crawler.stats.get_stats(), site.arrivals(SLOW)[1:], 2, 1, SLOW)
    with redis_server.client() as client:
        assert client.keys("*:parked*") == [], "neither requests nor their moments are left"


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
    # Their moments, 30 and 60 s after the first request's, are given back: the bucket is as
    # the first request left it, and a crawl started now waits no longer than it would have.
    assert crawler.stats.get_value("redis_throttle/unreserved") == 2
    assert any(
        "of 2 moments reserved for requests that will not go at them, 2 were given back"
        in r.getMessage()
        for r in caplog.records
    )
    with redis_server.client() as client:
        (arrival,) = site.arrivals(SLOW)
        # The bucket's time (Redis's clock, the machine's), from the first request's moment,
        # which came before it reached the site: within the µs the script rounds up.
        full_at = EPOCH + int(client.get(f"redis_throttle:{{{SLOW}}}")) / 1e6
        assert full_at - arrival.wall_time <= 30 + 1e-5, f"full {full_at - arrival.wall_time} s on"
        if scheduler != "scrapy":
            assert client.exists("url_list:requests:parked") == 0, "dropped from Redis"
            assert client.keys("url_list:requests:parked:*") == [], "nor left aside"


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
    keys = ("shop:requests:parked", "shop:requests:parked:moments")
    request, another = parked_member(b"r", SLOW, b"request"), parked_member(b"r", SLOW, b"another")
    with redis_server.client() as client:
        assert client.eval(load_script("park.lua"), 2, *keys, "0", request) == 1
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")  # below what is used already: out of memory
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.eval(load_script("park.lua"), 2, *keys, "0", another)
            before = redis_now_us(client)
            reply = client.eval(load_script("unpark.lua"), 2, *keys, "0", "10")
        finally:
            client.config_set("maxmemory", "0")
        assert client.exists(*keys) == 0, "the request and its moment are gone"
    assert reply[0] == 0, "none left"
    assert reply[2] >= before, "Redis's time, in µs"
    assert reply[3] == request


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
    # Every look for parked requests fails too (WRONGTYPE), for seconds: said once.
    looks = [r.getMessage() for r in caplog.records if "look for parked" in r.getMessage()]
    assert len(looks) == 1, looks
    assert "WRONGTYPE" in looks[0]
    assert "redis_throttle/parked" not in stats
    assert sorted(a.path for a in site.arrivals(SLOW)) == [f"/page/{n}" for n in range(3)]
    assert_released_paced(stats, site.arrivals(SLOW), 0.5, 1, SLOW)


def test_a_voiding_brings_back_the_requests_parked_in_redis_with_moments_it_voids(
    redis_server: RedisServer,
) -> None:
    """void_parked.lua: the requests parked with a reserved moment of the key, up to the
    voiding's end, reserved before it, become due now (in the order of their moments) and
    marked to ask again ("a"); the others keep their moments, and their place in the index. It
    goes in batches, each on from where the last one stopped; a second worker that heard the
    same voiding finds nothing."""
    keys = ("shop:requests:parked", "shop:requests:parked:moments")
    heard = time.time()
    void = [parked_member(b"r", SLOW, b"void %d" % n, heard - 1) for n in range(5)]
    kept = [
        parked_member(b"r", SLOW, b"reserved after the voiding", heard + 0.5),
        parked_member(b"r", SLOW, b"due after its end", heard - 1),
        parked_member(b"r", FREE, b"another key", heard - 1),
        parked_member(b"u", SLOW, b"not reserved", heard - 1),
    ]
    delays = [10, 20, 30, 40, 50, 20, 100, 10, 10]
    with redis_server.client() as client:
        for parked, delay in zip(void + kept, delays, strict=True):
            client.eval(load_script("park.lua"), 2, *keys, repr(delay * 1e6), parked)
        assert client.zcard(keys[1]) == 8, "only the reserved moments are indexed"

        def void_parked(*args: str | bytes) -> list[Any]:
            return client.eval(load_script("void_parked.lua"), 2, *keys, *args)  # type: ignore[no-any-return]

        def voiding() -> tuple[int, int]:
            released, calls, last = 0, 0, b""
            while True:
                reply = void_parked(SLOW, "60000000", b"%d" % (heard * 1e6), last, "2")
                released, calls, last = released + reply[0], calls + 1, reply[1]
                if not last:
                    return released, calls

        # SLOW's 6 moments within 60 s, 2 a call: 2 + 2 + 2 + 0; then 1 is left.
        assert voiding() == (5, 4)
        assert voiding() == (0, 1), "the same voiding, heard by another worker"
        assert client.zcard(keys[1]) == 3
        reply = client.eval(load_script("unpark.lua"), 2, *keys, "0", "100")
        assert reply[3::2] == [b"a" + parked[1:] for parked in void], "in their moments' order"
        assert all(float(due_in) <= 0 for due_in in reply[4::2]), "due now"
        assert client.zcard(keys[0]) == 4
        assert client.zcard(keys[1]) == 3, "the others keep their moments"

        bad_args: list[tuple[str, str, bytes, str]] = [
            ("-1", "0", b"", "2"),
            ("1", "x", b"", "2"),
            ("1", "0", b"0", "0"),
        ]
        # A park whose reply was lost is taken out (unpark.lua's ARGV[3]), even once voided.
        lost = parked_member(b"r", SLOW, b"reply lost", heard - 1)
        client.eval(load_script("park.lua"), 2, *keys, "5000000", lost)
        assert voiding() == (1, 2)
        taken = client.eval(load_script("unpark.lua"), 2, *keys, "0", "1", lost)
        assert taken[3] == b"a" + lost[1:]
        assert client.zcard(keys[0]) == 4
        assert client.zcard(keys[1]) == 3
        for bad in bad_args:
            with pytest.raises(redis.ResponseError, match="void_parked takes"):
                void_parked(SLOW, *bad)
        free = next(entry for entry in client.zrange(keys[1], 0, -1) if FREE.encode() in entry)
        with pytest.raises(redis.ResponseError, match="void_parked takes"):
            void_parked(SLOW, "1", "0", free, "2")  # not SLOW's entry
        with pytest.raises(redis.ResponseError, match="not a parked request"):
            client.eval(load_script("park.lua"), 2, *keys, "0", b"a" + void[0][1:])


def test_a_park_that_waited_its_turn_counts_its_delay_from_when_it_was_asked(
    redis_server: RedisServer,
) -> None:
    """park.lua's ARGV[3], Redis's time when the worker counted the delay from (as late as
    the worker's bounds allow): a call that waited behind others is due that much earlier than its delay
    from now, by 100 ms at most (an estimate far off, a clock stepped, moves it no more);
    never later than from now."""
    keys = ("shop:requests:parked", "shop:requests:parked:moments")
    delay_us = 5_000_000
    with redis_server.client() as client:

        def due_from(asked: float | None) -> tuple[float, float]:
            """The parked request's due less its delay, and the call's length, both from
            Redis's time before the call (µs), with ARGV[3] *asked* from that time."""
            parked = parked_member(b"r", SLOW, b"asked")
            before = redis_now_us(client)
            extra = [] if asked is None else [repr(before + asked)]
            client.eval(load_script("park.lua"), 2, *keys, repr(delay_us), parked, *extra)
            took = redis_now_us(client) - before
            score = client.zscore(keys[0], parked)
            assert score is not None
            return score - delay_us - before, took

        due, took = due_from(None)
        assert 0 <= due <= took, "from Redis's time"
        due, took = due_from(-20_000)
        assert -20_000 <= due <= max(-20_000, took - 100_000), "from the caller's estimate"
        due, took = due_from(-1_000_000)
        assert -100_000 <= due <= took - 100_000, "an estimate far back moves it 100 ms at most"
        due, took = due_from(1_000_000)
        assert 0 <= due <= took, "never from later than Redis's time"
        for bad in ("nan", "inf", "x"):
            with pytest.raises(redis.ResponseError, match="asked must be a finite number"):
                client.eval(
                    load_script("park.lua"), 2, *keys, "0", parked_member(b"r", SLOW, b"bad"), bad
                )


def test_a_member_not_of_park_luas_form_is_refused() -> None:
    """Such as those of versions before the index of moments: a 16-byte id, then a pickle."""
    with pytest.raises(ValueError, match=r"not of the form park\.lua writes"):
        read_member(uuid.uuid4().bytes + b"\x80\x04serialized")
    assert read_member(parked_member(b"r", SLOW, b"{}")) == (b"r", SLOW, b"{}")


def test_tickets_read_back_from_redis_are_parsed_strictly() -> None:
    """A field that is not a time, such as an integer no float holds, or a ticket of another
    shape makes it unreserved (that request asks again), and nothing else fails; so does a
    ticket without the fleet's seal (see test_hostile's)."""
    now = time.time()

    def read(wire: list[Any], sealed: bool = True) -> Ticket:
        return Ticket.from_wire([*wire, "seal"] if len(wire) == 7 else wire, SLOW, 5.0, now, sealed)

    current = read([True, now, "another-process", False, now, 1e15, None])
    assert (current.reserved, current.moment_us, current.elsewhere) == (True, 1e15, True)
    assert read([True, now, "another-process", False, now, 1e15, None], False).reserved is False
    unmoved = read([True, now, "another-process", False, now, None, None])
    assert (unmoved.reserved, unmoved.moment_us) == (True, None)
    for moment in (10**400, float("nan"), "1e15", True):
        hostile = read([True, now, "another-process", False, now, moment, None])
        assert (hostile.reserved, hostile.moment_us, hostile.due) == (False, None, 5.0), moment
    assert read([True, 10**400, "p", False, now, None, None]).reserved is False
    assert read([True, now, "p", False, now]).reserved is False
    # Its reservation, to give back at a close: three whole numbers, the step at most the time
    # after; anything else is none to give back (an error would fail its domain's call).
    fields = [True, now, "p", False, now, 1e15]
    given = read([*fields, [7_000_000, 2_000_000, 4_000_000]])
    assert given.reservation == Reservation(7_000_000, 2_000_000, 4_000_000)
    for reservation in (
        None,
        [7, 8, 1],
        [7, 0, 1],
        [7.5, 2, 1],
        [10**15, 2, 1],
        [7, 2, -1],
        [7, 2, 10**15],
        [True, 1, 1],
        ["7", "2", "1"],
        [7, 2],
        [7, 2, 1, 1],
        {"after": 7},
        [[7], 2, 1],
    ):
        hostile = read([*fields, reservation])
        assert (hostile.reserved, hostile.reservation) == (True, None), reservation
    unreserved = read([False, *fields[1:], [7_000_000, 2_000_000, 1]])
    assert unreserved.reservation is None, "nothing reserved, nothing to give back"


@async_test
async def test_a_parked_request_goes_at_the_moment_redis_gave_it_when_its_due_agrees() -> None:
    """Its moment, by the throttle's Redis's clock, counts unless it is after the due the
    parking area told by over MOMENT_AGREES (a due may be late by any amount); then, or with
    that clock unknown, the due."""
    now = asyncio.get_running_loop().time()
    clock = ServerClock()
    # Redis's clock runs 1,000 s ahead of the loop's; the reply bounds the offset within 1 ms.
    clock.decided_at(now - 0.001, now, (now + 1000) * 1e6)
    moment_us = (now + 1000 + 5) * 1e6  # 5 s from now, by Redis's clock
    exact = clock.loop_time(moment_us)
    assert exact == pytest.approx(now + 5, abs=0.002)

    def ticket(due: float, moment: float | None = moment_us) -> Ticket:
        return Ticket(
            domain=SLOW,
            due=due,
            reserved=True,
            locally=False,
            reserved_at=0.0,
            waiting_since=0.0,
            elsewhere=True,
            moment_us=moment,
        )

    assert ticket(now + 5.08).moment(clock) == exact, "a due read late: the moment counts"
    assert ticket(now + 4.9).moment(clock) == exact, "a due counted early: the moment counts"
    late = now + 5 + 2 * MOMENT_AGREES
    assert ticket(late).moment(clock) == exact, "a park that waited: the moment counts"
    assert ticket(now + 6.1).moment(clock) == exact, "however late the due"
    assert ticket(now + 4).moment(clock) == now + 4, "a moment far after the due: not Redis's"
    assert ticket(now + 5.08, moment=None).moment(clock) == now + 5.08
    assert ticket(now + 5.08).moment(ServerClock()) == now + 5.08, "Redis's clock unknown"


@async_test
async def test_a_voiding_brings_back_the_requests_parked_in_memory_with_moments_it_voids() -> None:
    """As above, in this process (any scheduler but scrapy-redis's)."""
    store = MemoryParking(keep_into=None, clock=Clock())
    now, heard = asyncio.get_running_loop().time(), time.time()
    parks = [
        *((f"void-{n}", SLOW, 10 * n + 10, True, heard - 1) for n in range(5)),
        ("reserved-after", SLOW, 20, True, heard + 0.5),
        ("due-after-its-end", SLOW, 100, True, heard - 1),
        ("another-key", FREE, 10, True, heard - 1),
        ("not-reserved", SLOW, 10, False, heard - 1),
    ]
    for path, key, delay, reserved, reserved_at in parks:
        ticket = Ticket(
            domain=key,
            due=now + delay,
            reserved=reserved,
            locally=False,
            reserved_at=reserved_at,
            waiting_since=reserved_at,
        )
        await store.park(Request(f"http://{key}/{path}"), ticket)

    assert await store.release_voided(SLOW, Pause(heard, now + 60)) == 5
    assert await store.release_voided(SLOW, Pause(heard, now + 60)) == 0
    due, next_due = await store.unpark(0, 100)
    assert [request.url for request, _ in due] == [f"http://{SLOW}/void-{n}" for n in range(5)]
    assert all(not ticket.reserved and ticket.due <= now + 1 for _, ticket in due)
    assert next_due is not None
    assert 9 < next_due <= 10
    assert store.parked == 4


@pytest.mark.parametrize("scheduler", ["scrapy", "scrapy-redis-priority"])
@async_test
async def test_a_limit_raised_live_brings_parked_requests_back_at_once(
    redis_server: RedisServer, site: DemoSite, scheduler: str
) -> None:
    """A limit changed live voids the moments reserved before: the requests parked with them
    come back and ask again at once, as held ones do, instead of waiting for their old moments
    (here 10 to 50 s away) to learn it."""
    runner = CrawlerRunner(crawl_settings(redis_server.url, **SCHEDULERS[scheduler]))
    crawler = runner.create_crawler(UrlListSpider)
    crawl = runner.crawl(
        crawler, requests=requests(site, SLOW, 6), redis_throttle_rates={SLOW: "1/10s"}
    )
    stats = crawler.stats
    try:
        await wait_until_async(
            lambda: stats.get_value("redis_throttle/parked", 0) == 5, "5 requests parked"
        )
        with redis_server.client() as client:
            LiveControl(client, "redis_throttle").set(SLOW, 20, 1)
        await wait_until_async(
            lambda: len(site.arrivals(SLOW)) == 6,
            "the parked requests back before their old moments",
            timeout=9,
        )
    except BaseException:
        await crawler.stop_async()  # not 50 s more into the next test
        raise
    await maybe_deferred_to_future(crawl)
    assert stats.get_value("redis_throttle/paused_reservations") == 5
    # The first went at 1/10s, the others at 20/s.
    went = released(stats.get_stats(), SLOW)
    assert_paced(went[1:], rate=20, burst=1, what=f"{SLOW}, as released")
    assert_never_early([a.wall_time for a in site.arrivals(SLOW)], went, SLOW)


@async_test
async def test_a_park_whose_reply_is_lost_and_whose_request_is_gone_is_uncertain(
    redis_server: RedisServer,
) -> None:
    """A park ran in Redis, its reply lost: the request is taken back out if it is still
    there (kept by its worker, it goes at its moment). If it is gone (another worker took it,
    or a close dropped it and gave its moment back), the park is uncertain: its worker keeps it
    but asks anew, never going at a moment that may be another's."""
    stats = MemoryStatsCollector(get_crawler())
    spider = UrlListSpider()
    with TcpProxy(redis_server.port) as proxy:
        store = RedisParking(
            connect_url(proxy.url, {"socket_timeout": 0.5}, 1),
            "lost:parked",
            spider,
            Rejections(stats, dict),
            Clock(),
        )
        now = time.time()
        ticket = Ticket(
            domain=SLOW,
            due=asyncio.get_running_loop().time() + 60,
            reserved=True,
            locally=False,
            reserved_at=now,
            waiting_since=now,
        )
        try:
            await store.park(Request(f"http://{SLOW}/page/0"), ticket)  # (Redis's clock known)
            proxy.lose_replies(True)
            with redis_server.client() as client:
                client.delete("lost:parked")
                taker = asyncio.ensure_future(
                    wait_until_async(lambda: client.zpopmin("lost:parked"), "the park to run")
                )
                with pytest.raises(ParkUncertain):
                    await store.park(Request(f"http://{SLOW}/page/1"), ticket)
                await taker
            proxy.lose_replies(False)
            await store.park(Request(f"http://{SLOW}/page/2"), ticket)  # (a new connection)
            proxy.lose_replies(True)
            with redis_server.client() as client:
                # Parked, its reply lost: the replies come back for what follows.
                back = asyncio.ensure_future(
                    wait_until_async(lambda: client.zcard("lost:parked") == 2, "the park to run")
                )
                back.add_done_callback(lambda _: proxy.lose_replies(False))
                with pytest.raises(redis.exceptions.TimeoutError) as lost:
                    await store.park(Request(f"http://{SLOW}/page/3"), ticket)
                await back
            assert not isinstance(lost.value, ParkUncertain), "taken back out: certain"
            with redis_server.client() as client:
                paths = [
                    json.loads(read_member(m)[2])["url"]
                    for m in client.zrange("lost:parked", 0, -1)
                ]
        finally:
            proxy.lose_replies(False)
            await store.close(keep=False)
    assert paths == [f"http://{SLOW}/page/2"]
