"""Redis restarted empty (issue #36): the fleet's secret tells it (:mod:`.seals`), and every
moment reserved there before is lost: :meth:`.ResilientBucket.read_state` reads it,
:class:`.Turns` does not let a request go at such a moment, and :class:`.LocalBuckets` does not
tell the new buckets what it saw in the old ones. On a fake clock; tests/test_resilience.py runs
the whole sequence on a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeClock, MemoryScripts, Throttle, limit, refused_by_the_site, resilient_bucket
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.config import DEFAULT_FALLBACK_AFTER
from scrapy_redis_throttle.fallback import Source
from scrapy_redis_throttle.local_buckets import LocalBuckets
from scrapy_redis_throttle.pauses import CLOCK_MARGIN
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.replies import AcquireResult
from scrapy_redis_throttle.resilience import ResilientBucket
from scrapy_redis_throttle.seals import Seals
from scrapy_redis_throttle.tickets import Ticket

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
    await bucket.guard.read_state()  # the secret as it is at start
    before = clock.wall()
    await clock.advance(10)
    await bucket.guard.read_state()
    assert not bucket.lost(before), "the same secret: nothing lost"
    scripts.secret = b"t" * 64  # Redis restarted empty; a worker made a new one
    await clock.advance(10)
    await bucket.guard.read_state()
    read_at = clock.wall()
    assert stats.get_value("redis_throttle/state_lost") == 1
    assert bucket.lost(before)
    assert bucket.lost(read_at - 0.001)
    assert not bucket.lost(read_at), "reserved once it was read: in the new buckets"
    # Another process's wall clock may be ahead by up to CLOCK_MARGIN.
    assert bucket.lost(read_at + CLOCK_MARGIN / 2, elsewhere=True)
    assert not bucket.lost(read_at + CLOCK_MARGIN, elsewhere=True)
    await bucket.guard.read_state()
    assert stats.get_value("redis_throttle/state_lost") == 1, "read again: nothing new"


def test_after_redis_lost_its_state_nothing_seen_or_taken_before_is_told() -> None:
    """What a worker saw reserved in Redis, and what it took alone while Redis failed (placed
    after those), is void once Redis is known to have lost it all: told to the new buckets,
    it would hold them idle until then (issue #43: ~110 s, the old backlog's length). What
    went before is told as one bound instead (see the tests below)."""
    clock = FakeClock()
    local = LocalBuckets(clock)
    seen = AcquireResult(
        allowed=False, reserved=True, tokens_left=0.0, retry_after=100.0, reset_after=100.5
    )
    local.follow(A, seen)
    local.tell_again()
    assert local.acquire(A, TWO_PER_SECOND, 1, reserve=300, workers=2).reserved
    assert local.busy_until(A) == clock.now + 101.5
    local.lost()
    assert local.busy_until(A) == 0.0
    assert not local.seen(A)
    assert local.untold([A]) == {}


async def moment(clock: FakeClock, bucket: ResilientBucket, each: Limit) -> float:
    """The moment Redis gives a request of A, asking again while it is told to wait (the
    handover, a refusal), as a held request does."""
    while True:
        grant = await bucket.acquire(A, each, 1)
        result = grant.result
        if grant.shared and (result.allowed or result.reserved):
            return clock.now + result.retry_after
        assert result.paused or not grant.shared, f"Redis refused: {result}"
        await clock.sleep(result.retry_after)


async def send(clock: FakeClock, bucket: ResilientBucket, each: Limit, until: float) -> list[float]:
    """A worker's requests of A, two under way at a time, each going at its moment, until
    *until* (loop time): their moments."""
    sent: list[float] = []

    async def one_at_a_time() -> None:
        while clock.now < until:
            at = await moment(clock, bucket, each)
            await clock.sleep(at - clock.now)
            sent.append(at)

    await asyncio.gather(one_at_a_time(), one_at_a_time())
    return sent


async def fleet_of(clock: FakeClock, size: int) -> tuple[list[ResilientBucket], MemoryScripts]:
    """*size* workers on one Redis (the same scripts), each knowing the fleet's secret."""
    scripts = MemoryScripts(clock)
    workers = [resilient_bucket(clock, fleet=size, scripts=scripts)[0] for _ in range(size)]
    for bucket in workers:
        await bucket.guard.read_state()
    return workers, scripts


def restarted_empty(clock: FakeClock, scripts: MemoryScripts) -> None:
    """The scripts' Redis restarted empty: no bucket, and a new secret once a worker reads it."""
    scripts.bucket, scripts.secret, scripts.up = LocalBuckets(clock), b"t" * 64, True


@async_test
async def test_after_a_restart_the_fleet_resumes_within_a_second_at_the_limit() -> None:
    """Issue #43's stall: 3 workers, 5/s (burst 5), moments reserved in Redis ~110 s ahead,
    then Redis down (after REDIS_THROTTLE_FALLBACK_AFTER, each worker paces alone: its moments
    come after the backlog) and back empty. Each worker reads the loss (a probe, its listener)
    a little apart: the domain goes again within a second of the first read, at its limit, and
    the site never sees more than the limit across the restart."""
    clock = FakeClock()
    workers, scripts = await fleet_of(clock, 3)
    five = limit("5/s", burst=5)
    backlog = [await workers[n % 3].acquire(A, five, 1) for n in range(555)]
    moments = [clock.now + grant.result.retry_after for grant in backlog]
    assert moments[-1] - clock.now == pytest.approx(110, abs=0.5)
    scripts.up = False  # killed
    for bucket in workers:
        held = await bucket.acquire(A, five, 1)
        assert not held.shared
        assert held.source is Source.WAIT, "held: the outage may be its alone"
    await clock.advance(DEFAULT_FALLBACK_AFTER)
    for bucket in workers:
        alone = await bucket.acquire(A, five, 1)
        assert not alone.shared
        assert alone.result.retry_after > 100, "paced alone after the moments it saw"
    # Sent meanwhile: the moments Redis gave before it failed, which the workers still honour.
    before = [at for at in moments if at <= clock.now]
    restarted_empty(clock, scripts)
    lost_at = clock.now
    for bucket in workers:
        await bucket.guard.read_state()  # each reads the loss, 0.3 s apart
        await clock.advance(0.3)
        assert bucket.lost(lost_at - 1), "what was reserved before is lost"
    sends = await clock.run(
        asyncio.gather(*(send(clock, bucket, five, lost_at + 20) for bucket in workers))
    )
    after = sorted(at for each in sends for at in each)
    assert after[0] - lost_at <= 1.0, f"the first send {after[0] - lost_at:.2f} s after the loss"
    # At the limit from then on (each worker keeps to its share only for the handover).
    window = [at for at in after if lost_at + 1 <= at < lost_at + 20]
    assert len(window) >= 0.95 * 5 * 19, f"{len(window)} sends in 19 s at 5/s"
    assert refused_by_the_site(before + after, five) == []


@async_test
async def test_after_a_restart_one_worker_alone_takes_the_whole_budget_within_a_second() -> None:
    """The handover keeps each worker to its share while another may still pace alone: one
    probe interval (by default). In a fleet of 3 whose other workers have no request of A then,
    the one that has them is back at A's whole limit within a second of the restart. (With a
    handover of 5 s, it sent 15 in those 5 s; in tests/test_fleet_restart.py the 2/s host got
    1.50/s from 1.5 s to 9.5 s after the restart in 3 runs of 10.)"""
    clock = FakeClock()
    workers, scripts = await fleet_of(clock, 3)
    five = limit("5/s", burst=5)
    scripts.up = False
    for bucket in workers:
        assert not (await bucket.acquire(A, five, 1)).shared, "each one paces alone meanwhile"
    await clock.advance(3)
    restarted_empty(clock, scripts)
    back_at = clock.now
    for bucket in workers:
        await bucket.guard.read_state()
    sends = await clock.run(send(clock, workers[0], five, back_at + 6))
    window = [at for at in sends if back_at + 1 <= at < back_at + 6]
    assert len(window) >= 0.95 * 5 * 5, f"{len(window)} sends from 1 s to 6 s after, at 5/s"


@pytest.mark.parametrize("outage", [False, True], ids=["restart-unseen", "restart-after-outage"])
@async_test
async def test_six_workers_at_8_per_second_keep_the_limit_across_a_restart(outage: bool) -> None:
    """Issue #43's burst at the restart: 6 workers at 8/s (burst 8) drain the site's bucket,
    then Redis restarts empty, between two calls of theirs or after an outage they saw. The
    new bucket counts as drained when each worker read the loss: no send comes closer to the
    ones before than the limit allows (the one request's time told before let 7 go at once)."""
    clock = FakeClock()
    workers, scripts = await fleet_of(clock, 6)
    eight = limit("8/s", burst=8)
    sends = await clock.run(
        asyncio.gather(*(send(clock, bucket, eight, clock.now + 5) for bucket in workers))
    )
    before = [at for each in sends for at in each]
    if outage:
        scripts.up = False
        for bucket in workers:
            assert not (await bucket.acquire(A, eight, 1)).shared
        await clock.advance(2)
        before += [clock.now]  # the moment each worker took alone went (one is enough here)
    restarted_empty(clock, scripts)
    for bucket in workers:
        await bucket.guard.read_state()
        await clock.advance(0.05)
    lost_at = clock.now
    sends = await clock.run(
        asyncio.gather(*(send(clock, bucket, eight, lost_at + 5) for bucket in workers))
    )
    after = [at for each in sends for at in each]
    refused = refused_by_the_site(before + after, eight)
    assert refused == [], f"{len(refused)} sends over 8/s, the first {refused[0] - lost_at:.3f} s"


@async_test
async def test_a_request_does_not_go_at_a_moment_redis_lost() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    await throttle.restart_redis_empty()
    held = Ticket(
        domain=A,
        due=now,
        reserved=True,
        locally=False,
        reserved_at=wall - 5,
        waiting_since=wall - 5,
        elsewhere=True,
    )
    assert await throttle.take(Request(f"http://{A}/1"), TWO_PER_SECOND, held) is None
    assert throttle.stat("lost_reservations") == 1
    assert len(throttle.scripts.calls) == 1, "asked anew"
    fresh = Ticket(
        domain=A,
        due=throttle.clock.now,
        reserved=True,
        locally=False,
        reserved_at=wall,
        waiting_since=wall,
        elsewhere=True,
    )
    await throttle.clock.advance(1)
    assert await throttle.take(Request(f"http://{A}/2"), TWO_PER_SECOND, fresh) is None
    assert throttle.stat("lost_reservations") == 1, "reserved after the loss was read"


@async_test
async def test_a_moment_taken_alone_before_redis_lost_its_state_is_lost_with_it() -> None:
    """Taken alone while Redis failed, it was placed after the moments this worker saw there,
    which are no more: the request asks the new bucket instead of going then."""
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    await throttle.restart_redis_empty()
    local = Ticket(
        domain=A, due=now, reserved=True, locally=True, reserved_at=wall - 5, waiting_since=wall - 5
    )
    assert await throttle.take(Request(f"http://{A}/1"), TWO_PER_SECOND, local) is None
    assert throttle.stat("lost_reservations") == 1
    assert len(throttle.scripts.calls) == 1, "asked anew"
    after = Ticket(
        domain=A,
        due=throttle.clock.now,
        reserved=True,
        locally=True,
        reserved_at=wall,
        waiting_since=wall,
    )
    await throttle.clock.advance(1)
    assert await throttle.take(Request(f"http://{A}/2"), TWO_PER_SECOND, after) is None
    assert throttle.stat("lost_reservations") == 1, "taken alone after the loss was read"


@async_test
async def test_a_worker_that_reads_redis_lost_its_state_keeps_to_its_share_a_while() -> None:
    """Redis restarted: down for every worker, whether or not this one called it then (its
    requests all held their moments). Another worker may still pace alone until its probe:
    this one keeps to its share for REDIS_THROTTLE_PROBE_INTERVAL, as after an outage it saw."""
    clock = FakeClock()
    bucket, scripts, _ = resilient_bucket(clock, REDIS_THROTTLE_PROBE_INTERVAL=2)
    await bucket.guard.read_state()  # the secret as it is at start
    scripts.secret = b"t" * 64
    await bucket.guard.read_state()
    first = await bucket.acquire(A, limit("10/s"), 1)  # a share of 5/s, burst 1: now
    second = await bucket.acquire(A, limit("10/s"), 1)
    assert first.shared
    assert second.source is Source.HANDOVER
    assert second.result.retry_after == pytest.approx(0.2)
    await clock.advance(2.0)
    assert (await bucket.acquire(A, limit("10/s"), 1)).source is not Source.HANDOVER
    await bucket.aclose()


@async_test
async def test_redis_that_answers_the_state_read_is_back() -> None:
    """A worker whose breaker is open reads the state (its pauses' listener subscribed again, a
    request is about to go at its moment): Redis answers, so the breaker closes then, not at
    the next probe. Meanwhile this worker would pace alone from a view of the buckets that may
    be void (cleared, when Redis lost them: a burst at once, beside the others' moments)."""
    clock = FakeClock()
    bucket, scripts, stats = resilient_bucket(clock)
    await bucket.guard.read_state()  # the secret as it is at start
    scripts.up = False
    assert not (await bucket.acquire(A, TWO_PER_SECOND, 1)).shared
    assert bucket.breaker.open_for() is not None
    scripts.up = True
    await bucket.guard.read_state()
    assert bucket.breaker.open_for() is None
    assert stats.get_value("redis_throttle/outages") == 1
    await bucket.aclose()
