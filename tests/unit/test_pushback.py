"""What a worker does when a site pushes back (:class:`.Pushback`): a 429 or 503 pauses its domain
for the fleet, for its Retry-After or the backoff, or for this worker alone while Redis is
unavailable; with the adaptive rate on, a new pause or a download timeout lowers the domain's
rate. The fleet's answers (Redis's penalty and slow-down scripts) come from a stand-in that
records each call, and so do the pauses this worker holds; its budgets and stats are the real
ones, on a fake clock."""

from __future__ import annotations

import logging
from email.utils import formatdate
from typing import Any

import pytest
from fakes import FakeClock, limit, stats, throttle_config
from scrapy import Request, exceptions
from scrapy.http import Response
from scrapy.utils.test import get_crawler
from support import async_test
from twisted.internet.error import TCPTimedOutError
from twisted.internet.error import TimeoutError as TwistedTimeoutError

from scrapy_redis_throttle.budgets import Budgets
from scrapy_redis_throttle.crawl_delay import CrawlDelays
from scrapy_redis_throttle.domains import Domains
from scrapy_redis_throttle.metrics import RETRY_AFTER, ThrottleMetrics
from scrapy_redis_throttle.pushback import Pushback
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.rejections import Rejections
from scrapy_redis_throttle.replies import Penalty, SlowDown
from scrapy_redis_throttle.waiting import SENT_META

A = "a.example"
ONE_PER_SECOND = limit("1/s")  # REDIS_THROTTLE_DEFAULT_RATE's
AT_US = 123_456_789.0  # when Redis decided, by its clock


class FleetBucket:
    """Stands for :class:`.ResilientBucket`'s calls that tell the fleet of a failure: each call
    is recorded, and answered by the next of :attr:`penalties` and :attr:`slowdowns` (None:
    Redis could not be told; with none left, None)."""

    def __init__(self) -> None:
        self.penalized: list[tuple[str, Limit, float | None]] = []
        self.slowed: list[tuple[str, Limit, float, float]] = []
        self.penalties: list[Penalty | None] = []
        self.slowdowns: list[SlowDown | None] = []

    async def penalize(self, domain: str, each: Limit, retry_after: float | None) -> Penalty | None:
        self.penalized.append((domain, each, retry_after))
        return self.penalties.pop(0) if self.penalties else None

    async def slow_down(
        self, domain: str, each: Limit, age: float, hold: float = 0
    ) -> SlowDown | None:
        self.slowed.append((domain, each, age, hold))
        return self.slowdowns.pop(0) if self.slowdowns else None


class HeldPauses:
    """Stands for :class:`.Pauses`: the voidings this worker is asked to hold, each as (domain,
    when it ends on the fake clock, Redis's moment of it, whether it is a pause)."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.held: list[tuple[str, float, float | None, bool]] = []

    def pause(
        self,
        domain: str,
        seconds: float,
        age: float = 0.0,
        at_us: float | None = None,
        holds: bool = True,
    ) -> None:
        assert age == 0.0, "Pushback's pauses start now"
        self.held.append((domain, self._clock.monotonic() + seconds, at_us, holds))


class Worker:
    """One worker's :class:`.Pushback`, as the throttle builds it, with *settings*."""

    def __init__(self, **settings: Any) -> None:
        self.clock = FakeClock()
        self.config = throttle_config(**settings)
        self.stats = stats()
        self.fleet = FleetBucket()
        self.metrics = ThrottleMetrics(on=True)
        self.pauses = HeldPauses(self.clock)
        rejections = Rejections(self.stats, dict)
        domains = Domains(
            self.config.scope, self.stats, self.config.crawl.dns_timeout, self.config.other_scopes
        )
        crawl_delays = CrawlDelays(get_crawler(), self.config, rejections, dict, domains)
        self.pushback = Pushback(
            self.config,
            Budgets(self.config, domains, crawl_delays),
            self.fleet,  # type: ignore[arg-type]
            self.pauses,  # type: ignore[arg-type]
            rejections,
            self.stats,
            self.metrics,
            dict,
            self.clock,
        )

    def stat(self, name: str) -> Any:
        return self.stats.get_value(f"redis_throttle/{name}")

    def pause_reasons(self) -> dict[str, int]:
        """The pauses counted in the metrics, by reason (whatever the domain's label)."""
        reasons: dict[str, int] = {}
        for series in self.metrics.snapshot().series.values():
            for reason, count in series.pauses.items():
                reasons[reason] = reasons.get(reason, 0) + count
        return reasons

    def paused_until(self) -> list[tuple[str, float, float | None, bool]]:
        """The voidings this worker holds: domain, end (loop time), Redis's moment and
        whether it is a pause."""
        return self.pauses.held

    async def answer(
        self, status: int, headers: dict[str, str] | None = None, meta: dict[str, Any] | None = None
    ) -> Response:
        request = Request(f"http://{A}/page", meta=meta)
        response = Response(request.url, status=status, headers=headers, request=request)
        return await self.pushback.response(request, response)


