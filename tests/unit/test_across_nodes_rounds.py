"""A request's buckets on several nodes of a Redis Cluster (:class:`.AcrossNodes`): one peek of
each, the latest moment reserved in every bucket, a refusal's reservations given back and the
refusal's moment tried, at most ROUNDS times; and :class:`.BudgetLocks`. The nodes are buckets
in memory on a fake clock, each node's clock off the loop's by its own offset, so that every
moment asserted is exact."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

import pytest
from fakes import FakeClock, limit, settle
from redis.exceptions import ConnectionError as RedisConnectionError
from support import async_test

from scrapy_redis_throttle.across_nodes import (
    PEEK,
    ROUNDS,
    AcrossNodes,
    BudgetLocks,
    CallsStopped,
)
from scrapy_redis_throttle.breaker import CircuitBreaker
from scrapy_redis_throttle.rates import FIXED_WINDOW, Limit, Quota
from scrapy_redis_throttle.replies import AcquireResult, Reservation, Unreserved

SITE, PROXY = "shop.example", "proxy.example"
# One request every 0.5 s, burst 1: a bucket's next moment is 0.5 s after the last one.
TWO_PER_SECOND = limit("2/s")
# The proxy's node's clock runs this far ahead of the site's (µs): a moment is the same moment
# on both only when converted through each node's own replies.
PROXY_OFFSET_US = 7_000_000_000


class Node:
    """A Redis primary's buckets, decided as ``lua/token_bucket.lua`` decides them (GCRA: one
    time per bucket, when it is full again; a negative *reserve* peeks; *not_before* puts the
    moment no earlier), on its own clock: the fake clock plus *offset_us*."""

    def __init__(self, clock: FakeClock, offset_us: int = 0) -> None:
        self._clock = clock
        self._offset_us = offset_us
        self.full_at: dict[str, int] = {}
        self.paused: set[str] = set()
        # The moments each bucket counts a request at (loop time), and the reservations' own.
        self.counted: dict[str, list[float]] = {}
        self._moments: dict[Reservation, float] = {}

    def now_us(self) -> int:
        return round(self._clock.now * 1e6) + self._offset_us

    def loop_time(self, moment_us: float) -> float:
        return (moment_us - self._offset_us) / 1e6

    def acquire(
        self, name: str, each: Limit, cost: float, reserve: float, not_before: int
    ) -> AcquireResult:
        now, decided_at = self.now_us(), self._clock.now
        if name in self.paused:
            return AcquireResult(
                allowed=False,
                reserved=False,
                tokens_left=0.0,
                retry_after=2.0,
                reset_after=0.0,
                paused=True,
                decided_at=decided_at,
            )
        full_at = max(self.full_at.get(name, now), now)
        wait = max(0, math.floor(full_at + (cost - each.burst) * each.interval_us - now + 0.5))
        after = max(0, math.ceil(not_before - now))
        wait = max(wait, after)
        if wait > after + reserve * 1e6:  # refused (or a peek): nothing taken
            return AcquireResult(
                allowed=False,
                reserved=False,
                tokens_left=0.0,
                retry_after=wait / 1e6,
                reset_after=(full_at - now) / 1e6,
                decided_at=decided_at,
                moment_us=float(now + wait),
            )
        moment = now + wait
        base = math.ceil(max(full_at, moment) if after else full_at)
        self.full_at[name] = new_full_at = math.ceil(base + cost * each.interval_us)
        self.counted.setdefault(name, []).append(self.loop_time(moment))
        reservation = None
        if wait:
            reservation = Reservation(new_full_at, new_full_at - base, now)
            self._moments[reservation] = self.loop_time(moment)
        return AcquireResult(
            allowed=not wait,
            reserved=bool(wait),
            tokens_left=0.0,
            retry_after=wait / 1e6,
            reset_after=(new_full_at - now) / 1e6,
            decided_at=decided_at,
            moment_us=float(moment),
            reservation=reservation,
        )

    def take(self, name: str, each: Limit) -> None:
        """Another worker's request: the bucket's next moment, reserved."""
        result = self.acquire(name, each, 1.0, 3600.0, 0)
        assert result.allowed or result.reserved

    def unreserve(self, name: str, reservation: Reservation) -> None:
        """As ``lua/unreserve.lua`` for the bucket's last reservation: its time goes back by
        the reservation's step (the only case these tests make)."""
        assert self.full_at[name] == reservation.after, "the fake gives back the last one only"
        self.full_at[name] -= reservation.step
        self.counted[name].remove(self._moments.pop(reservation))


