"""What the throttle decides while Redis fails (:mod:`.resilience`, :mod:`.fallback`): the breaker and its probe,
each worker's share of the rates, the other policies, and the handover back to Redis; on a
fake clock and a stand-in for the scripts' calls that fails when told to."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakeClock, limit, resilient_bucket
from support import async_test

from scrapy_redis_throttle import local_buckets
from scrapy_redis_throttle.breaker import CircuitBreaker
from scrapy_redis_throttle.budgets import Budget
from scrapy_redis_throttle.config import (
    DEFAULT_FALLBACK_AFTER,
    DEFAULT_MAX_HOLD,
    FALLBACK_LOCAL,
    FALLBACK_OPEN,
    FALLBACK_WAIT,
)
from scrapy_redis_throttle.fallback import WAIT_FOR_REDIS, Source
from scrapy_redis_throttle.live_limits import LiveLimit
from scrapy_redis_throttle.local_buckets import LocalBuckets
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.replies import AcquireResult
from scrapy_redis_throttle.resilience import FIRST_PROBE_DELAY, ResilientBucket

A = "a.example"
TEN_PER_SECOND = limit("10/s")
# Redis's answer that leaves a bucket full: the fallback has seen it.
FULL = AcquireResult(allowed=True, reserved=False, tokens_left=1, retry_after=0, reset_after=0)


def seen(bucket: ResilientBucket, domain: str = A) -> None:
    """As if *bucket* had called Redis for *domain*, whose bucket was full then."""
    bucket.fallback.local.follow(domain, FULL)


def test_breaker_opens_once_and_probes_with_a_growing_delay() -> None:
    clock = FakeClock()
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


def test_local_pacing_takes_every_scope_s_share_at_the_latest_moment() -> None:
    """While Redis fails, the "local" policy paces each budget at its share of the fleet's
    rate, as lua/token_bucket.lua does in Redis: the request's moment is the latest of them."""
    clock = FakeClock()
    local = LocalBuckets(clock)
    site, host = Limit(rate=4, burst=1, text="4/s"), Limit(rate=1, burst=1, text="1/s")
    others = [Budget("img.shop.com", host)]
    assert local.acquire("shop.com", site, 1, reserve=10, workers=2, others=others).allowed
    second = local.acquire("shop.com", site, 1, reserve=10, workers=2, others=others)
    assert second.reserved
    assert second.retry_after == pytest.approx(2.0), "the host's share: 1/s over 2 workers"
    assert local.busy_until("shop.com") == pytest.approx(clock.now + 2.5), "counted then"
    refused = local.acquire("shop.com", site, 1, reserve=1, workers=2, others=others)
    assert not refused.allowed
    assert not refused.reserved
    assert local.busy_until("img.shop.com") == pytest.approx(clock.now + 4.0), "nothing taken"


