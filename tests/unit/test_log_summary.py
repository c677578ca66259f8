"""The log's summary while the fleet runs (:mod:`.log_summary`): one INFO line every
REDIS_THROTTLE_LOG_INTERVAL on the busiest domains, bounded whatever their number."""

from __future__ import annotations

import logging

import pytest
from fakes import Throttle, limit
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.live_limits import LiveLimit
from scrapy_redis_throttle.log_summary import DOMAINS_SHOWN, DomainLine, summary_line
from scrapy_redis_throttle.rates import parse_limit
from scrapy_redis_throttle.replies import AcquireResult, Reservation

A = "a.example"


def reserved(step: int, reset_after: float) -> AcquireResult:
    """Redis's answer to a request reserved 0.2 s ahead, whose tokens added *step* µs to the
    bucket (the interval Redis paced it at, see :func:`.waiting._rate_in_force`)."""
    return AcquireResult(
        allowed=False,
        reserved=True,
        tokens_left=0.0,
        retry_after=0.2,
        reset_after=reset_after,
        reservation=Reservation(after=2_000_000, step=step, at=1_000_000),
    )


def line(domain: str, sent: int, waiting: int = 0) -> DomainLine:
    return DomainLine(domain, "1/s (burst 1)", None, 0.0, sent, waiting, 0.5)


def test_the_busiest_domains_are_named_and_the_others_added_up() -> None:
    lines = [line(f"d{n}.example", sent=n, waiting=1) for n in range(DOMAINS_SHOWN + 5)]
    text = summary_line(lines)
    named = [part.split(" ", 1)[0] for part in text.split("; ")[:DOMAINS_SHOWN]]
    assert named == [f"d{n}.example" for n in range(DOMAINS_SHOWN + 4, 4, -1)], "busiest first"
    assert text.endswith("; and 5 more domains: 10 sent, 5 waiting"), text


def test_a_line_says_the_limit_the_pause_the_counts_and_the_longest_wait() -> None:
    paused = DomainLine(A, "2/s", None, 12.4, 30, 4, 3.25)
    assert str(paused) == f"{A} 2/s, paused 12 s: 30 sent, 4 waiting, longest wait 3.2 s"
    live = DomainLine(A, "1/s in force (2/s configured)", LiveLimit(1, None, False), 0, 1, 0, 0)
    assert str(live).startswith(f"{A} 1/s in force (2/s configured), set live: 1 sent")
    paused_live = DomainLine(A, "2/s", LiveLimit(None, None, True), 0, 0, 3, 0)
    assert str(paused_live).startswith(f"{A} 2/s, paused live: 0 sent, 3 waiting")


@async_test
async def test_a_worker_s_domains_as_it_sent_them() -> None:
    """Sent over the last minute, the longest wait since the last line, the configured limit
    when Redis told no other, and the pause under way."""
    throttle = Throttle()
    two = limit("2/s")
    for n in range(3):  # at 0, 0.5 and 1 s
        assert await throttle.take(Request(f"http://{A}/{n}"), two) is None
    throttle.pauses.pause(A, 30.0)
    [only] = throttle.throttle.log_summary.lines()
    assert (only.domain, only.sent, only.waiting) == (A, 3, 0)
    assert only.longest == pytest.approx(0.5)
    assert only.paused == pytest.approx(30.0)
    assert only.limit == str(two)
    await throttle.clock.advance(61)
    assert throttle.throttle.log_summary.lines() == [], "a minute later: nothing to say"


@async_test
async def test_the_limit_in_force_is_the_one_redis_paced_at() -> None:
    """An adaptive rate (or any rate Redis paced at) shows as the rate of the last request's
    reservation: 1/s where the workers' own is 2/s."""
    throttle = Throttle()
    throttle.scripts.answers.append(reserved(step=1_000_000, reset_after=1.2))  # one a second
    await throttle.take(Request(f"http://{A}/"), limit("2/s"))
    [only] = throttle.throttle.log_summary.lines()
    assert only.limit == "1/s in force (2/s (burst 1) configured)"


@async_test
async def test_the_summary_is_logged_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    throttle = Throttle(REDIS_THROTTLE_LOG_INTERVAL=60)
    summary = throttle.throttle.log_summary
    summary.start()
    await throttle.take(Request(f"http://{A}/"), limit("2/s"))
    await throttle.clock.advance(60)
    await summary.stop()
    [logged] = [r.getMessage() for r in caplog.records if "sent" in r.getMessage()]
    assert logged.startswith(f"Redis throttle: {A} 2/s (burst 1): 1 sent, 0 waiting"), logged


@async_test
async def test_an_interval_of_0_logs_nothing_and_keeps_no_wait() -> None:
    throttle = Throttle(REDIS_THROTTLE_LOG_INTERVAL=0, REDIS_THROTTLE_REPORT_INTERVAL=0)
    throttle.throttle.log_summary.start()
    await throttle.take(Request(f"http://{A}/"), limit("2/s"))
    assert throttle.throttle.log_summary.lines() == []


@async_test
async def test_a_limit_with_quotas_paced_at_its_bucket_s_rate_is_the_configured_one() -> None:
    """The reservation's step is the token bucket's: 2/s with a quota of 15 per 10 s is not
    another limit in force."""
    throttle = Throttle()
    quota = parse_limit(
        [{"rate": "2/s", "burst": 3}, {"rate": "15/10s", "algorithm": "sliding_window"}],
        default_burst=1,
        source="test",
    )
    assert quota is not None
    throttle.scripts.answers.append(reserved(step=500_000, reset_after=0.7))
    await throttle.take(Request(f"http://{A}/"), quota)
    [only] = throttle.throttle.log_summary.lines()
    assert only.limit == str(quota)