Call = tuple[str, float, float, bool]
"""One call of the script: the bucket's name, reserve, not_before (loop time; 0: none) and
alone."""


class Cluster:
    """The nodes of a Redis Cluster, as :class:`.AcrossNodes` calls them (its ``NodeCalls``):
    each bucket on its node, each call recorded (after :attr:`before`, another worker's move),
    every reservation given back too. Its :attr:`breaker` opens when a test says Redis failed."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.nodes = {SITE: Node(clock), PROXY: Node(clock, PROXY_OFFSET_US)}
        self.calls: list[Call] = []
        self.limits: list[tuple[str, Limit]] = []
        self.given_back: list[tuple[str, list[Reservation]]] = []
        self.before: Callable[[str, float], None] = lambda name, reserve: None
        self.failing: set[str] = set()
        # While set, a give-back waits for it (a slow Redis), after it is recorded.
        self.unreserving: asyncio.Event | None = None
        self.breaker = CircuitBreaker(first_delay=0.5, max_delay=3, clock=clock)

    async def acquire(
        self,
        name: str,
        each: Limit,
        cost: float,
        reserve: float,
        busy_until: float,
        not_before: int,
        alone: bool = False,
    ) -> AcquireResult:
        node = self.nodes[name]
        self.calls.append((name, reserve, node.loop_time(not_before) if not_before else 0, alone))
        self.limits.append((name, each))
        self.before(name, reserve)
        if name in self.failing and reserve >= 0:
            raise RedisConnectionError("Connection reset by peer")
        return node.acquire(name, each, cost, reserve, not_before)

    async def unreserve(self, name: str, reservations: Sequence[Reservation]) -> Unreserved:
        self.given_back.append((name, list(reservations)))
        if self.unreserving is not None:
            await self.unreserving.wait()
        for reservation in reservations:
            self.nodes[name].unreserve(name, reservation)
        return Unreserved(len(reservations), 0)

    def across(self) -> AcrossNodes:
        return AcrossNodes(self, self.breaker, self.clock)

    def reserving(self) -> list[tuple[str, float]]:
        """The calls that were no peek: the bucket, and the moment asked for (loop time)."""
        return [(name, at) for name, reserve, at, _ in self.calls if reserve != PEEK]


async def decide(cluster: Cluster, reserve: float = 60.0) -> AcquireResult:
    """A request of SITE through PROXY, both at TWO_PER_SECOND, that may reserve *reserve* s."""
    return await cluster.across().acquire(
        SITE, TWO_PER_SECOND, 1.0, reserve, 0.0, [(PROXY, TWO_PER_SECOND, 0.0)]
    )


@async_test
async def test_a_request_is_counted_in_every_bucket_at_the_latest_peeked_moment() -> None:
    """One peek per bucket; the latest moment is reserved first where it came from, then in all."""
    cluster = Cluster(FakeClock())
    start = cluster.clock.now
    cluster.nodes[PROXY].take(PROXY, TWO_PER_SECOND)  # the proxy's next moment: +0.5 s
    result = await decide(cluster)
    assert [(name, reserve) for name, reserve, _, _ in cluster.calls[:2]] == [
        (SITE, PEEK),
        (PROXY, PEEK),
    ]
    assert cluster.reserving() == [(PROXY, start + 0.5), (SITE, start + 0.5)]
    assert result.reserved
    assert result.retry_after == 0.5
    assert cluster.nodes[SITE].counted[SITE] == [start + 0.5]
    assert cluster.nodes[PROXY].counted[PROXY] == [start, start + 0.5]
    assert cluster.given_back == []


@async_test
async def test_a_request_every_bucket_allows_now_goes_now() -> None:
    """When every peek says now, every bucket takes the request now: allowed, no reservation."""
    cluster = Cluster(FakeClock())
    start = cluster.clock.now
    result = await decide(cluster)
    assert result.allowed
    assert not result.reserved
    assert result.reservation is None
    assert cluster.reserving() == [(SITE, start), (PROXY, start)]
    assert cluster.nodes[PROXY].counted[PROXY] == [start]


@async_test
async def test_another_scope_is_asked_alone_and_without_the_domain_s_quotas() -> None:
    """Another scope's bucket is asked alone, without quotas; the domain's with its whole limit."""
    cluster = Cluster(FakeClock())
    with_quota = Limit(2.0, 1, "2/s", quotas=(Quota(FIXED_WINDOW, 10, 60.0, "10/m"),))
    await cluster.across().acquire(SITE, TWO_PER_SECOND, 1.0, 60.0, 0.0, [(PROXY, with_quota, 0.0)])
    alone = {name: alone for name, _, _, alone in cluster.calls}
    assert alone == {SITE: False, PROXY: True}
    assert {name: each.quotas for name, each in cluster.limits} == {
        SITE: TWO_PER_SECOND.quotas,
        PROXY: (),
    }


@async_test
async def test_a_refusal_gives_back_what_was_reserved_and_tries_the_refusal_s_moment() -> None:
    """A refusal gives back the moments taken, and the next round tries the refusal's moment."""
    cluster = Cluster(FakeClock())
    start = cluster.clock.now
    cluster.nodes[PROXY].take(PROXY, TWO_PER_SECOND)
    raced: list[str] = []

    def race(name: str, reserve: float) -> None:
        if name == SITE and reserve != PEEK and not raced:
            raced.append(name)
            cluster.nodes[SITE].take(SITE, TWO_PER_SECOND)  # now
            cluster.nodes[SITE].take(SITE, TWO_PER_SECOND)  # +0.5 s, the request's moment

    cluster.before = race
    result = await decide(cluster)
    assert cluster.reserving() == [
        (PROXY, start + 0.5),
        (SITE, start + 0.5),  # refused: taken meanwhile
        (SITE, start + 1.0),  # the refusal's moment, asked first in the bucket that gave it
        (PROXY, start + 1.0),
    ]
    [(name, [_])] = cluster.given_back
    assert name == PROXY
    assert cluster.nodes[PROXY].counted[PROXY] == [start, start + 1.0], "+0.5 s given back"
    assert cluster.nodes[SITE].counted[SITE] == [start, start + 0.5, start + 1.0]
    assert result.reserved
    assert result.retry_after == 1.0


