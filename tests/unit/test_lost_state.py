"""Redis restarted empty (issue #36): the fleet's secret tells it (:mod:`.seals`), and every
moment reserved there before is lost: :meth:`.ResilientBucket.check_state` reads it,
:class:`.Turns` does not let a request go at such a moment, and :class:`.LocalBuckets` does not
tell the new buckets what it saw in the old ones. On a fake clock; tests/test_resilience.py runs
the whole sequence on a real Redis."""

from __future__ import annotations

import pytest
from fakes import FakeClock, Throttle, limit, resilient_bucket
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.bucket import AcquireResult
from scrapy_redis_throttle.local_buckets import LocalBuckets
from scrapy_redis_throttle.penalties import CLOCK_MARGIN
from scrapy_redis_throttle.seals import Seals
from scrapy_redis_throttle.tickets import Ticket
from scrapy_redis_throttle.waiting import WENT

A, B = "a.example", "b.example"
TWO_PER_SECOND = limit("2/s")


def test_a_new_secret_replaces_the_known_one_and_its_seals_are_told_apart() -> None:
    seals = Seals()
    assert seals.know(b"1" * 64) is False, "the first one known replaces none"
    sealed = seals.seal(b"message")
    assert seals.know(b"1" * 64) is False, "the same one again"
    assert seals.check(b"message", sealed)
    assert seals.know(b"2" * 64) is True
    assert not seals.check(b"message", sealed)
    assert seals.sealed_before(b"message", sealed)
    assert not seals.sealed_before(b"another message", sealed)
    seals.know(b"3" * 64)
    assert not seals.sealed_before(b"message", sealed), "only the one just before is kept"


@async_test
async def test_a_new_secret_loses_every_moment_reserved_before_it_was_read() -> None:
    clock = FakeClock()
    bucket, scripts, stats = resilient_bucket(clock)
    await bucket.check_state()  # the secret as it is at start
    before = clock.wall()
    await clock.advance(10)
    await bucket.check_state()
    assert not bucket.lost(before), "the same secret: nothing lost"
    scripts.secret = b"t" * 64  # Redis restarted empty; a worker made a new one
    await clock.advance(10)
    await bucket.check_state()
    read_at = clock.wall()
    assert stats.get_value("redis_throttle/state_lost") == 1
    assert bucket.lost(before)
    assert bucket.lost(read_at - 0.001)
    assert not bucket.lost(read_at), "reserved once it was read: in the new buckets"
    # Another process's wall clock may be ahead by up to CLOCK_MARGIN.
    assert bucket.lost(read_at + CLOCK_MARGIN / 2, elsewhere=True)
    assert not bucket.lost(read_at + CLOCK_MARGIN, elsewhere=True)
    await bucket.check_state()
    assert stats.get_value("redis_throttle/state_lost") == 1, "read again: nothing new"


def test_after_redis_lost_its_state_only_what_still_holds_is_told() -> None:
    """What a worker saw reserved in Redis when it failed is told again once it is back (a
    replica that had not caught up may have lost it): not once Redis is known to have lost it
    all, whose requests ask anew; the new bucket would stand idle until then. Only the moment
    that may have gone just now counts, for one request's time (else a new grant at once, 184
    ms after it at 2/s: a 429 in 1 of 10 runs of tests/test_fleet_faults.py). What it took alone
    meanwhile is told: those requests go."""
    clock = FakeClock()
    local = LocalBuckets(clock.monotonic)
    seen = AcquireResult(False, True, 0.0, retry_after=100.0, reset_after=100.5)
    local.follow(A, TWO_PER_SECOND, seen)
    local.follow(B, TWO_PER_SECOND, seen)
    local.tell_again()
    taken = local.acquire(B, TWO_PER_SECOND, 1, reserve=300, workers=2)
    assert taken.reserved
    assert local.busy_until(A) == clock.now + 100.5
    local.told(local.untold([B]))  # told to Redis before it lost it
    local.lost()
    assert local.busy_until(A) == clock.now + 0.5, "one request's time at 2/s"
    assert local.busy_until(B) == clock.now + 100.5 + 1.0, "after the seen ones, as taken"
    assert list(local.untold([A, B])) == [A, B], "told, to the Redis that lost them"


@async_test
async def test_a_request_does_not_go_at_a_moment_redis_lost() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    throttle.bucket.lost_at = wall - 1
    held = Ticket(A, now, True, False, wall - 5, wall - 5, elsewhere=True)
    assert await throttle.take(Request(f"http://{A}/1"), TWO_PER_SECOND, held) is WENT
    assert throttle.stat("lost_reservations") == 1
    assert len(throttle.bucket.calls) == 1, "asked anew"
    fresh = Ticket(A, throttle.clock.now, True, False, wall, wall, elsewhere=True)
    await throttle.clock.advance(1)
    assert await throttle.take(Request(f"http://{A}/2"), TWO_PER_SECOND, fresh) is WENT
    assert throttle.stat("lost_reservations") == 1, "reserved after the loss was read"


@async_test
async def test_a_moment_taken_alone_while_redis_failed_is_not_lost_with_it() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    throttle.bucket.lost_at = wall - 1
    local = Ticket(A, now, True, True, wall - 5, wall - 5)
    assert await throttle.take(Request(f"http://{A}/1"), TWO_PER_SECOND, local) is WENT
    assert throttle.stat("lost_reservations") is None
    assert throttle.bucket.calls == []


@async_test
async def test_a_worker_that_reads_redis_lost_its_state_keeps_to_its_share_a_while() -> None:
    """Redis restarted: down for every worker, whether or not this one called it then (its
    requests all held their moments). Another worker may still pace alone until its probe:
    this one keeps to its share for REDIS_THROTTLE_PROBE_INTERVAL, as after an outage it saw."""
    clock = FakeClock()
    bucket, scripts, _ = resilient_bucket(clock, REDIS_THROTTLE_PROBE_INTERVAL=2)
    await bucket.check_state()  # the secret as it is at start
    scripts.secret = b"t" * 64
    await bucket.check_state()
    first = await bucket.acquire(A, limit("10/s"), 1)  # a share of 5/s, burst 1: now
    second = await bucket.acquire(A, limit("10/s"), 1)
    assert first.shared
    assert second.handover
    assert second.result.retry_after == pytest.approx(0.2)
    await clock.advance(2.0)
    assert not (await bucket.acquire(A, limit("10/s"), 1)).handover
    await bucket.aclose()


@async_test
async def test_redis_that_answers_the_state_read_is_back() -> None:
    """A worker whose breaker is open reads the state (its pauses' listener subscribed again, a
    request is about to go at its moment): Redis answers, so the breaker closes then, not at
    the next probe. Meanwhile this worker would pace alone from a view of the buckets that may
    be void (cleared, when Redis lost them: a burst at once, beside the others' moments)."""
    clock = FakeClock()
    bucket, scripts, stats = resilient_bucket(clock)
    await bucket.check_state()  # the secret as it is at start
    scripts.up = False
    assert not (await bucket.acquire(A, TWO_PER_SECOND, 1)).shared
    assert bucket.breaker.open_for() is not None
    scripts.up = True
    await bucket.check_state()
    assert bucket.breaker.open_for() is None
    assert stats.get_value("redis_throttle/outages") == 1
    await bucket.aclose()
