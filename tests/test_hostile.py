"""Hostile input: what a site sends (Retry-After, robots.txt Crawl-delay) is parsed into a
bounded value or refused, counted and logged once per domain; it never opens the circuit
breaker, and the other domains keep their pace. Sent by a real HTTP server to real crawls."""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import math
import pickle
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
import scrapy
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from scrapy import FormRequest, Request, signals
from scrapy.http import HtmlResponse, JsonRequest
from scrapy.linkextractors import LinkExtractor
from scrapy.settings import Settings
from scrapy.spiders import CrawlSpider, Rule
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.test import get_crawler
from support import (
    SCRAPY_REDIS,
    assert_released_paced,
    async_test,
    crawl_settings,
    listening_pauses,
    pages,
    parked_member,
    run_crawl,
    tool,
    wait_until_async,
)

from scrapy_redis_throttle.cli import EXIT_BAD_INPUT
from scrapy_redis_throttle.cli import main as cli_main
from scrapy_redis_throttle.clock import Clock
from scrapy_redis_throttle.config import ThrottleConfig
from scrapy_redis_throttle.connection import close, connect, connect_url
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.crawl_delay import MIN_CRAWL_DELAY, parse_crawl_delay
from scrapy_redis_throttle.errors import ThrottleConfigError
from scrapy_redis_throttle.one_node import LIVE_INVALID
from scrapy_redis_throttle.pauses import (
    FIRST_SUBSCRIPTION_WAIT,
    MAX_RESUBSCRIBE_DELAY,
    MAX_RETRY_AFTER,
    PAUSES_PER_DOMAIN,
    SWEEP_STEP,
    Pause,
    parse_retry_after,
)
from scrapy_redis_throttle.rates import Limit, normalize_domain, parse_limit
from scrapy_redis_throttle.redis_parking import RedisParking, read_member
from scrapy_redis_throttle.redis_schema import bucket_key, penalty_key, rate_key
from scrapy_redis_throttle.rejections import Rejections
from scrapy_redis_throttle.replies import Reservation
from scrapy_redis_throttle.request_codec import Unparkable, decode_request, encode_request
from scrapy_redis_throttle.resilience import ResilientBucket
from scrapy_redis_throttle.scripts import load_script
from scrapy_redis_throttle.seals import Seals
from scrapy_redis_throttle.tickets import Ticket

A, B, C = HOSTS


def no_redis_failure(stats: dict[str, object]) -> None:
    """The throttle's Redis never failed, and its breaker never opened."""
    failures = {k: v for k, v in stats.items() if "redis_errors" in k or k.endswith("/outages")}
    assert failures == {}, failures
    assert "redis_throttle/fallback/local" not in stats, "no request paced without Redis"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"0", 0.0),
        (b"000007", 7.0),
        (b"999999999", 999_999_999.0),
        (b"1" + b"0" * 309, MAX_RETRY_AFTER),  # a float would be inf
        (b"9" * 5000, MAX_RETRY_AFTER),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # already past, by our clock (no Date)
        (b"Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER),
    ],
)
def test_a_retry_after_becomes_a_bounded_number_of_seconds(value: bytes, expected: float) -> None:
    assert parse_retry_after(value, None, time.time()) == expected


@pytest.mark.parametrize(
    "value",
    [
        "²".encode("latin-1"),  # a digit to str.isdigit(), not to float()
        "¹²³".encode("latin-1"),
        b"-5",
        b"5.5",
        b"1e3",
        b"inf",
        b"nan",
        b"soon",
        b"\x00\xff",
        b"Mon, 01 Jan 99999999999999999999 00:00:00 GMT",  # OverflowError in the parser
        b"x" * 10_000,
    ],
)
def test_a_retry_after_that_is_no_delay_is_refused_saying_why(value: bytes) -> None:
    with pytest.raises(ValueError, match="Retry-After") as refused:
        parse_retry_after(value, None, time.time())
    assert len(str(refused.value)) < 200, "the message quotes a bounded part of the value"


def test_a_bad_date_header_leaves_the_retry_after_date_to_our_clock() -> None:
    assert parse_retry_after(b"Wed, 21 Oct 2015 07:28:00 GMT", b"garbage", time.time()) == 0.0
    assert (
        parse_retry_after(
            b"Wed, 21 Oct 2015 07:28:00 GMT", b"Wed, 21 Oct 2015 07:27:00 GMT", time.time()
        )
        == 60
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (0, None),
        (0.0, None),
        (2, 2.0),
        (0.5, 0.5),
        (1e-320, MIN_CRAWL_DELAY),  # 1 / 1e-320 is inf: no rate
        (5e-324, MIN_CRAWL_DELAY),
        (math.inf, math.inf),  # REDIS_THROTTLE_MAX_CRAWL_DELAY caps it
        (10**400, math.inf),  # no float holds it
    ],
    ids=str,
)
def test_a_crawl_delay_becomes_a_bounded_number_of_seconds(
    value: object, expected: float | None
) -> None:
    assert parse_crawl_delay(value) == expected


@pytest.mark.parametrize(
    "value", [math.nan, -1, -math.inf, -(10**400), True, "5", b"5", [5]], ids=repr
)
def test_a_crawl_delay_that_is_no_delay_is_refused_saying_why(value: object) -> None:
    with pytest.raises(ValueError, match="Crawl-delay"):
        parse_crawl_delay(value)