@async_test
async def test_breaker_wakes_its_waiters_when_it_closes() -> None:
    breaker = CircuitBreaker(first_delay=0.5, max_delay=3, clock=FakeClock())
    await breaker.wait_closed()  # closed: no wait
    breaker.failed()
    waiters = [asyncio.ensure_future(breaker.wait_closed()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    breaker.succeeded()
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=5)


def test_local_buckets_pace_each_domain_at_its_share_of_the_rate() -> None:
    clock = FakeClock()
    local = LocalBuckets(clock)
    limit = Limit(rate=10, burst=1, text="10/s")  # 5/s for each of 2 workers: every 0.2 s
    first = local.acquire("a.example", limit, cost=1, reserve=0.5, workers=2)
    assert first.allowed
    waits = [local.acquire("a.example", limit, 1, 0.5, 2) for _ in range(3)]
    assert [w.reserved for w in waits] == [True, True, False]
    assert [w.retry_after for w in waits] == pytest.approx([0.2, 0.4, 0.6])
    assert local.busy_until("a.example") == pytest.approx(clock.now + 0.6)
    assert local.acquire("b.example", limit, 1, 0.5, 2).allowed, "domains are independent"
    clock.now += 0.601
    assert local.acquire("a.example", limit, 1, 0.5, 2).allowed


def test_local_buckets_share_the_burst_between_the_workers() -> None:
    """3 workers at 6/s, burst 6: each one's bucket holds 2 tokens, refilled at 2/s, so that
    the fleet's first moments after a switch hold one burst, not three."""
    clock = FakeClock()
    local = LocalBuckets(clock)
    limit = Limit(rate=6, burst=6, text="6/s")
    results = [local.acquire("a.example", limit, 1, 10, workers=3) for _ in range(4)]
    assert [r.allowed for r in results] == [True, True, False, False]
    assert [r.retry_after for r in results] == pytest.approx([0, 0, 0.5, 1.0])
    # A request costs at most the burst; a worker's share of it is at least one request.
    assert local.acquire("b.example", Limit(1, 1, "1/s"), 1, 0, workers=3).allowed


def test_local_buckets_start_where_the_shared_bucket_was() -> None:
    clock = FakeClock()
    local = LocalBuckets(clock)
    shared = AcquireResult(allowed=False, reserved=True, tokens_left=0, retry_after=0.9,
                           reset_after=1.0)  # fmt: skip
    local.follow("a.example", shared)
    result = local.acquire("a.example", Limit(10, 1, "10/s"), cost=1, reserve=5, workers=1)
    assert result.retry_after == pytest.approx(1.0), "after the tokens Redis already gave out"


def test_only_tokens_taken_locally_are_told_to_redis_once() -> None:
    """busy_until is what this process took while Redis failed: Redis's own view, followed from
    its replies, is not sent back to it (its time may go back: moments given back, voided);
    tokens taken locally are told until a reply shows a call told them, and one taken after
    that call was sent is told by the next; after a failure of Redis, every busy bucket."""
    clock = FakeClock()
    local = LocalBuckets(clock)
    limit = Limit(10, 1, "10/s")
    shared = AcquireResult(allowed=True, reserved=False, tokens_left=0, retry_after=0,
                           reset_after=1.0)  # fmt: skip
    local.follow("a.example", shared)
    assert local.busy_until("a.example") == 0, "Redis's own view"
    local.acquire("a.example", limit, 1, reserve=5, workers=1)
    assert local.busy_until("a.example") == pytest.approx(clock.now + 1.1), (
        "after what Redis gave out"
    )
    sent = local.untold(["a.example", "b.example"])
    assert sent.keys() == {"a.example"}
    local.acquire("a.example", limit, 1, reserve=5, workers=1)  # while the call was under way
    local.told(sent)
    assert local.busy_until("a.example") == pytest.approx(clock.now + 1.2), (
        "the later take still to tell"
    )
    local.told(local.untold(["a.example"]))
    assert local.busy_until("a.example") == 0
    local.acquire("a.example", limit, 1, reserve=5, workers=1)
    local.forget("a.example")
    assert local.busy_until("a.example") == 0
    # Redis failed: what was seen busy in it is told again (it may have lost it); not a bucket
    # full again by then.
    local.follow("b.example", shared)
    clock.now += 0.5
    local.tell_again()
    assert local.busy_until("a.example") == 0
    assert local.busy_until("b.example") == pytest.approx(clock.now + 0.5)
    assert local.busy_until("c.example") == 0


def test_local_buckets_forget_full_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_buckets, "LOCAL_PRUNE_SIZE", 100)
    clock = FakeClock()
    local = LocalBuckets(clock)
    limit = Limit(1, 1, "1/s")
    for n in range(100):
        local.acquire(f"d{n}.example", limit, 1, 0, 1)
    assert len(local) == 100
    clock.now += 1.5  # all full again
    local.acquire("new.example", limit, 1, 0, 1)
    assert len(local) == 1


@async_test
async def test_while_redis_answers_its_decisions_count() -> None:
    clock = FakeClock()
    bucket, scripts, _ = resilient_bucket(clock)
    grants = [await bucket.acquire(A, TEN_PER_SECOND, 1) for _ in range(3)]
    assert all(grant.shared for grant in grants)
    assert [grant.result.retry_after for grant in grants] == pytest.approx([0, 0.1, 0.2])
    assert len(scripts.calls) == 3


@async_test
async def test_a_failure_opens_the_breaker_and_each_worker_paces_at_its_share() -> None:
    """In a fleet, only once the outage has lasted REDIS_THROTTLE_FALLBACK_AFTER: it may be
    this worker's alone until then, and its requests wait (parked)."""
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(clock, fleet=2)
    seen(bucket)
    scripts.up = False
    held = [await bucket.acquire(A, TEN_PER_SECOND, 1)]
    assert collector.get_value("redis_throttle/outages") == 1
    assert collector.get_value("redis_throttle/redis_errors/ConnectionError") == 1
    await clock.advance(DEFAULT_FALLBACK_AFTER - 1)
    held.append(await bucket.acquire(A, TEN_PER_SECOND, 1))
    assert [grant.shared for grant in held] == [False] * 2
    assert [grant.source for grant in held] == [Source.WAIT] * 2, "nothing reserved"
    # Asked again when the hold ends, WAIT_FOR_REDIS at most (parked meanwhile).
    assert [grant.result.retry_after for grant in held] == pytest.approx(
        [DEFAULT_FALLBACK_AFTER, 1]
    )
    assert collector.get_value("redis_throttle/fallback/held") == 2
    await clock.advance(1)
    grants = [await bucket.acquire(A, TEN_PER_SECOND, 1) for _ in range(3)]
    assert [grant.shared for grant in grants] == [False] * 3
    # 10/s for 2 workers: 5/s each, a moment every 0.2 s.
    assert [grant.result.retry_after for grant in grants] == pytest.approx([0, 0.2, 0.4])
    assert len(scripts.calls) == 1, "no call while the breaker is open"
    assert collector.get_value("redis_throttle/fallback/local") == 3
    assert collector.get_value("redis_throttle/fallback/held") == 2
    await bucket.aclose()