def penalty(pause: float, changed: bool = True) -> Penalty:
    return Penalty(changed=changed, pause=pause, strikes=1, at_us=AT_US)


def http_date(wall: float) -> str:
    return formatdate(wall, usegmt=True)


@async_test
async def test_a_429_pauses_its_domain_for_the_fleet_for_its_retry_after() -> None:
    """A 429's Retry-After goes to the fleet's penalty; the worker holds the pause Redis decided."""
    worker = Worker()
    worker.fleet.penalties.append(penalty(30.0))
    response = await worker.answer(429, {"Retry-After": "30"})
    assert response.status == 429, "the response goes on, to RetryMiddleware"
    assert worker.fleet.penalized == [(A, ONE_PER_SECOND, 30.0)]
    assert worker.paused_until() == [(A, worker.clock.now + 30.0, AT_US, True)]
    assert worker.stat("penalties/429") == 1
    assert worker.stat("pauses") == 1
    assert worker.stat("pause_max") == 30.0
    assert worker.pause_reasons() == {RETRY_AFTER: 1}


@async_test
async def test_a_retry_after_date_counts_from_the_response_s_date_else_the_clock() -> None:
    """An HTTP-date Retry-After counts from the response's Date, else from the worker's clock."""
    worker = Worker()
    site_now = worker.clock.wall() - 1000
    await worker.answer(429, {"Retry-After": http_date(site_now + 45), "Date": http_date(site_now)})
    await worker.answer(429, {"Retry-After": http_date(worker.clock.wall() + 20)})
    assert [retry_after for _, _, retry_after in worker.fleet.penalized] == [45.0, 20.0]