@async_test
async def test_hostile_retry_after_headers_pause_only_their_domain(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A answers 429 with Retry-After "²", a 310-digit number, "0" and garbage, in turn
    (Scrapy retries each page); B is crawled meanwhile. The unreadable ones pause A as if it
    had none (the backoff), the huge one for REDIS_THROTTLE_MAX_PAUSE; nothing reaches Redis
    as an error, and B keeps its pace."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    hostile = ["²", "1" + "0" * 309, "0", "soon"]
    errors = {(A, f"/page/{n}"): [(429, {"Retry-After": value})] for n, value in enumerate(hostile)}
    with DemoSite(HOSTS, pages=10, errors=errors) as site:
        crawler = await run_crawl(
            crawl_settings(
                redis_server.url,
                REDIS_THROTTLE_PENALTY_BACKOFF=0.2,
                REDIS_THROTTLE_MAX_PAUSE=0.5,
                RETRY_HTTP_CODES=[429],
            ),
            pages(site, A, len(hostile)) + pages(site, B, 10),
            redis_throttle_rates={A: "10/s", B: "5/s"},
        )
        a_arrivals, b_arrivals = site.arrivals(A), site.arrivals(B)
    stats = crawler.stats.get_stats()
    no_redis_failure(stats)
    assert Counter(a.path for a in a_arrivals if a.status == 200) == {
        f"/page/{n}": 1 for n in range(len(hostile))
    }, "every page of A, once each, after its 429"
    assert stats["redis_throttle/penalties/429"] == len(hostile)
    assert stats["redis_throttle/rejected/retry_after"] == 2, "'²' and 'soon'"
    assert_released_paced(stats, b_arrivals, 5, 1, B)
    assert len(b_arrivals) == 10
    warnings = [r.getMessage() for r in caplog.records if "Retry-After" in r.getMessage()]
    assert len(warnings) == 1, f"logged once for A: {warnings}"
    assert "'²'" in warnings[0], warnings
    assert f"from '{A}'" in warnings[0], warnings


needs_robots_signal = pytest.mark.skipif(
    not hasattr(signals, "robots_parsed"), reason="Scrapy < 2.18 has no robots_parsed signal"
)


@needs_robots_signal
@async_test
async def test_hostile_crawl_delays_affect_only_their_host(redis_server: RedisServer) -> None:
    """A's robots.txt asks for a Crawl-delay of 1e-320 s and A has no limit of its own: one
    request per delay would be an infinite rate; it becomes 1 ms (1000/s). B's asks for 5e-324
    under a configured 5/s, which stays; C's for nan (Protego drops it). Nothing reaches Redis
    as an error, every page is fetched."""
    robots = {
        host: f"User-agent: *\nCrawl-delay: {delay}\nAllow: /\n"
        for host, delay in ((A, "1e-320"), (B, "5e-324"), (C, "nan"))
    }
    with DemoSite(HOSTS, pages=10, robots=robots) as site:
        crawler = await run_crawl(
            crawl_settings(redis_server.url, ROBOTSTXT_OBEY=True, REDIS_THROTTLE_DEFAULT_RATE=None),
            pages(site, A, 5) + pages(site, B, 5) + pages(site, C, 5),
            redis_throttle_rates={B: "5/s", C: "5/s"},
        )
        arrivals = {host: site.arrivals(host) for host in HOSTS}
    stats = crawler.stats.get_stats()
    no_redis_failure(stats)
    for host in HOSTS:
        paths = Counter(a.path for a in arrivals[host] if a.path != "/robots.txt")
        assert paths == {f"/page/{n}": 1 for n in range(5)}, f"{host}: every page, once"
    for host in (B, C):
        pages_only = [a for a in arrivals[host] if a.path != "/robots.txt"]
        assert_released_paced(stats, pages_only, 5, 1, host)
    assert stats["redis_throttle/crawl_delay/applied"] == 2, "A's and B's, as MIN_CRAWL_DELAY"


@async_test
async def test_the_pauses_listener_survives_any_error_and_caps_what_it_hears(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An error the listener does not expect (here, from passing a pause on to the parking
    area) is counted and logged with its traceback, once, and the listener hears the next
    message; a pause of 31 years on the channel is kept for ``longest`` (600 s) only."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    failures = [RuntimeError("a bug"), RuntimeError("a bug")]

    def release_parked(_key: str, _pause: Pause) -> None:
        if failures:
            raise failures.pop()

    pauses, client, stats = listening_pauses(redis_server, release_parked)
    try:
        await pauses.start()
        with redis_server.client() as publisher:
            for message in (
                b"1000000 7 a.example",
                b"2000000 7 c.example",
                b"999999999999999 7 b.example",
            ):
                publisher.publish("ch", message)
            await wait_until_async(lambda: pauses.paused_for("b.example") > 0, "the third pause")
    finally:
        await pauses.stop()
        await close(client)
    assert stats.get_value("redis_throttle/listener_errors/RuntimeError") == 2
    assert pauses.paused_for("a.example") > 0, "kept, though not passed on"
    assert 599 < pauses.paused_for("b.example") <= 600
    [warning] = [r for r in caplog.records if "could not be passed on" in r.getMessage()]
    assert warning.exc_info is not None, "a traceback, to find the bug"


@async_test
async def test_the_pauses_listener_backs_off_while_a_bug_fails_it_at_once(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug outside the handling of one message (here, made to fail on every message) ends
    the subscription each time it is subscribed again: it subscribes again after 1 s, doubled
    at each such failure up to MAX_RESUBSCRIBE_DELAY, warns once with the traceback, and
    goes on listening. (The waits are recorded, not waited; the wait goes back to 1 s once a
    subscription lasts longer than the last wait, which this test does not wait for.)"""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    waits: list[float] = []

    class RecordingClock(Clock):
        def sleep(self, seconds: float) -> asyncio.Future[None]:
            waits.append(seconds)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    def bug(data: bytes) -> None:
        raise RuntimeError("a bug outside one message")

    pauses, client, stats = listening_pauses(redis_server, lambda *_: None, RecordingClock())
    monkeypatch.setattr(pauses, "_received", bug)
    try:
        await pauses.start()
        assert waits == [FIRST_SUBSCRIPTION_WAIT], "start waits for the subscription, by the clock"
        waits.clear()
        with redis_server.client() as publisher:
            for n in range(8):
                await wait_until_async(
                    lambda: publisher.pubsub_numsub("ch")[0][1] == 1, "subscribed again"
                )
                publisher.publish("ch", b"1000000 7 a.example")
                await wait_until_async(lambda: len(waits) > n, f"failure {n + 1}")  # noqa: B023
        listener = pauses._listener
        assert listener is not None
        assert not listener.done(), "still listening"
    finally:
        await pauses.stop()
        await close(client)
    assert waits == [1, 2, 4, 8, 16, *[MAX_RESUBSCRIBE_DELAY] * 3]
    assert stats.get_value("redis_throttle/listener_errors/RuntimeError") == 8
    # Once per subscription that fails: at most every MAX_RESUBSCRIBE_DELAY while it goes on.
    warnings = [r for r in caplog.records if "cannot listen" in r.getMessage()]
    assert len(warnings) == 8
    assert all(warning.exc_info is not None for warning in warnings), "tracebacks, for the bug"


@async_test
async def test_pauses_of_100000_domains_are_forgotten_once_they_end(
    redis_server: RedisServer,
) -> None:
    pauses, client, _ = listening_pauses(redis_server, lambda *_: None)
    try:
        for n in range(10):
            pauses.pause(f"long{n}.example", 60)
        for n in range(100_000):
            pauses.pause(f"host{n}.example", 0)  # ended as soon as it is kept
        kept = len(pauses._pauses)
    finally:
        await close(client)
    assert kept <= 10 + SWEEP_STEP, f"{kept} domains' pauses kept"
    assert all(pauses.paused_for(f"long{n}.example") > 0 for n in range(10)), "under way: kept"


@async_test
async def test_a_flood_of_pauses_for_one_domain_keeps_a_few_that_void_as_much(
    redis_server: RedisServer,
) -> None:
    """Pauses heard later and ending sooner, one after the other (a channel flooded on
    purpose): a domain keeps at most PAUSES_PER_DOMAIN, and every moment any of them voids stays
    void."""
    pauses, client, _ = listening_pauses(redis_server, lambda *_: None)
    try:
        reserved_before = time.time() - 1
        for n in range(1000):
            pauses.pause("a.example", 600 - n / 10, age=-n / 1000)  # heard 1 ms later each
        kept = len(pauses._pauses["a.example"])
        soon = asyncio.get_running_loop().time() + 1
        voided = pauses.is_void("a.example", reserved_before, soon + 590)
    finally:
        await close(client)
    assert kept <= PAUSES_PER_DOMAIN
    assert voided, "the first pause, 600 s long, still voids a moment 591 s ahead"


# Values a neighbour (or another version) may have written under the fleet's keys, per domain:
# its bucket (moment and live limit), its penalty hash, its adaptive rate.
GARBAGE = {
    "a.example": (b"soon 1 1 0", {}, None),  # the bucket's moment
    "b.example": (b"0 fast - 0", {}, None),  # a live limit's rate
    "c.example": (b"0 1 2 3 4 5", {}, None),  # a live limit's shape
    "d.example": (b"0 1 1 0 z1/1000000", {}, None),  # a quota's algorithm
    "e.example": (b"0 -5 1 0", {}, None),  # a negative rate
    "f.example": (b"0 nan 1 0", {}, None),
    "g.example": (b"0 1 1.5 0", {}, None),  # a fractional burst
    "h.example": (b"0", {"strikes": "x", "until": "inf"}, None),
    "i.example": (b"0", {}, b"1 2 three 4"),
    "j.example": (b"0", {"strikes": "\xd9\xa3".encode("latin-1")}, None),  # "٣", an Arabic 3
}


def test_the_tool_shows_what_it_can_read_and_names_what_it_cannot(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Garbage under the fleet's keys (a live limit, a bucket, a penalty, an adaptive rate, the
    workers' reports and parked counts): ``status``, ``get`` and ``list`` show the rest, take
    each unreadable value as absent, and name it; they exit 0."""
    prefix = "redis_throttle"
    with redis_server.client() as client:
        LiveControl(client, prefix).set("good.example", 2, 3)
        for domain, (bucket, penalty, adaptive) in GARBAGE.items():
            client.set(bucket_key(prefix, domain), bucket)
            client.sadd(f"{prefix}:live", domain)
            if penalty:
                client.hset(penalty_key(prefix, domain), mapping=penalty)
            if adaptive is not None:
                client.set(rate_key(prefix, domain), adaptive)
        client.set(f"{prefix}:worker:w1", b"not json")
        client.set(f"{prefix}:worker:w2", b'{"good.example": [1, 2, 3, 4]}')
        client.set(f"{prefix}:worker:w3", b'{"good.example": [true, -1]}')
        client.set(f"{prefix}:worker:w4", b'{"good.example": [4, 1]}')
        client.hset(f"{prefix}:parked", mapping={"good.example": "many"})
    url = ("--redis-url", redis_server.url)
    status = tool(*url, "status", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "Traceback" not in status.stderr
    rows = {line.split()[0]: line for line in status.stdout.splitlines()}
    assert "2/s (burst 3)" in rows["good.example"]
    assert rows["good.example"].split()[-5:-2] == ["4", "1/15s", "1"], "w4 alone: 4 went, 1 held"
    problems = [line for line in status.stdout.splitlines() if "unreadable in Redis" in line]
    named = " ".join(problems)
    for domain in GARBAGE:
        assert f"{domain!r} " in named, f"{domain} named: {problems}"
    for report in ("w1", "w2", "w3"):
        assert f"{prefix}:worker:{report}" in named, report
    assert "parked count" in named
    for domain in ("a.example", "h.example"):
        got = tool(*url, "get", domain, cwd=tmp_path)
        assert got.returncode == 0, got.stderr
        assert got.stdout.splitlines()[1].split()[0] == domain
        assert f"unreadable in Redis: {domain!r} " in got.stderr
    listed = tool(*url, "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    # a.example's live limit is readable (its bucket's moment is not).
    assert listed.stdout.splitlines() == ["a.example: 1/s (burst 1)", "good.example: 2/s (burst 3)"]
    assert listed.stderr.count("' live limit: ") == 6, listed.stderr  # b. to g.


TEN_PER_SECOND = ["100000", "1", "1", "10000000"]  # interval µs, burst, cost, reserve µs


@pytest.mark.parametrize(
    "live",
    [
        b"-5 - 0",  # a negative rate
        b"inf - 0",
        b"nan - 0",
        b"1e-300 - 0",  # an interval past 1e14 µs
        b"- 0 0",  # a burst of 0
        b"- -3 0",
        b"- 2.5 0",  # a fractional burst: 2.5 tokens
        b"- nan 0",
        b"10 - 0 z1/1000000",  # an unknown algorithm
        b"10 - 0 s0/1000000",  # a count of 0
        b"10 - 0 f1/1.5",  # a window of a fractional period
        b"10 - 0 t1.5/1000000",  # a fractional count: a cost of 2 was refused
        b"10 - 0 s1/1e300",
        b"10 - 0 " + b",".join(b"t1/%d" % (n + 1) for n in range(10_000)),  # 10,000 quotas
    ],
    ids=lambda live: live[:30].decode(),
)
def test_a_garbage_live_limit_in_redis_is_ignored_not_an_error(
    redis_server: RedisServer, live: bytes
) -> None:
    """A worker's acquire reads the domain's live limit from Redis in the same call: a field that
    is no limit is ignored (the workers' own applies: 10/s), never an error (which every request
    to the domain, of every worker, would get, and count as a Redis failure)."""
    with redis_server.client() as client:
        acquire = client.register_script(load_script("token_bucket.lua"))
        key = bucket_key("ns", "a.example")
        client.set(key, b"0 " + live)
        # More limits set live (valid ones among them) make the caller call again with KEYS[2..4].
        keys = [key, rate_key("ns", "a.example"), key + ":q", key + ":l"]
        first = acquire(keys=keys, args=TEN_PER_SECOND)
        second = acquire(keys=keys, args=TEN_PER_SECOND)
    # Each status says that the live limit has a field that is no limit (LIVE_INVALID), but
    # for a bucket's value too long to read (prelude.lua's MAX_VALUE_BYTES): no live limit.
    flag = LIVE_INVALID if len(live) < 4096 else 0
    assert first[:2] == [1 + flag, 0]
    assert second[0] == 2 + flag
    assert second[1] <= 100_000 or live.startswith(b"10 "), "the workers' 10/s, or the live 10/s"


@pytest.mark.parametrize(
    ("where", "value", "limit"),
    [
        ("", b"9" * 300, []),  # a bucket's time far past any moment
        ("", b"9" * 300 + b" 10 5 0", []),
        ("", b"0 10 - 0 " + b"a" * 20_000, []),  # Lua's gmatch took 1.9 s on this
        ("", b"0 10 - 0 " + b"t1/" * 1300, []),  # under 4 KB, no limit
        (":q t10/1000000", b"1e300", ["t", "10", "1000000"]),
        (":q f10/1000000", b"1" * 40_000, ["f", "10", "1000000"]),  # 11 s in Redis
        (":q f10/1000000", b"1 " * 2000, ["f", "10", "1000000"]),
        (":l", 1e300, ["s", "10", "1000000"]),  # a member of the log (made PEXPIRE fail)
        (":l", math.inf, ["s", "10", "1000000"]),
    ],
    ids=lambda value: repr(value)[:24],
)
def test_garbage_in_a_domains_keys_is_ignored_not_an_error(
    redis_server: RedisServer, where: str, value: object, limit: list[str]
) -> None:
    """Whatever another writer put in a domain's bucket, quota hash or log: the acquire reads
    it as absent (a time more than ~31 years ahead, a value over 4 KB, a log member far ahead)
    and goes by the workers' own 10/s, never answering with an error or a wait that overflows
    its integers."""
    key = bucket_key("ns", "a.example")
    keys = [key, rate_key("ns", "a.example"), key + ":q", key + ":l"]
    with redis_server.client() as client:
        acquire = client.register_script(load_script("token_bucket.lua"))
        if where == "":
            client.set(key, value)
        elif where == ":l":
            client.zadd(key + ":l", {"garbage": value})
        else:
            client.hset(key + ":q", where.split()[1], value)
        # busy_until, not_before and alone 0, then the limit.
        first = acquire(keys=keys, args=[*TEN_PER_SECOND, "0", "0", "0", *limit])
        second = acquire(keys=keys, args=[*TEN_PER_SECOND, "0", "0", "0", *limit])
    # (A status may say that a live limit had a field that is no limit: LIVE_INVALID.)
    assert [first[0] % LIVE_INVALID, first[1]] == [1, 0], first
    assert second[0] % LIVE_INVALID in (1, 2), second
    assert second[1] <= 100_000, "at 10/s (the workers', or the live one with its burst 5)"


PENALTY_ARGS = ["100000", "1", "-1", "1000000", "600000000", "60000000", "ch", "n"]
SLOW_DOWN_ARGS = ["10", "1", "0.5", "60000000", "0", "0", "1", "ch", "n"]
SET_LIMIT_ARGS = ["set", "5", "2", "ch", "n"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("b", "9" * 300),  # a bucket's time far past any moment
        ("b", "9" * 300 + " 10 5 0"),
        ("b", "1" * 1000 + "     x"),  # set_limit.lua's pattern took 27 s on 400 bytes of this
        ("b:p", {"strikes": "9" * 300, "until": "1"}),
        ("b:p", {"strikes": "nan", "until": "9" * 300}),
        ("b:v", "1 " + "9" * 300),
        ("b:r", "x y z w"),
        ("b:r", "1e300 1e300 1e300 1e300"),
    ],
    ids=lambda value: repr(value)[:20],
)
@pytest.mark.parametrize("script", ["penalty.lua", "slow_down.lua", "set_limit.lua"])
def test_garbage_read_by_the_pausing_scripts_is_ignored_not_an_error(
    redis_server: RedisServer, script: str, key: str, value: str | dict[str, str]
) -> None:
    """A 429's pause, a lowered adaptive rate and the tool's limit read the domain's keys too:
    what is not a time they wrote counts as none, and each answers (an error reply would count
    as a failure of Redis); its integers stay in range."""
    with redis_server.client() as client:
        call = client.register_script(load_script(script))
        if isinstance(value, dict):
            client.hset(key, mapping=value)
        else:
            client.set(key, value)
        if script == "penalty.lua":
            reply = call(keys=["b", "b:p", "b:v"], args=PENALTY_ARGS)
            assert reply[:3] == [1, 1_000_000, 1], "the first backoff's pause, published"
        elif script == "slow_down.lua":
            reply = call(keys=["b", "b:r", "b:v"], args=SLOW_DOWN_ARGS)
            assert reply[:2] == [1, b"5"], "lowered from the configured 10/s"
        else:
            reply = call(keys=["b", "b:p", "b:v"], args=SET_LIMIT_ARGS)
            assert reply[0] == b"5 2 0", reply
        assert all(abs(int(n)) < 10**15 for n in reply[1:] if isinstance(n, int)), reply
        # What it wrote is a bucket the scripts read (garbage is not kept), which expires
        # unless a limit set live keeps it (slow_down.lua's may have expired already).
        state = client.get("b") or b"0"
        written = re.fullmatch(rb"(\d+)( \S+ \S+ [01]( \S+)?)?", state)
        assert written, state
        assert int(written[1]) < 10**15, state
        assert written[2] or client.pttl("b") != -1, state


def test_the_tools_limit_is_all_or_nothing_when_a_key_has_another_type(
    redis_server: RedisServer,
) -> None:
    """set_limit.lua reads every key before it writes: a void key of another type fails the
    call whole (the live limit was written, and nothing published, before)."""
    with redis_server.client() as client:
        call = client.register_script(load_script("set_limit.lua"))
        client.set("b", "91000000000000")
        client.hset("b:v", "x", "y")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            call(keys=["b", "b:p", "b:v"], args=SET_LIMIT_ARGS)
        assert client.get("b") == b"91000000000000", "unchanged"


@async_test
async def test_a_domain_key_of_another_type_is_that_domains_problem(
    redis_server: RedisServer,
) -> None:
    """A string where a domain's log (a sorted set) should be: Redis answers WRONGTYPE, which is
    no failure of Redis. The breaker stays closed, the other domains go by Redis."""
    config = ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_URL": redis_server.url}))
    stats = MemoryStatsCollector(get_crawler())
    bucket = ResilientBucket(connect(config), config, stats, dict, Clock())
    windowed = parse_limit(
        ["10/s", {"rate": "5/s", "algorithm": "sliding_window"}], default_burst=1, source="test"
    )
    assert windowed is not None
    with redis_server.client() as client:
        client.set(bucket_key("redis_throttle", "a.example") + ":log", "not a sorted set")
    try:
        refused = await bucket.acquire("a.example", windowed, 1)
        other = await bucket.acquire("b.example", windowed, 1)
        closed = bucket.breaker.open_for() is None
    finally:
        await bucket.aclose()
    assert closed, "the breaker stayed closed"
    assert (refused.shared, other.shared) == (False, True)
    assert stats.get_value("redis_throttle/rejected/script_call") == 1
    no_redis_failure({k: v for k, v in stats.get_stats().items() if "fallback" not in k})


def sealing_store(
    server: RedisServer, key: str, secret: bytes, stats: MemoryStatsCollector | None = None
) -> RedisParking:
    """A parking set in *server* whose worker knows the fleet's *secret*."""
    seals = Seals()
    seals.know(secret)
    stats = stats or MemoryStatsCollector(get_crawler())
    return RedisParking(
        connect_url(server.url, {}, 1),
        key,
        CodecSpider(),
        Rejections(stats, dict),
        Clock(),
        seals=seals,
    )


@async_test
async def test_parked_tickets_count_only_with_the_fleets_seal(redis_server: RedisServer) -> None:
    """Whoever may write into scrapy-redis's Redis may forge a parked request's ticket: "my
    moment is reserved" (it would go without asking the bucket), or a reservation to give back
    (its bucket's time, and a step back to long ago: the bucket full while other moments are
    held). A ticket counts only sealed with the fleet's secret (in the throttle's Redis), for
    its own member: a forged one, a copy under another id, or one sealed with another secret
    asks anew and gives nothing back, counted and logged."""
    stats = MemoryStatsCollector(get_crawler())
    store = sealing_store(redis_server, "sealed:parked", b"s" * 64, stats)
    loop_now, now = asyncio.get_running_loop().time(), time.time()
    reservation = Reservation(9_000_000_000_000, 60_000_000, 8_000_000_000_000)
    ticket = Ticket(
        domain=A,
        due=loop_now,
        reserved=True,
        locally=False,
        reserved_at=now,
        waiting_since=now,
        elsewhere=False,
        moment_us=1e15,
        reservation=reservation,
    )
    await store.park(Request(f"http://{A}/page/0"), ticket)
    other = sealing_store(redis_server, "sealed:parked", b"t" * 64)  # another fleet's secret
    try:
        await other.park(Request(f"http://{A}/other"), ticket)
    finally:
        await other.close(keep=True)
    with redis_server.client() as client:
        (genuine,) = [m for m in client.zrange("sealed:parked", 0, -1) if b"/page/0" in m]
        flag, key, body = read_member(genuine)
        fields = json.loads(body)
        wire = fields["meta"]["_redis_throttle_ticket"]
        assert len(wire) == 8
        assert isinstance(wire[7], str)
        assert len(wire[7]) == 32

        def forged(url: str, ticket_wire: object, member_id: bytes | None = None) -> bytes:
            fields["url"] = url
            fields["meta"]["_redis_throttle_ticket"] = ticket_wire
            member = parked_member(flag, key, json.dumps(fields).encode())
            return member if member_id is None else member[:1] + member_id + member[33:]

        members = {
            "/copy": forged(f"http://{A}/copy", wire),  # another id, the genuine seal
            "/old": forged(f"http://{A}/old", wire[:6]),  # an earlier version's: no seal
            "/none": forged(f"http://{A}/none", [*wire[:7], None]),
            "/nonascii": forged(f"http://{A}/nonascii", [*wire[:7], "\u00e9" * 32]),
            "/surrogate": forged(f"http://{A}/surrogate", [*wire[:7], "\ud800" * 32]),
            "/altered": forged(  # its seal, its id, a step back to long ago
                f"http://{A}/altered",
                [*wire[:6], [reservation.after, 1, 1], wire[7]],
                genuine[1:33],
            ),
        }
        client.zadd("sealed:parked", {member: 0 for member in members.values()})
    try:
        due, _ = await store.unpark(ahead=60, limit=10)
    finally:
        await store.close(keep=False)
    tickets = {urlparse(request.url).path: ticket for request, ticket in due}
    assert sorted(tickets) == sorted(["/page/0", "/other", *members])
    assert (tickets["/page/0"].reserved, tickets["/page/0"].reservation) == (True, reservation)
    for path in [*members, "/other"]:
        assert (tickets[path].reserved, tickets[path].reservation) == (False, None), path
    # Another fleet's too; an earlier version's, unsealed, is no forgery: not counted.
    assert stats.get_value("redis_throttle/rejected/parked_ticket") == len(members) - 1 + 1


@async_test
async def test_a_close_gives_back_only_the_reservations_the_fleet_sealed(
    redis_server: RedisServer,
) -> None:
    store = sealing_store(redis_server, "drop:parked", b"s" * 64)
    loop_now, now = asyncio.get_running_loop().time(), time.time()
    reservation = Reservation(9_000_000_000_000, 60_000_000, 8_000_000_000_000)
    ticket = Ticket(
        domain=A,
        due=loop_now + 60,
        reserved=True,
        locally=False,
        reserved_at=now,
        waiting_since=now,
        elsewhere=False,
        moment_us=1e15,
        reservation=reservation,
    )
    await store.park(Request(f"http://{A}/page/0"), ticket)
    with redis_server.client() as client:
        (genuine,) = client.zrange("drop:parked", 0, -1)
        flag, key, body = read_member(genuine)
        fields = json.loads(body)
        wire = fields["meta"]["_redis_throttle_ticket"]
        fields["meta"]["_redis_throttle_ticket"] = [*wire[:6], [reservation.after, 1, 1], wire[7]]
        altered = parked_member(flag, key, json.dumps(fields).encode())
        client.zadd("drop:parked", {altered[:1] + genuine[1:33] + altered[33:]: 0})
    closed = await store.close(keep=False)
    assert closed == (2, [(A, reservation)], {A: 2})


@pytest.mark.parametrize("adaptive", [b"nan 0 0 5", b"-1 0 0 5", b"x y z 5", b"0 0 0 5"])
def test_a_garbage_adaptive_rate_in_redis_is_ignored(
    redis_server: RedisServer, adaptive: bytes
) -> None:
    with redis_server.client() as client:
        acquire = client.register_script(load_script("token_bucket.lua"))
        key = bucket_key("ns", "a.example")
        client.set(rate_key("ns", "a.example"), adaptive)
        keys = [key, rate_key("ns", "a.example")]
        assert acquire(keys=keys, args=TEN_PER_SECOND)[:2] == [1, 0]
        status, wait_us, *_ = acquire(keys=keys, args=TEN_PER_SECOND)
    assert (status, wait_us <= 100_000) == (2, True), "the configured 10/s"


@pytest.mark.parametrize(
    ("setting", "argument"),
    [
        ("1/1000000000d", "1/1000000000d"),  # its interval would not fit Redis's integers
        ("1/400d", "1/400d"),
        (1e-9, "0.000000001"),
        ({"rate": "100/400d", "algorithm": "sliding_window"}, "sliding_window:100/400d"),
    ],
    ids=str,
)
def test_rates_too_slow_to_keep_are_refused_at_start_up_and_by_the_tool(
    redis_server: RedisServer, tmp_path: Path, setting: object, argument: str
) -> None:
    with pytest.raises(ThrottleConfigError, match="too slow"):
        ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_RATES": {"a": setting}}))
    done = tool("--redis-url", redis_server.url, "set", "a.example", argument, cwd=tmp_path)
    assert done.returncode == EXIT_BAD_INPUT
    assert "too slow" in done.stderr
    assert ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_RATES": {"a": "1/365d"}}))


def test_a_burst_of_non_ascii_digits_is_a_configuration_error() -> None:
    with pytest.raises(ThrottleConfigError, match="burst must be an integer"):
        ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_DEFAULT_BURST": "²"}))


@pytest.mark.parametrize("policy", ["local", "open", "wait"])
@async_test
async def test_a_call_a_script_refuses_is_that_requests_problem_not_an_outage(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """A limit no script takes (here one too slow for rates.py, built past it: its interval
    is over 1e14 µs): Redis answers with an error reply, which is no failure of Redis. The
    breaker stays closed, the other domains go by Redis, and the request is paced by this
    worker alone, whatever the policy: not unthrottled (open), nor asked again at once
    (wait); counted, logged once for its domain."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    settings = {
        "REDIS_THROTTLE_URL": redis_server.url,
        "REDIS_THROTTLE_ON_REDIS_ERROR": policy,
        "REDIS_THROTTLE_FALLBACK_WORKERS": 1,
    }
    config = ThrottleConfig.from_settings(Settings(settings))
    stats = MemoryStatsCollector(get_crawler())
    bucket = ResilientBucket(connect(config), config, stats, dict, Clock())
    refused = Limit(1e-9, 1, "1/31y")
    try:
        first = await asyncio.wait_for(bucket.acquire("a.example", refused, 1), 10)
        second = await asyncio.wait_for(bucket.acquire("a.example", refused, 1), 10)
        other = await bucket.acquire("b.example", Limit(10, 1, "10/s"), 1)
        closed = bucket.breaker.open_for() is None
    finally:
        await bucket.aclose()
    assert closed, "the breaker stayed closed"
    # This worker's bucket, full: the first goes (within float rounding of an interval of 1e9 s).
    assert (first.shared, first.result.retry_after < 0.001) == (False, True), first
    assert (second.shared, second.result.allowed) == (False, False), "then paced: 1/31y"
    assert second.result.retry_after > 1000, second
    assert other.shared, "the other domain goes by Redis"
    all_stats = stats.get_stats()
    no_redis_failure({k: v for k, v in all_stats.items() if k != "redis_throttle/fallback/local"})
    assert all_stats["redis_throttle/rejected/script_call"] == 2
    warnings = [
        r.getMessage() for r in caplog.records if "interval must be at most" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert "'a.example'" in warnings[0], warnings


@pytest.mark.parametrize(
    ("name", "domain"),
    [
        ("Shop.Example.", "shop.example"),  # a fully qualified name: its trailing dot
        ("bücher.example", "xn--bcher-kva.example"),  # as Scrapy's requests carry it
        ("BÜCHER.Example.", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("127.0.0.2", "127.0.0.2"),
    ],
)
def test_names_are_compared_as_requests_carry_them(name: str, domain: str) -> None:
    assert normalize_domain(name) == domain
    table = ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_RATES": {name: "1/s"}})).limits
    assert table.lookup(domain) is not None, f"the pattern {name!r} applies to {domain!r}"
    wildcards = {f"*.{name}": "1/s"}
    table = ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_RATES": wildcards})).limits
    assert table.lookup(f"a.{domain}") is not None


def test_a_name_idna_refuses_is_a_configuration_error() -> None:
    with pytest.raises(ThrottleConfigError, match="invalid domain pattern"):
        ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_RATES": {"ü" * 64: "1/s"}}))


@async_test
async def test_a_domain_cannot_dodge_its_limit_with_another_spelling(
    redis_server: RedisServer,
) -> None:
    """Keys spelled with a trailing dot, in upper case or in Unicode share the bucket of the
    name they spell: one request each for A's and B's, within 2 s of a crawl where both are
    at one request per 10 s (the default, 100/s, would have let all go)."""
    spellings = {A: ["Bücher.Example.", "bücher.example", "xn--bcher-kva.example"]}
    with DemoSite(HOSTS, pages=10) as site:
        requests = [
            *({"url": site.url(A, f"/page/{n}"), "meta": {"redis_throttle_key": key}}
              for n, key in enumerate(spellings[A])),
            *pages(site, B, 2),
            *({"url": site.url(B, f"/page/{n}"), "meta": {"redis_throttle_key": f"{B}."}}
              for n in range(2, 4)),
        ]  # fmt: skip
        await run_crawl(
            crawl_settings(
                redis_server.url, CLOSESPIDER_TIMEOUT=2, REDIS_THROTTLE_DEFAULT_RATE="100/s"
            ),
            requests,
            redis_throttle_rates={"BÜCHER.example": "1/10s", B: "1/10s"},
        )
        arrivals = {host: len(site.arrivals(host)) for host in (A, B)}
    assert arrivals == {A: 1, B: 1}, "one bucket per name, however spelled"


# The proxy scope's name for http://ПРОКСИ.рф:80 (see scopes.proxy_name).
RF = "xn--h1adldfi.xn--p1ai:80"


def test_the_tool_refuses_a_url_or_a_port_and_stores_a_name_as_workers_read_it(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = ("--redis-url", redis_server.url)
    monkeypatch.chdir(tmp_path)  # outside any Scrapy project; in this process (it refuses)
    for domain, message in (
        ("http://shop.example", "not a URL"),
        ("https://shop.example/", "not a URL"),
        (":8080", "expected a host name (or a redis_throttle_key, or a proxy's host:port), got"),
        ("shop.example:8080", "has a port, but the workers keep a site's limit under its host"),
    ):
        with pytest.raises(SystemExit) as exited:
            cli_main([*url, "set", domain, "1/s"])
        assert exited.value.code == EXIT_BAD_INPUT, domain
        assert message in capsys.readouterr().err, domain
    done = tool(*url, "set", "Bücher.Example.", "2/s", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "xn--bcher-kva.example: 2/s (workers' burst)\n")
    # A proxy's budget, in a project whose scopes count proxies: its host and port, the host
    # as a domain's.
    proxied = tmp_path / "proxied"
    proxied.mkdir()
    (proxied / "scrapy.cfg").write_text("[settings]\ndefault = proxied_settings\n")
    (proxied / "proxied_settings.py").write_text("REDIS_THROTTLE_SCOPE = ['host', 'proxy']\n")
    for proxy, name in (("Proxy.Example:8080", "proxy.example:8080"), ("ПРОКСИ.рф:80", RF)):
        done = tool(*url, "set", proxy, "10/s", cwd=proxied)
        assert (done.returncode, done.stdout) == (0, f"{name}: 10/s (workers' burst)\n")
    for proxy in ("proxy.example:0", "proxy.example:65536", "proxy.example:"):
        assert tool(*url, "set", proxy, "1/s", cwd=proxied).returncode == EXIT_BAD_INPUT
    with redis_server.client() as client:
        assert LiveControl(client, "redis_throttle").live_limits().keys() == {
            "xn--bcher-kva.example",
            "proxy.example:8080",
            RF,
        }


class Product(scrapy.Item):
    name = scrapy.Field()


class Touch:
    """A pickle that creates *path* when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def nested(depth: int) -> list[Any]:
    """A list in a list ... *depth* deep."""
    inner: list[Any] = []
    for _ in range(depth):
        inner = [inner]
    return inner


def as_dict(request: Request) -> dict[str, Any]:
    """All a request holds (its callbacks as bound methods, compared by function and spider)."""
    fields = {name: getattr(request, name) for name in request.attributes}
    return {**fields, "headers": dict(request.headers), "class": type(request)}


class CodecSpider(scrapy.Spider, metaclass=abc.ABCMeta):
    """A spider with a metaclass of its own (whose methods are no callbacks) and a property that
    fails when read (the writer never reads the spider's attributes)."""

    name = "codec"

    @property
    def touchy(self) -> None:
        raise RuntimeError("a property read")

    def parse_page(self, response: object) -> None:
        pass

    def failed(self, failure: object) -> None:
        pass

    @classmethod
    def by_class(cls, response: object) -> None:
        pass


@pytest.mark.parametrize(
    "request_",
    [
        Request("http://127.0.0.2/a"),
        Request(
            "http://127.0.0.2/b?q=1",
            method="POST",
            body=bytes(range(256)),
            headers={"X-Raw": b"\xff\x00caf\xe9", "Accept": ["a", "b"]},
            cookies=[{"name": "c", "value": "1", "domain": "127.0.0.2"}],
            meta={"depth": 3, "nested": {"list": [1, 2.5, None, True, "é"]}, "retry_times": 0},
            cb_kwargs={"page": 2, "seen": ["x"]},
            priority=-7,
            dont_filter=True,
            flags=["parked"],
            encoding="latin-1",
        ),
        FormRequest("http://127.0.0.3/form", formdata={"q": "scrapy", "page": "2"}),
        JsonRequest("http://127.0.0.4/api", data={"a": [1, 2]}, dumps_kwargs={"indent": 2}),
    ],
    ids=["plain", "everything", "form", "json"],
)
@pytest.mark.parametrize("callbacks", [False, True])
def test_a_parked_request_comes_back_from_json_as_it_went(
    request_: Request, callbacks: bool
) -> None:
    spider = CodecSpider()
    if callbacks:  # the spider's own methods, as a spider passes them
        request_ = request_.replace(callback=spider.parse_page, errback=spider.failed)
    encoded = encode_request(request_, spider)
    json.loads(encoded)  # plain JSON: no pickle anywhere
    back = decode_request(encoded, spider)
    assert as_dict(back) == as_dict(request_)
    assert (back.callback, back.errback) == (request_.callback, request_.errback)


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({"item": Product(name="x")}, "meta['item'] is a Product"),
        ({"bindaddress": ("127.0.0.1", 0)}, "meta['bindaddress'] is a tuple"),
        ({"raw": b"bytes"}, "meta['raw'] is a bytes"),
        ({"timeout": math.inf}, "meta['timeout'] is inf"),
        ({"by_id": {1: "a"}}, "meta['by_id'] has a key 1"),
        ({"deep": nested(40)}, "deeper than 32"),
    ],
)
def test_a_request_json_would_not_give_back_as_it_was_is_unparkable(
    meta: dict[str, Any], reason: str
) -> None:
    with pytest.raises(Unparkable, match=re.escape(reason)):
        encode_request(Request("http://127.0.0.2/", meta=meta), CodecSpider())


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (Request("file:///etc/hosts"), "its URL is not http or https"),
        (Request("http://127.0.0.2/", callback=print), "its callback is no method of the spider"),
        (Request("http://127.0.0.2/", priority=2**60), "would not be read back: priority"),
        (Request("http://127.0.0.2/", flags=[404]), "would not be read back: flags"),  # type: ignore[list-item]
        (Request("http://127.0.0.2/", meta={"n": 10**5000}), "not JSON"),
        (Request("http://127.0.0.2/", meta={"x": "x" * (1 << 20)}), "more than 1,048,576"),
    ],
)
def test_a_request_the_reader_would_not_give_back_is_unparkable(
    request_: Request, reason: str
) -> None:
    """Never parked to be lost: what the reader refuses, the writer refuses first."""
    with pytest.raises(Unparkable, match=re.escape(reason)):
        encode_request(request_, CodecSpider())


def test_a_crawl_spiders_rule_requests_are_parked() -> None:
    """CrawlSpider's rule requests: its _callback, and lxml's str subclass as link text (which
    comes back as a str)."""

    class Rules(CrawlSpider):
        name = "rules"
        rules = (Rule(LinkExtractor(), callback="parse_item", follow=True),)

        def parse_item(self, response: object) -> None:
            pass

    spider = Rules()
    body = b'<a href="/a">first link</a> <a href="/b">second</a>'
    response = HtmlResponse("http://127.0.0.2/", body=body, encoding="utf-8")
    requests = [r for r in spider._requests_to_follow(response) if r is not None]
    assert len(requests) == 2
    for request in requests:
        back = decode_request(encode_request(request, spider), spider)
        assert back.callback == spider._callback
        assert back.meta == request.meta
        assert type(back.meta["link_text"]) is str


def test_a_callback_is_parked_under_the_name_of_its_spiders_class() -> None:
    """Request.to_dict() names the first attribute holding the method, maybe an alias set on
    the instance (which the reader refuses): the method's name in the class instead."""
    spider = CodecSpider()
    spider.a_alias = spider.parse_page  # type: ignore[attr-defined]
    # (Request.to_dict(spider=...) names it "a_alias", the first name in alphabetical order.)
    request = Request("http://127.0.0.2/", callback=spider.a_alias)  # type: ignore[attr-defined]
    back = decode_request(encode_request(request, spider), spider)
    assert back.callback == spider.parse_page
    with pytest.raises(Unparkable, match="its callback is no method of the spider"):
        encode_request(Request("http://127.0.0.2/", callback=spider.by_class), spider)


GOOD = {"url": "http://127.0.0.2/", "callback": "parse_page", "method": "GET"}


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        (pickle.dumps(Request("http://127.0.0.2/").to_dict()), "not JSON"),
        (b"\xff\xfe{", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # json's recursion
        (b"9" * 5000, "not JSON"),  # past Python's digits for an int
        (b"[]", "not an object"),
        (json.dumps({"method": "GET"}).encode(), "no http or https url"),
        (json.dumps({**GOOD, "url": 5}).encode(), "url is a int"),
        (json.dumps({**GOOD, "url": "file:///etc/passwd"}).encode(), "no http or https url"),
        (json.dumps({**GOOD, "url": "file://localhost/etc/passwd"}).encode(), "no http or https"),
        (json.dumps({**GOOD, "url": "no scheme"}).encode(), "no http or https url"),
        (json.dumps({**GOOD, "url": "http://"}).encode(), "URL with a host"),
        (json.dumps({**GOOD, "encoding": "nope"}).encode(), "no text encoding"),
        (json.dumps({**GOOD, "encoding": "hex"}).encode(), "no text encoding"),
        (json.dumps({**GOOD, "encoding": "rot13"}).encode(), "no text encoding"),
        (json.dumps({**GOOD, "encoding": "x" * 100}).encode(), "not a short string"),
        (
            json.dumps({**GOOD, "_class": "scrapy.http.JsonRequest", "dumps_kwargs": 5}).encode(),
            "AttributeError",
        ),
        (
            json.dumps({**GOOD, "_class": "concurrent.futures.ProcessPoolExecutor"}).encode(),
            "no request class",
        ),
        (json.dumps({**GOOD, "callback": "_set_crawler"}).encode(), "no method of the spider"),
        (json.dumps({**GOOD, "callback": "log"}).encode(), "no method of the spider"),
        (json.dumps({**GOOD, "callback": "start"}).encode(), "no method of the spider"),
        (
            json.dumps({**GOOD, "callback": "register"}).encode(),
            "no method of the spider",
        ),  # ABCMeta's
        (json.dumps({**GOOD, "url": "http://a.example/" + "x" * 9000}).encode(), "more than 8,192"),
        (json.dumps({**GOOD, "meta": {"big": "x" * (1 << 20)}}).encode(), "more than 1,048,576"),
        (json.dumps({**GOOD, "evil": 1}).encode(), "unknown fields ['evil']"),
        (json.dumps({**GOOD, "_class": "this.Request"}).encode(), "no request class"),
        (json.dumps({**GOOD, "_class": "os.system"}).encode(), "no request class"),
        (json.dumps({**GOOD, "_class": "scrapy.Spider"}).encode(), "no request class"),
        (json.dumps({**GOOD, "_class": ["x"]}).encode(), "_class is a list"),
        (json.dumps({**GOOD, "callback": "crawler"}).encode(), "no method of the spider"),
        (json.dumps({**GOOD, "callback": "__init__"}).encode(), "no method of the spider"),
        (json.dumps({**GOOD, "errback": "missing"}).encode(), "no method of the spider"),
        (json.dumps({**GOOD, "callback": 3}).encode(), "not a method name"),
        (json.dumps({**GOOD, "body": "!!"}).encode(), "body is not base64"),
        (json.dumps({**GOOD, "headers": {"a": "b"}}).encode(), "headers are not"),
        (json.dumps({**GOOD, "headers": [["a", ["€"]]]}).encode(), "no byte"),
        (json.dumps({**GOOD, "priority": 10**20}).encode(), "priority"),
        (json.dumps({**GOOD, "priority": True}).encode(), "priority"),
        (json.dumps({**GOOD, "dont_filter": "yes"}).encode(), "dont_filter is a str"),
        (json.dumps({**GOOD, "flags": [1]}).encode(), "flags are not"),
        (json.dumps({**GOOD, "meta": []}).encode(), "meta is a list"),
        (b'{"url": "http://127.0.0.2/", "meta": {"x": NaN}}', "meta['x'] is nan"),
        (b'{"url": "http://127.0.0.2/", "meta": {"x": 1e400}}', "meta['x'] is inf"),
        (json.dumps({**GOOD, "meta": {"d": nested(33)}}).encode(), "deeper than 32"),
        (json.dumps({**GOOD, "cookies": "a=b"}).encode(), "cookies are a str"),
    ],
)
def test_a_forged_parked_request_is_refused_saying_why(entry: bytes, reason: str) -> None:
    before = set(sys.modules)
    with pytest.raises(ValueError, match=re.escape(reason)):
        decode_request(entry, CodecSpider())
    imported = {name for name in set(sys.modules) - before if not name.startswith("encodings.")}
    assert imported == set(), "reading an entry imported a module (but Python's own codecs)"