@async_test
async def test_a_request_cancelled_while_it_gives_back_gives_back_each_moment_once() -> None:
    """The moments a refused round gives back leave the request's list before the give-back
    is awaited: cancelled meanwhile, it does not give them back a second time (the second
    would take another worker's moment out of the bucket)."""
    cluster = Cluster(FakeClock())
    cluster.nodes[PROXY].take(PROXY, TWO_PER_SECOND)

    def race(name: str, reserve: float) -> None:
        if name == SITE and reserve != PEEK:
            cluster.nodes[SITE].take(SITE, TWO_PER_SECOND)
            cluster.nodes[SITE].take(SITE, TWO_PER_SECOND)

    cluster.before = race
    cluster.unreserving = asyncio.Event()
    task = asyncio.ensure_future(decide(cluster))
    await settle()
    assert len(cluster.given_back) == 1, "the refused round gives back the proxy's moment"
    task.cancel()
    await settle()
    cluster.unreserving.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(cluster.given_back) == 1, "given back once"


@async_test
async def test_after_rounds_refusals_the_request_is_refused_at_the_last_moment() -> None:
    """After ROUNDS refusals the request holds nothing, refused until the last refusal's moment."""
    cluster = Cluster(FakeClock())
    start = cluster.clock.now
    cluster.nodes[PROXY].take(PROXY, TWO_PER_SECOND)

    def race(name: str, reserve: float) -> None:
        if name == SITE and reserve != PEEK:
            cluster.nodes[SITE].take(SITE, TWO_PER_SECOND)
            cluster.nodes[SITE].take(SITE, TWO_PER_SECOND)

    cluster.before = race
    result = await decide(cluster)
    site_tries = [at for name, at in cluster.reserving() if name == SITE]
    assert len(site_tries) == ROUNDS
    # Each try at the last refusal's moment, which the other worker then takes with the next.
    assert site_tries == [start + 0.5, *(start + n for n in range(1, ROUNDS))]
    assert not result.allowed
    assert not result.reserved
    assert result.reservation is None
    last_refusal = start + 1.0 * ROUNDS
    assert result.retry_after == last_refusal - start
    assert cluster.nodes[SITE].loop_time(result.moment_us or 0) == last_refusal
    assert cluster.nodes[PROXY].counted[PROXY] == [start], "its reservation was given back"
    others = [start + 0.5 * n for n in range(2 * ROUNDS)]
    assert cluster.nodes[SITE].counted[SITE] == others, "only the other worker's"