@pytest.mark.parametrize(
    "settings", [{"fleet": 1}, {"fleet": None, "REDIS_THROTTLE_FALLBACK_WORKERS": 1}]
)
@async_test
async def test_a_worker_alone_in_its_fleet_paces_at_once(settings: dict[str, Any]) -> None:
    """No other worker may still draw on Redis: nothing to hold back for."""
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(clock, **settings)
    seen(bucket)
    scripts.up = False
    grants = [await bucket.acquire(A, TEN_PER_SECOND, 1) for _ in range(2)]
    assert [grant.result.retry_after for grant in grants] == pytest.approx([0, 0.1])
    assert collector.get_value("redis_throttle/fallback/held") is None
    await bucket.aclose()


@async_test
async def test_a_worker_alone_keeps_to_the_limit_set_live_redis_last_told() -> None:
    """Set live at 1/s (its own 10/s): paced alone, the second request goes 2 s after the
    first, not 1.1 s; paused live, nothing goes until Redis tells the resume."""
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(clock, fleet=1)
    scripts.set_live(A, limit("1/s"))
    assert (await bucket.acquire(A, TEN_PER_SECOND, 1)).shared
    scripts.up = False
    grants = [await bucket.acquire(A, TEN_PER_SECOND, 1) for _ in range(2)]
    assert [grant.source for grant in grants] == [Source.ALONE] * 2
    assert [grant.result.retry_after for grant in grants] == pytest.approx([1.0, 2.0])
    bucket.live_limits.told(A, LiveLimit(rate=None, burst=None, paused=True), TEN_PER_SECOND)
    paused = await bucket.acquire(A, TEN_PER_SECOND, 1)
    assert (paused.source, paused.result.retry_after) == (Source.WAIT, WAIT_FOR_REDIS)
    assert collector.get_value("redis_throttle/fallback/paused_live") == 1
    await bucket.aclose()


@async_test
async def test_the_probe_backs_off_then_closes_the_breaker_once_redis_answers() -> None:
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(clock, REDIS_THROTTLE_PROBE_INTERVAL=4)
    start = clock.now
    scripts.up = False
    await bucket.acquire(A, TEN_PER_SECOND, 1)
    await clock.advance(0)
    probed_at = []
    for _ in range(5):
        probes = scripts.probes
        while scripts.probes == probes:
            await clock.advance(clock.sleeping[0] - clock.now)
        probed_at.append(clock.now - start)
    # FIRST_PROBE_DELAY, doubled each time, up to REDIS_THROTTLE_PROBE_INTERVAL.
    assert FIRST_PROBE_DELAY == 0.5
    assert probed_at == [0.5, 1.5, 3.5, 7.5, 11.5]
    assert bucket.breaker.open_for() is not None
    scripts.up = True
    await clock.advance(4.0)
    assert bucket.breaker.open_for() is None
    assert collector.get_value("redis_throttle/fallback_time") == pytest.approx(15.5)
    assert (await bucket.acquire(A, TEN_PER_SECOND, 1)).shared
    await bucket.aclose()


