"""The circuit breaker and the local fallback buckets, on a clock the tests move."""

from __future__ import annotations

import asyncio

import pytest
from support import async_test

from scrapy_redis_throttle import resilience
from scrapy_redis_throttle.bucket import AcquireResult
from scrapy_redis_throttle.config import Limit
from scrapy_redis_throttle.resilience import CircuitBreaker, LocalBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_once_and_probes_with_a_growing_delay() -> None:
    clock = Clock()
    breaker = CircuitBreaker(first_delay=0.5, max_delay=3, clock=clock)
    assert breaker.open_for() is None
    assert breaker.failed() is True, "the first failure opens it"
    assert breaker.failed() is False, "calls already under way change nothing"
    assert [breaker.next_probe_in() for _ in range(5)] == [0.5, 1, 2, 3, 3]
    clock.now += 12.5
    assert breaker.open_for() == pytest.approx(12.5)
    assert breaker.succeeded() == pytest.approx(12.5)
    assert breaker.open_for() is None
    assert breaker.succeeded() is None
    assert breaker.failed() is True
    assert breaker.next_probe_in() == 0.5, "the delay starts again from the first one"


@async_test
async def test_breaker_wakes_its_waiters_when_it_closes() -> None:
    breaker = CircuitBreaker(first_delay=0.5, max_delay=3)
    await breaker.wait_closed()  # closed: no wait
    breaker.failed()
    waiters = [asyncio.ensure_future(breaker.wait_closed()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    breaker.succeeded()
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=5)


def test_local_buckets_pace_each_domain_at_its_share_of_the_rate() -> None:
    clock = Clock()
    local = LocalBuckets(workers=2, clock=clock)
    limit = Limit(rate=10, burst=1, text="10/s")  # 5/s for each of 2 workers: every 0.2 s
    first = local.acquire("a.example", limit, cost=1, reserve=0.5)
    assert first.allowed
    waits = [local.acquire("a.example", limit, 1, 0.5) for _ in range(3)]
    assert [w.reserved for w in waits] == [True, True, False]
    assert [w.retry_after for w in waits] == pytest.approx([0.2, 0.4, 0.6])
    assert local.busy_for("a.example") == pytest.approx(0.6)
    assert local.acquire("b.example", limit, 1, 0.5).allowed, "domains are independent"
    clock.now += 0.601
    assert local.acquire("a.example", limit, 1, 0.5).allowed


def test_local_buckets_start_where_the_shared_bucket_was() -> None:
    clock = Clock()
    local = LocalBuckets(workers=1, clock=clock)
    shared = AcquireResult(allowed=False, reserved=True, tokens_left=0, retry_after=0.9,
                           reset_after=1.0)  # fmt: skip
    local.follow("a.example", shared)
    result = local.acquire("a.example", Limit(10, 1, "10/s"), cost=1, reserve=5)
    assert result.retry_after == pytest.approx(1.0), "after the tokens Redis already gave out"


def test_local_buckets_forget_full_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resilience, "LOCAL_PRUNE_SIZE", 100)
    clock = Clock()
    local = LocalBuckets(workers=1, clock=clock)
    limit = Limit(1, 1, "1/s")
    for n in range(100):
        local.acquire(f"d{n}.example", limit, 1, 0)
    assert len(local) == 100
    clock.now += 1.5  # all full again
    local.acquire("new.example", limit, 1, 0)
    assert len(local) == 1
