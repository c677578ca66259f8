"""429/503 pause a domain for the whole fleet: the penalty script, Retry-After, real crawls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from redis_topologies import Topology, throttle_settings
from scrapy.crawler import Crawler, CrawlerRunner
from scrapy.settings import Settings
from scrapy.utils.defer import maybe_deferred_to_future
from spiders import UrlListSpider
from support import (
    assert_released_paced,
    async_test,
    crawl_settings,
    documented_acl_rules,
    finish_crawl_workers,
    listening_pauses,
    one_domain_jobs,
    pages,
    redis_now_us,
    released,
    run_crawl,
    start_crawl_workers,
    token_bucket,
    wait_until_async,
)

from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.config import Backoff, ThrottleConfig
from scrapy_redis_throttle.connection import close, connect
from scrapy_redis_throttle.pauses import parse_retry_after
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.redis_schema import bucket_key, penalty_channel, penalty_key
from scrapy_redis_throttle.replies import Voiding

A, B, C = HOSTS
LIMIT = Limit(5, 2, "5/s")
BACKOFF = Backoff(first=1.0, longest=600.0, decay=60.0)


@pytest.mark.parametrize(
    ("value", "date", "expected"),
    [
        (b"5", None, 5.0),
        (b" 120 ", None, 120.0),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", b"Wed, 21 Oct 2015 07:27:50 GMT", 10.0),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", None, 0.0),  # long past by our clock
        (b"Wed, 21 Oct 2015 07:28:00 GMT", b"Wed, 21 Oct 2015 07:29:00 GMT", 0.0),
        (b"", None, None),
        (None, None, None),
    ],
)
def test_retry_after_seconds_or_http_date(
    value: bytes | None, date: bytes | None, expected: float | None
) -> None:
    assert parse_retry_after(value, date, time.time()) == expected


@async_test
async def test_a_pause_holds_back_every_acquire_until_it_ends(redis_server: RedisServer) -> None:
    async with token_bucket(redis_server) as bucket:
        assert (await bucket.acquire("shop.example", LIMIT)).allowed
        penalty = await bucket.penalize("shop.example", LIMIT, 5.0, BACKOFF)
        assert (penalty.changed, penalty.strikes) == (True, 1)
        assert 4.99 < penalty.pause <= 5.0
        refused = await bucket.acquire("shop.example", LIMIT)
        assert not refused.allowed
        # Not before the pause ends, and no burst at its end: one token then, as at the rate.
        assert 4.9 < refused.retry_after <= 5.0
        reserved = await bucket.acquire("shop.example", LIMIT, reserve=10)
        assert reserved.reserved
        assert 4.9 < reserved.retry_after <= 5.0
        second = await bucket.acquire("shop.example", LIMIT, reserve=10)
        assert 5.1 < second.retry_after <= 5.2, "then at the rate: 0.2 s later"
    with redis_server.client() as client:
        assert 4_900 < client.pttl(penalty_key("ns", "shop.example")) <= 65_000
        assert 5_000 < client.pttl(bucket_key("ns", "shop.example")) <= 5_600


@async_test
async def test_answers_to_requests_sent_before_the_pause_do_not_add_to_it(
    redis_server: RedisServer,
) -> None:
    async with token_bucket(redis_server) as bucket:
        first = await bucket.penalize("shop.example", LIMIT, None, BACKOFF)
        assert (first.changed, first.strikes) == (True, 1)
        assert 0.99 < first.pause <= 1.0  # the first backoff
        again = await bucket.penalize("shop.example", LIMIT, None, BACKOFF)
        assert (again.changed, again.strikes) == (False, 1)
        assert again.pause <= first.pause
        shorter = await bucket.penalize("shop.example", LIMIT, 0.5, BACKOFF)
        assert not shorter.changed
        longer = await bucket.penalize("shop.example", LIMIT, 3.0, BACKOFF)
        assert (longer.changed, longer.strikes) == (True, 1), "a longer Retry-After extends it"
        assert 2.99 < longer.pause <= 3.0
        capped = await bucket.penalize("shop.example", LIMIT, 10_000.0, BACKOFF)
        assert 599 < capped.pause <= 600, "REDIS_THROTTLE_MAX_PAUSE"


@pytest.mark.parametrize("burst", [1, 3])
@async_test
async def test_a_retry_after_of_zero_is_a_pause_of_no_time(
    redis_server: RedisServer, burst: int
) -> None:
    """Real sites send ``Retry-After: 0`` (and dates already past): on an idle domain it must
    neither fail the script (Redis refuses an expiry of 0, which would open the breaker as if
    Redis were down) nor hold the domain back."""
    limit = Limit(5, burst, "5/s")
    async with token_bucket(redis_server) as bucket:
        penalty = await bucket.penalize("shop.example", limit, 0.0, BACKOFF)
        assert (penalty.changed, penalty.pause) == (True, 0.0)
        assert (await bucket.acquire("shop.example", limit)).allowed


def set_penalty_state(server: RedisServer, strikes: int, ended_ago: float) -> None:
    """As if *strikes* penalties in a row had been taken, the last pause ended *ended_ago* s ago."""
    with server.client() as client:
        now = redis_now_us(client)
        client.hset(
            penalty_key("ns", "shop.example"),
            mapping={"strikes": strikes, "until": int(now - ended_ago * 1e6)},
        )


@pytest.mark.parametrize(
    ("strikes", "ended_ago", "expected_strikes"),
    [
        (1, 1.0, 2),  # soon after the last pause: twice as long
        (3, 1.0, 4),  # 8 s
        (3, 61.0, 3),  # one decay later: one doubling undone, then this one
        (3, 3 * 60 + 1.0, 1),  # three decays: back to the first backoff
        (9, 1.0, 10),  # 512 s, capped at 600 only above
    ],
)
@async_test
async def test_backoff_doubles_and_decays(
    redis_server: RedisServer, strikes: int, ended_ago: float, expected_strikes: int
) -> None:
    set_penalty_state(redis_server, strikes, ended_ago)
    async with token_bucket(redis_server) as bucket:
        penalty = await bucket.penalize("shop.example", LIMIT, None, BACKOFF)
    assert penalty.strikes == expected_strikes
    expected = min(600, BACKOFF.first * 2 ** (expected_strikes - 1))
    assert expected - 0.01 < penalty.pause <= expected


@async_test
async def test_a_pause_is_published_for_the_fleet(redis_server: RedisServer) -> None:
    with redis_server.client() as client, client.pubsub() as sub:
        sub.subscribe(penalty_channel("ns"))
        assert sub.get_message(timeout=5)["type"] == "subscribe"
        async with token_bucket(redis_server) as bucket:
            await bucket.penalize("Odd key {x}", LIMIT, 2.0, BACKOFF)
        message = sub.get_message(timeout=5)
    assert message is not None, "no message within 5 s"
    assert message["type"] == "message"
    pause_us, at_us, key = message["data"].decode().split(" ", 2)
    assert key == "Odd key {x}"
    assert 1_990_000 < int(pause_us) <= 2_000_000
    assert 0 < int(at_us) < 10**15, "when, by Redis's clock (µs since the scripts' epoch)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["0", "1", "-1", "1", "1", "1", "c", "k"],
            "argument 1 must be a finite number > 0, got 0",
        ),
        (
            ["1", "0", "-1", "1", "1", "1", "c", "k"],
            "argument 2 must be a finite number >= 1, got 0",
        ),
        (
            ["1", "1", "-2", "1", "1", "1", "c", "k"],
            "argument 3 must be a finite number >= -1, got -2",
        ),
        (
            ["1", "1", "-1", "nan", "1", "1", "c", "k"],
            "argument 4 must be a finite number > 0, got nan",
        ),
        (
            ["1", "1", "-1", "1", "inf", "1", "c", "k"],
            "argument 5 must be a finite number > 0, got inf",
        ),
        (
            ["1", "1", "-1", "1", "1", "x", "c", "k"],
            "argument 6 must be a finite number > 0, got x",
        ),
    ],
)
def test_penalty_script_validates_its_arguments(
    redis_server: RedisServer, args: list[str], message: str
) -> None:
    from scrapy_redis_throttle.scripts import load_script

    with redis_server.client() as client:
        script = client.register_script(load_script("penalty.lua"))
        with pytest.raises(redis.ResponseError, match=message):
            script(keys=["ns:{k}", "ns:{k}:penalty"], args=args)
        assert client.keys("*") == []


def gaps_after(times: list[float], moment: float) -> float:
    """Seconds from *moment* to the first of *times* after it."""
    return min(t for t in times if t > moment) - moment


@async_test
async def test_503s_in_a_row_back_off_twice_as_long(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    # /page/2 answers 503 twice (no Retry-After), then its page: Scrapy retries it.
    no_header: dict[str, str] = {}
    errors = {(A, "/page/2"): [(503, no_header), (503, no_header)]}
    with DemoSite(HOSTS, pages=10, errors=errors) as site:
        crawler = await run_crawl(
            crawl_settings(redis_server.url, REDIS_THROTTLE_PENALTY_BACKOFF=0.5),
            pages(site, A, 6),
            redis_throttle_rates={A: "10/s"},
        )
        arrivals = site.arrivals(A)
    failures = [a.time for a in arrivals if a.status == 503]
    assert len(failures) == 2
    times = [a.time for a in arrivals]
    assert gaps_after(times, failures[0]) >= 0.5, "first pause: the backoff"
    assert gaps_after(times, failures[1]) >= 1.0, "second one, right after: twice as long"
    assert Counter(a.path for a in arrivals if a.status == 200) == {
        f"/page/{n}": 1 for n in range(6)
    }
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/penalties/503"] == 2
    assert stats["redis_throttle/pauses"] == 2
    assert 0.99 < stats["redis_throttle/pause_max"] <= 1.0
    assert any(
        f"503 from '{A}' (no Retry-After, penalty 2 in a row): no request to it for 1.0 s"
        in r.getMessage()
        for r in caplog.records
    )


@async_test
async def test_a_request_can_opt_out_of_penalties(redis_server: RedisServer) -> None:
    errors = {(A, "/page/1"): [(429, {"Retry-After": "30"})]}
    with DemoSite(HOSTS, pages=10, errors=errors) as site:
        requests = pages(site, A, 4, redis_throttle_penalty=False)
        crawler = await run_crawl(
            crawl_settings(redis_server.url, RETRY_ENABLED=False),
            requests,
            redis_throttle_rates={A: "10/s"},
        )
        times = [a.time for a in site.arrivals(A)]
        assert_released_paced(crawler.stats.get_stats(), site.arrivals(A), 10, 1, A)
    assert len(times) == 4
    assert max(times) - min(times) < 5, "not paused for the Retry-After of 30 s"
    assert "redis_throttle/pauses" not in crawler.stats.get_stats()


def test_a_429_pauses_the_domain_for_every_worker(redis_server: RedisServer) -> None:
    """Three worker processes crawl one domain at 5/s; one request gets a 429 with
    Retry-After: 5. No worker sends the domain anything for 5 s, then they go on."""
    workers_count, pages_each = 3, 5
    # The first request of the first worker: the later ones it reserved fall within the pause.
    errors = {(A, "/page/0"): [(429, {"Retry-After": "5"})]}
    with DemoSite(HOSTS, pages=20, errors=errors) as site:
        jobs = one_domain_jobs(
            site, A, crawl_settings(redis_server.url), {A: "5/s"}, workers_count, pages_each
        )
        all_stats = finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 90)
        arrivals = site.arrivals(A)

    [refused] = [a.time for a in arrivals if a.status == 429]
    quiet = gaps_after([a.time for a in arrivals], refused)
    assert 5 <= quiet < 6, f"next request {quiet:.3f} s after the 429"
    assert Counter(a.path for a in arrivals if a.status == 200) == {
        f"/page/{n}": 1 for n in range(workers_count * pages_each)
    }, "every page, the refused one retried"
    assert sum(s.get("redis_throttle/pauses", 0) for s in all_stats) == 1
    assert sum(s.get("redis_throttle/paused_reservations", 0) for s in all_stats) >= 1


async def crawl_paused_by_another_worker(
    settings: dict[str, Any], site: DemoSite
) -> tuple[Crawler, int]:
    """Crawl 10 pages of A at 5/s, a moment reserved for each request at once; after 2
    arrivals, another worker (here, the test, with the same settings) pauses A for 2 s: no
    request may go within the pause. The crawler, for its stats, and how many requests had
    moments within the pause (those that did not go before it: 8, unless this process was
    too slow to pause A before the third moment). Judged when the requests left the throttle
    (Scrapy's ``request_reached_downloader``): one that left before the pause may arrive after
    it began."""
    other_worker = connect(ThrottleConfig.from_settings(Settings(settings)))
    bucket = TokenBucket(other_worker, "redis_throttle")
    try:
        # Connected, and on a cluster the slots read, before the crawl: the pause follows the
        # second arrival as closely as this process can.
        await bucket.last_voiding(A)
        runner = CrawlerRunner(settings)
        crawler = runner.create_crawler(UrlListSpider)
        crawl = runner.crawl(crawler, requests=pages(site, A, 10), redis_throttle_rates={A: "5/s"})
        await wait_until_async(lambda: len(site.arrivals(A)) >= 2, "2 arrivals")
        # Redis starts the pause when it runs the call, between these two times: it ends 2 s
        # after, at the latest 2 s after the call was sent.
        sent_at = time.time()
        penalty = await bucket.penalize(A, Limit(5, 1, "5/s"), 2.0, BACKOFF)
        paused_at = time.time()
    finally:
        await bucket.aclose()
        await close(other_worker)
    await maybe_deferred_to_future(crawl)

    assert penalty.changed
    went = released(crawler.stats.get_stats(), A)
    assert len(site.arrivals(A)) == len(went) == 10
    # The moments reserved 0.2 s apart were all within the pause of 2 s.
    inside = [round(t - paused_at, 3) for t in went if paused_at < t < sent_at + 2.0]
    assert inside == [], f"released this many seconds into the pause: {inside}"
    within = len([t for t in went if t > paused_at])
    assert within >= 5, f"only {within} moments left when the pause began: this test was late"
    return crawler, within


@pytest.mark.parametrize("throttle_redis", ["scrapy-redis's", "Cluster"], indirect=True)
@async_test
async def test_a_pause_published_by_another_worker_stops_reserved_requests(
    redis_server: RedisServer, throttle_redis: Topology, site: DemoSite
) -> None:
    """The requests whose moments fall within another worker's pause hear of it and wait for
    it to end. (On a cluster, the pause is published on the primary of the domain's slot, and
    the crawl listens on any node.)"""
    settings = crawl_settings(redis_server.url, **throttle_settings(throttle_redis))
    crawler, within = await crawl_paused_by_another_worker(settings, site)
    stats = crawler.stats.get_stats()
    assert stats.get("redis_throttle/paused_reservations") == within, stats


@async_test
async def test_a_worker_that_missed_the_message_still_keeps_the_pause(
    redis_server: RedisServer, site: DemoSite
) -> None:
    """As above, but the crawl's worker cannot subscribe (its Redis user lacks the right), so
    it hears of no pause: Redis delivers a message only to the workers subscribed when it is
    published, as for a worker that was starting, or whose subscription was down. Its reserved
    requests read the domain's last pause from Redis before they go."""
    rules = [rule for rule in documented_acl_rules() if rule != "+subscribe"]
    redis_server.add_user("deaf-worker", "worker-secret", *rules)
    url = f"redis://deaf-worker:worker-secret@127.0.0.1:{redis_server.port}/0"
    crawler, within = await crawl_paused_by_another_worker(crawl_settings(url), site)
    stats = crawler.stats.get_stats()
    assert stats.get("redis_throttle/paused_reservations") == within, stats
    assert stats["redis_throttle/voidings_read"] >= 9, "every reserved request read it"
    assert stats["redis_throttle/listener_errors/NoPermissionError"] >= 1


@async_test
async def test_one_read_of_a_domains_last_voiding_serves_every_request_of_it(
    redis_server: RedisServer,
) -> None:
    """A moment reserved before this worker subscribed (in another process, up to CLOCK_MARGIN
    after it) needs the domain's last voiding read from Redis; one read made while subscribed
    serves every later request of that domain, since the channel tells what comes after."""
    pauses, client, _ = listening_pauses(redis_server, lambda *_: None)
    try:
        before = time.time()
        await pauses.start()
        subscribed = time.time()
        assert not pauses.knows_voidings("a.example", before, elsewhere=False)
        assert pauses.knows_voidings("a.example", subscribed, elsewhere=False)
        assert not pauses.knows_voidings("a.example", subscribed, elsewhere=True), "clock margin"
        pauses.read("a.example", None, before)
        assert not pauses.knows_voidings("a.example", before, False), "asked before it listened"
        pauses.read("a.example", None, time.time())
        assert pauses.knows_voidings("a.example", before, False)
        assert pauses.knows_voidings("a.example", subscribed, True)
        assert not pauses.knows_voidings("b.example", before, False), "per domain"
        # What a read says is kept: a voiding 0.5 s ago, for 2 s from now.
        pauses.read("b.example", Voiding(age=0.5, left=2.0), time.time())
        moment = asyncio.get_running_loop().time() + 1
        assert pauses.is_void("b.example", time.time() - 1, moment)
        assert not pauses.is_void("b.example", time.time(), moment), "reserved after it"
    finally:
        await pauses.stop()
        await close(client)


@async_test
async def test_messages_that_are_not_pauses_are_counted_and_void_nothing(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who may publish on the channel can send anything: huge, negative, non-ASCII or
    empty pauses, no domain. Each is counted, the first logged; none voids anything, and the
    listener goes on to hear the next real pause."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    voided: list[str] = []
    pauses, client, stats = listening_pauses(redis_server, lambda key, *_: voided.append(key))
    bad = [
        b"1" + b"0" * 400 + b" 7 a.example",
        b"-5 7 a.example",
        "²³ 7 a.example".encode(),
        b"",
        b"7",
        b"5 a.example",
    ]
    try:
        await pauses.start()
        with redis_server.client() as publisher:
            for message in [*bad, b"2000000 7 b.example"]:
                publisher.publish("ch", message)
        await wait_until_async(lambda: pauses.paused_for("b.example") > 0, "the real pause")
    finally:
        await pauses.stop()
        await close(client)
    assert voided == ["b.example"]
    assert stats.get_value("redis_throttle/bad_messages") == len(bad)
    warnings = [r.getMessage() for r in caplog.records if "not a pause" in r.getMessage()]
    assert len(warnings) == 1, warnings


@async_test
async def test_without_redis_a_429_pauses_the_worker_that_got_it(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    own_redis.stop()
    errors = {(A, "/page/1"): [(429, {"Retry-After": "1"})]}
    with DemoSite(HOSTS, pages=10, errors=errors) as site:
        await run_crawl(
            # One worker alone: it paces locally though it never read the fleet's size.
            crawl_settings(own_redis.url, RETRY_ENABLED=False, REDIS_THROTTLE_FALLBACK_WORKERS=1),
            pages(site, A, 5),
            redis_throttle_rates={A: "10/s"},
        )
        arrivals = site.arrivals(A)
    assert len(arrivals) == 5
    [refused] = [a.time for a in arrivals if a.status == 429]
    assert gaps_after([a.time for a in arrivals], refused) >= 1
    assert any(
        f"429 from '{A}': pausing it for 1.0 s in this worker only" in r.getMessage()
        for r in caplog.records
    )