@async_test
async def test_after_an_outage_a_worker_keeps_to_its_share_for_one_probe_interval() -> None:
    """Another worker may still pace alone until its own probe: for
    REDIS_THROTTLE_PROBE_INTERVAL after Redis is back, requests wait for this worker's share
    first (without asking Redis), then ask Redis."""
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(
        clock, REDIS_THROTTLE_PROBE_INTERVAL=2, REDIS_THROTTLE_FALLBACK_AFTER=0
    )
    seen(bucket)
    scripts.up = False
    for _ in range(5):  # paced alone at its share, 5/s: busy until 1.0 s
        await bucket.acquire(A, TEN_PER_SECOND, 1)
    scripts.up = True
    await clock.advance(FIRST_PROBE_DELAY)
    assert bucket.breaker.open_for() is None
    calls = len(scripts.calls)
    waiting = await bucket.acquire(A, TEN_PER_SECOND, 1)
    assert waiting.source is Source.HANDOVER
    assert not waiting.shared
    assert len(scripts.calls) == calls, "it waits for its share without asking Redis"
    assert collector.get_value("redis_throttle/handover_waits") == 1
    # The moments it gave out alone that had not come (0.6 and 0.8 s) are void: its share goes
    # on from what went (0, 0.2 and 0.4 s).
    assert waiting.result.retry_after == pytest.approx(0.1), "its share's next moment: 0.6 s"
    await clock.advance(waiting.result.retry_after)
    assert (await bucket.acquire(A, TEN_PER_SECOND, 1)).shared, "its share allows it: Redis"
    await clock.advance(2.0)
    grants = [await bucket.acquire(A, TEN_PER_SECOND, 1) for _ in range(3)]
    assert all(grant.shared for grant in grants), "the fleet's pace again"
    await bucket.aclose()


@async_test
async def test_the_open_policy_lets_requests_go_unthrottled() -> None:
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(
        clock, REDIS_THROTTLE_ON_REDIS_ERROR=FALLBACK_OPEN
    )
    scripts.up = False
    grants = [await bucket.acquire(A, TEN_PER_SECOND, 1) for _ in range(5)]
    assert all(grant.result.allowed and not grant.shared for grant in grants)
    assert collector.get_value("redis_throttle/fallback/open") == 5
    await bucket.aclose()


@async_test
async def test_the_wait_policy_waits_until_redis_answers() -> None:
    clock = FakeClock()
    bucket, scripts, _ = resilient_bucket(clock, REDIS_THROTTLE_ON_REDIS_ERROR=FALLBACK_WAIT)
    scripts.up = False
    acquire = asyncio.ensure_future(bucket.acquire(A, TEN_PER_SECOND, 1))
    await clock.advance(10.0)
    assert not acquire.done()
    scripts.up = True
    grant = await clock.run(acquire)
    assert grant.shared
    assert grant.waited_for_redis
    await bucket.aclose()


@async_test
async def test_a_worker_that_never_saw_the_fleet_waits_for_redis() -> None:
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(clock, fleet=None)
    scripts.up = False
    grant = await bucket.acquire(A, TEN_PER_SECOND, 1)
    assert grant.source is Source.WAIT, "it knows no share: nothing is reserved"
    assert grant.result.retry_after == WAIT_FOR_REDIS, "asks again later, parked meanwhile"
    assert WAIT_FOR_REDIS > DEFAULT_MAX_HOLD
    assert collector.get_value("redis_throttle/fallback/unknown_fleet") == 1
    await bucket.aclose()


@async_test
async def test_fallback_workers_sets_the_share_whatever_the_fleet() -> None:
    clock = FakeClock()
    bucket, scripts, _ = resilient_bucket(
        clock, fleet=None, REDIS_THROTTLE_FALLBACK_WORKERS=5, REDIS_THROTTLE_FALLBACK_AFTER=0
    )
    seen(bucket)
    scripts.up = False
    grants = [await bucket.acquire(A, TEN_PER_SECOND, 1) for _ in range(2)]
    assert [grant.result.retry_after for grant in grants] == pytest.approx([0, 0.5])
    await bucket.aclose()


@async_test
async def test_a_refused_call_is_paced_alone_and_the_breaker_stays_closed() -> None:
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(clock, fleet=2)
    scripts.refusing = True
    grant = await bucket.acquire(A, TEN_PER_SECOND, 1)
    assert not grant.shared
    assert grant.result.allowed
    assert bucket.breaker.open_for() is None, "Redis answered"
    assert collector.get_value("redis_throttle/rejected/script_call") == 1
    assert collector.get_value("redis_throttle/outages") is None
    scripts.refusing = False
    assert (await bucket.acquire(A, TEN_PER_SECOND, 1)).shared, "the next request asks Redis"


@async_test
async def test_what_was_taken_during_the_outage_is_told_until_a_call_takes_tokens() -> None:
    clock = FakeClock()
    bucket, scripts, _ = resilient_bucket(clock, fleet=1, REDIS_THROTTLE_PROBE_INTERVAL=1)
    one_per_second = limit("1/5s")
    seen(bucket)
    scripts.up = False
    await bucket.acquire(A, one_per_second, 1)  # taken locally, and gone: busy until 5 s
    scripts.up = True
    await clock.advance(FIRST_PROBE_DELAY)
    await clock.advance(1.0)  # the handover is over
    scripts.calls.clear()
    scripts.bucket = LocalBuckets(clock)  # Redis restarted empty
    scripts.refusing = True
    await bucket.acquire(A, one_per_second, 1)
    scripts.refusing = False
    await bucket.acquire(A, one_per_second, 1)
    await bucket.acquire(A, one_per_second, 1)
    told = [busy_until for _, busy_until in scripts.calls]
    assert told[0] > 0, "told"
    # A refusal wrote nothing: told again, with the token its request took locally.
    assert told[1] == told[0] + 5.0
    assert told[2] == 0, "the call that took tokens wrote it"