@async_test
async def test_an_unreadable_retry_after_is_counted_and_the_domain_paused_as_without_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unreadable Retry-After is rejected, counted and logged; the pause is as without one."""
    worker = Worker()
    worker.fleet.penalties.append(penalty(2.0))
    await worker.answer(429, {"Retry-After": "soon"})
    assert worker.fleet.penalized == [(A, ONE_PER_SECOND, None)]
    assert worker.stat("rejected/retry_after") == 1
    assert worker.pause_reasons() == {"429": 1}
    assert any("'soon'" in r.getMessage() and "paused as without one" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)  # fmt: skip


@async_test
async def test_a_503_pauses_its_domain_as_a_429_does() -> None:
    """A 503 (a default penalty code) pauses its domain, counted under its status."""
    worker = Worker()
    worker.fleet.penalties.append(penalty(2.0))
    await worker.answer(503)
    assert worker.fleet.penalized == [(A, ONE_PER_SECOND, None)]
    assert worker.stat("penalties/503") == 1
    assert worker.pause_reasons() == {"503": 1}


@pytest.mark.parametrize(
    ("status", "settings"),
    [
        (500, {}),  # not a default penalty code
        (404, {}),
        (429, {"REDIS_THROTTLE_PENALTY_HTTP_CODES": [503]}),  # the project's codes only
    ],
)
@async_test
async def test_a_status_not_among_the_penalty_codes_changes_nothing(
    status: int, settings: dict[str, Any]
) -> None:
    """A status outside REDIS_THROTTLE_PENALTY_HTTP_CODES passes untouched: no penalty, no stat."""
    worker = Worker(**settings)
    await worker.answer(status, {"Retry-After": "30"})
    assert worker.fleet.penalized == []
    assert worker.paused_until() == []
    assert worker.stats.get_stats() == {}


@pytest.mark.parametrize(
    ("meta", "settings"),
    [
        ({"dont_redis_throttle": True}, {}),
        ({"redis_throttle_penalty": False}, {}),
        ({}, {"REDIS_THROTTLE_DEFAULT_RATE": None}),  # its domain is unthrottled
    ],
)
@async_test
async def test_a_429_to_an_unthrottled_or_opted_out_request_pauses_nothing(
    meta: dict[str, Any], settings: dict[str, Any]
) -> None:
    """A 429 that counts against no limit (opted out, unthrottled domain) penalizes nothing."""
    worker = Worker(**settings)
    await worker.answer(429, {"Retry-After": "30"}, meta)
    assert worker.fleet.penalized == []
    assert worker.paused_until() == []
    assert worker.stat("penalties/429") is None


@async_test
async def test_without_redis_the_worker_pauses_alone_for_at_most_max_pause() -> None:
    """Without Redis the worker pauses alone: Retry-After up to MAX_PAUSE, else the backoff."""
    worker = Worker(
        REDIS_THROTTLE_MAX_PAUSE=100,
        REDIS_THROTTLE_PENALTY_BACKOFF=3,
        REDIS_THROTTLE_ADAPTIVE_ENABLED=True,
    )
    now = worker.clock.now
    await worker.answer(429, {"Retry-After": "5000"})
    await worker.answer(429)
    assert worker.paused_until() == [(A, now + 100.0, None, True), (A, now + 3.0, None, True)]
    assert worker.stat("pauses") is None, "the fleet's pauses only"
    assert worker.stat("penalties/429") == 2
    assert worker.pause_reasons() == {RETRY_AFTER: 1, "429": 1}
    assert worker.fleet.slowed == []


@async_test
async def test_an_answer_to_a_request_sent_before_the_pause_adds_nothing() -> None:
    """A penalty that changed nothing is held, but neither counted as a pause nor slows the rate."""
    worker = Worker(REDIS_THROTTLE_ADAPTIVE_ENABLED=True)
    worker.fleet.penalties.append(penalty(12.0, changed=False))
    await worker.answer(429)
    assert worker.paused_until() == [(A, worker.clock.now + 12.0, AT_US, True)]
    assert worker.stat("pauses") is None
    assert worker.pause_reasons() == {}
    assert worker.fleet.slowed == []


@async_test
async def test_a_new_pause_lowers_the_adaptive_rate_held_for_the_pause() -> None:
    """A new pause lowers the adaptive rate, held for the pause; its voiding is held too, as
    no pause."""
    worker = Worker(REDIS_THROTTLE_ADAPTIVE_ENABLED=True)
    worker.fleet.penalties.append(penalty(8.0))
    lowered = SlowDown(lowered=True, rate=0.5, back_in=600.0, void=4.0, at_us=AT_US + 1)
    worker.fleet.slowdowns.append(lowered)
    sent_at = worker.clock.now
    worker.clock.now += 2.0
    await worker.answer(503, meta={SENT_META: sent_at})
    assert worker.fleet.slowed == [(A, ONE_PER_SECOND, 2.0, 8.0)]
    now = worker.clock.now
    assert worker.paused_until() == [
        (A, now + 8.0, AT_US, True),
        (A, now + 4.0, AT_US + 1, False),
    ], "the decrease voids the moments reserved before it, and holds nothing"
    assert worker.stat("adaptive/lowered") == 1


def timeout_errors() -> list[Exception]:
    """What a download timeout raises: Scrapy's error since 2.19, Twisted's before, and a TCP
    connect's."""
    kinds: list[type[Exception]] = [TwistedTimeoutError, TCPTimedOutError]
    kinds += [getattr(exceptions, "DownloadTimeoutError", TwistedTimeoutError)]
    return [kind() for kind in kinds]


@pytest.mark.parametrize("timeout", timeout_errors(), ids=lambda error: type(error).__name__)
@async_test
async def test_a_download_timeout_lowers_the_adaptive_rate_for_the_fleet(
    timeout: Exception,
) -> None:
    """A download timeout slows its domain down (adaptive on); a no-op slow-down voids nothing."""
    worker = Worker(REDIS_THROTTLE_ADAPTIVE_ENABLED=True)
    request = Request(f"http://{A}/page", meta={SENT_META: worker.clock.now})
    worker.clock.now += 5.0
    unchanged = SlowDown(lowered=False, rate=1.0, back_in=0.0, void=0.0, at_us=AT_US)
    worker.fleet.slowdowns.append(unchanged)
    await worker.pushback.exception(request, timeout)
    assert worker.fleet.slowed == [(A, ONE_PER_SECOND, 5.0, 0)]
    assert worker.stat("adaptive/timeouts") == 1
    assert worker.stat("adaptive/lowered") is None
    assert worker.paused_until() == []


@async_test
async def test_a_timeout_with_the_adaptive_rate_off_or_another_failure_asks_nothing() -> None:
    """Only a download timeout, and only with the adaptive rate on, asks the fleet to slow down."""
    request = Request(f"http://{A}/page")
    off = Worker()
    await off.pushback.exception(request, timeout_errors()[0])
    on = Worker(REDIS_THROTTLE_ADAPTIVE_ENABLED=True)
    await on.pushback.exception(request, ConnectionRefusedError())
    await on.pushback.exception(request, ValueError("not a download failure"))
    for worker in (off, on):
        assert worker.fleet.slowed == []
        assert worker.stat("adaptive/timeouts") is None