@async_test
async def test_a_forged_parked_request_loses_none_taken_with_it(redis_server: RedisServer) -> None:
    """The parking set hands out due requests in batches (taken out of the set at once): one
    entry the reader refuses (an encoding Python has not, a pickle) is dropped alone."""
    spider = CodecSpider()
    stats = MemoryStatsCollector(get_crawler())
    store = RedisParking(
        connect_url(redis_server.url, {}, 1),
        "codec:parked",
        spider,
        Rejections(stats, dict),
        Clock(),
    )
    now = time.time()
    for n in range(3):
        ticket = Ticket(
            domain=A,
            due=asyncio.get_running_loop().time(),
            reserved=False,
            locally=False,
            reserved_at=now,
            waiting_since=now,
        )
        await store.park(Request(f"http://{A}/page/{n}", callback=spider.parse_page), ticket)
    with redis_server.client() as client:
        for body in (b'{"url": "http://a.example/x", "encoding": "nope"}', b"\x80\x04junk"):
            client.zadd("codec:parked", {parked_member(b"u", A, body): 0})
    try:
        due, _ = await store.unpark(ahead=60, limit=10)
    finally:
        await store.close(keep=False)
    assert sorted(request.url for request, _ in due) == [f"http://{A}/page/{n}" for n in range(3)]
    assert stats.get_value("redis_throttle/rejected/parked_request") == 2