@async_test
async def test_moments_given_alone_that_have_not_come_when_redis_is_back_are_void() -> None:
    """A worker of two paces alone at 5/s (moments 0, 0.2, ... 0.8 s) and Redis answers again
    at 0.5 s. The moments of 0.6 and 0.8 s were given out alone: Redis does not know them, and
    once the other worker's handover is over it gives their times to that worker (a failover:
    both sent at once, twice). They are void (their requests ask Redis), and Redis is told of
    what went alone, not of them."""
    clock = FakeClock()
    bucket, scripts, _ = resilient_bucket(
        clock, REDIS_THROTTLE_PROBE_INTERVAL=0.5, REDIS_THROTTLE_FALLBACK_AFTER=0
    )
    seen(bucket)
    scripts.up = False
    given_at = clock.wall()
    for _ in range(5):
        assert (await bucket.acquire(A, TEN_PER_SECOND, 1)).source is Source.ALONE
    assert not bucket.returned_since(given_at), "while Redis fails, they hold"
    scripts.up = True
    await clock.advance(FIRST_PROBE_DELAY)
    assert bucket.breaker.open_for() is None
    assert bucket.returned_since(given_at)
    assert not bucket.returned_since(clock.wall()), "a moment given alone since holds"
    assert bucket.fallback.local.busy_until(A) == pytest.approx(clock.now + 0.1), (
        "what went: until 0.6 s"
    )
    await bucket.aclose()


@pytest.mark.parametrize(
    ("policy", "fleet", "workers", "said"),
    [
        (FALLBACK_LOCAL, 3, None, "at 1/3 of its rate (the 3 workers last seen live)"),
        (
            FALLBACK_LOCAL,
            1,
            None,
            "at 1/1 of its rate (the 1 worker last seen live) until it is back",
        ),
        (
            FALLBACK_LOCAL,
            3,
            None,
            "from 5 s into the outage (REDIS_THROTTLE_FALLBACK_AFTER: it may",
        ),
        (FALLBACK_LOCAL, None, 4, "at 1/4 of its rate (REDIS_THROTTLE_FALLBACK_WORKERS)"),
        (FALLBACK_LOCAL, None, None, "wait until it is back (this worker has not seen"),
        (FALLBACK_OPEN, 3, None, "requests go unthrottled until it is back"),
        (FALLBACK_WAIT, 3, None, "throttled requests wait until it is back"),
    ],
)
def test_the_policy_says_what_requests_do_while_redis_fails(
    policy: str, fleet: int | None, workers: int | None, said: str
) -> None:
    settings: dict[str, Any] = {"REDIS_THROTTLE_ON_REDIS_ERROR": policy}
    if workers is not None:
        settings["REDIS_THROTTLE_FALLBACK_WORKERS"] = workers
    bucket, _, _ = resilient_bucket(FakeClock(), fleet, **settings)
    assert said in bucket.fallback.describe()


@async_test
async def test_a_domain_whose_bucket_this_worker_never_saw_waits_for_redis() -> None:
    """Other workers may hold moments of it, reserved in Redis before it failed: paced alone
    from nothing, this worker's would go beside theirs (a release 257 ms after another's at 2/s,
    in 1 of 10 runs of tests/test_fleet_faults.py). It asks again later, parked meanwhile; a
    domain it saw is paced alone at its share."""
    clock = FakeClock()
    bucket, scripts, collector = resilient_bucket(clock, REDIS_THROTTLE_FALLBACK_AFTER=0)
    seen(bucket, "b.example")
    scripts.up = False
    unseen = await bucket.acquire(A, TEN_PER_SECOND, 1)
    assert unseen.source is Source.WAIT, "nothing is reserved"
    assert unseen.result.retry_after == WAIT_FOR_REDIS
    assert collector.get_value("redis_throttle/fallback/unseen_domain") == 1
    assert (await bucket.acquire("b.example", TEN_PER_SECOND, 1)).result.allowed
    assert collector.get_value("redis_throttle/fallback/local") == 1
    await bucket.aclose()