@async_test
async def test_a_moment_beyond_reserve_is_refused_after_the_peeks_alone() -> None:
    """A latest moment further than reserve is refused after the peeks, taking nothing."""
    cluster = Cluster(FakeClock())
    start = cluster.clock.now
    for _ in range(6):  # the proxy's next moment: +3 s
        cluster.nodes[PROXY].take(PROXY, TWO_PER_SECOND)
    result = await decide(cluster, reserve=2.0)
    assert cluster.reserving() == []
    assert not result.allowed
    assert not result.reserved
    assert result.retry_after == 3.0
    assert cluster.nodes[SITE].loop_time(result.moment_us or 0) == start + 3.0
    assert SITE not in cluster.nodes[SITE].counted


@async_test
async def test_a_paused_bucket_pauses_the_request_and_nothing_is_taken() -> None:
    """A paused peek is the request's answer: no bucket is asked to reserve."""
    cluster = Cluster(FakeClock())
    cluster.nodes[PROXY].paused.add(PROXY)
    result = await decide(cluster)
    assert result.paused
    assert cluster.reserving() == []
    assert cluster.nodes[SITE].counted == {}


@async_test
async def test_a_failure_half_way_gives_back_the_reservations_made_and_raises() -> None:
    """A failure half-way gives back the reservations already made, then raises."""
    cluster = Cluster(FakeClock())
    cluster.nodes[SITE].take(SITE, TWO_PER_SECOND)  # the site's moment, +0.5 s, is the latest
    cluster.failing.add(PROXY)
    with pytest.raises(RedisConnectionError):
        await decide(cluster)
    assert [name for name, _ in cluster.given_back] == [SITE]
    assert cluster.nodes[SITE].counted[SITE] == [cluster.clock.now], "only the other worker's"


@async_test
async def test_a_request_that_waited_while_redis_failed_does_not_call_it() -> None:
    """With the breaker open, a request raises CallsStopped before any call, and holds no lock."""
    cluster = Cluster(FakeClock())
    across = cluster.across()
    assert cluster.breaker.failed()
    with pytest.raises(CallsStopped):
        await across.acquire(SITE, TWO_PER_SECOND, 1.0, 60.0, 0.0, [(PROXY, TWO_PER_SECOND, 0.0)])
    assert cluster.calls == []
    assert len(across.locks) == 0


@async_test
async def test_budget_locks_take_turns_and_forget_names_no_one_uses() -> None:
    """A name's lock holds back its next request (not others'); a name no one uses is forgotten."""
    locks = BudgetLocks()
    order: list[str] = []
    release = asyncio.Event()

    async def hold(who: str, names: list[str]) -> None:
        async with locks.of(names):
            order.append(who)
            if who == "first":
                await release.wait()

    first = asyncio.ensure_future(hold("first", [PROXY, SITE, SITE]))
    await settle()
    assert len(locks) == 2, "one lock per name, duplicates once"
    second = asyncio.ensure_future(hold("second", [SITE]))
    other = asyncio.ensure_future(hold("other", ["elsewhere.example"]))
    await settle()
    assert order == ["first", "other"], "the second waits for SITE"
    assert len(locks) == 2, "SITE's lock, held and waited for, and PROXY's"
    release.set()
    await asyncio.gather(first, second, other)
    assert order == ["first", "other", "second"]
    assert len(locks) == 0