@async_test
async def test_forged_parked_requests_are_dropped_never_run(
    redis_server: RedisServer, site: DemoSite, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries written into scrapy-redis's parking set by someone else, due at once, during a
    real crawl: dropped and counted; nothing unpickled, imported or called; the crawl goes on."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    marker = tmp_path / "unpickled"
    forged = [
        pickle.dumps(Touch(marker)),
        json.dumps({"url": site.url(A, "/forged"), "_class": "this.Request"}).encode(),
        json.dumps({"url": site.url(A, "/forged"), "callback": "crawler"}).encode(),
        b"{" * 50_000,
    ]
    with redis_server.client() as client:
        client.zadd(
            "url_list:requests:parked", {parked_member(b"u", A, body): 0 for body in forged}
        )
    crawler = await run_crawl(
        crawl_settings(redis_server.url, **SCRAPY_REDIS),
        [{"url": site.url(host, f"/page/{n}")} for host in (A, B) for n in range(4)],
        redis_throttle_rates={A: "20/s", B: "20/s"},
    )
    stats = crawler.stats.get_stats()
    assert not marker.exists(), "a pickle from Redis was run"
    assert "this" not in sys.modules, "an entry imported a module"
    assert stats["redis_throttle/rejected/parked_request"] == len(forged)
    assert stats.get("test/responses") == 8, "the crawl went on"
    assert [a.path for a in site.arrivals(A)].count("/forged") == 0
    no_redis_failure(stats)
    warnings = [r.getMessage() for r in caplog.records if "parking set" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "dropped it" in warnings[0]
    with redis_server.client() as client:
        assert client.zcard("url_list:requests:parked") == 0


@async_test
async def test_a_request_that_cannot_be_json_waits_in_the_downloader(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """With scrapy-redis's scheduler, a slow domain's requests carrying an Item in their meta:
    not parked (it would take pickle), but held until their moments: all crawled, paced."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    crawler = await run_crawl(
        crawl_settings(redis_server.url, REDIS_THROTTLE_MAX_HOLD=0.1, **SCRAPY_REDIS),
        [{"url": site.url(A, f"/page/{n}"), "meta": {"item": Product(name=n)}} for n in range(3)],
        redis_throttle_rates={A: "4/s"},
    )
    stats = crawler.stats.get_stats()
    assert (len(site.arrivals(A)), stats.get("test/responses")) == (3, 3)
    assert_released_paced(stats, site.arrivals(A), 4, 1, A)
    assert stats["redis_throttle/unparkable"] == 2, "the first went at once"
    assert "redis_throttle/parked" not in stats
    no_redis_failure(stats)
    warnings = [r.getMessage() for r in caplog.records if "cannot be parked" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "meta['item'] is a Product" in warnings[0]
