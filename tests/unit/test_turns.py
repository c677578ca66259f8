"""A request's turn (:class:`.Turns`): go now, hold until its moment, or park; on a fake clock
and a bucket in memory, so every time asserted is exact."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from fakes import Throttle, limit, refused_by_the_site
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.budgets import RequestBudget
from scrapy_redis_throttle.config import FALLBACK_LOCAL, FALLBACK_WAIT
from scrapy_redis_throttle.moments import MISSED_AFTER
from scrapy_redis_throttle.parking import RELEASE_AHEAD
from scrapy_redis_throttle.replies import AcquireResult, Voiding
from scrapy_redis_throttle.tickets import Ticket
from scrapy_redis_throttle.waiting import SENT_META, DroppedAtClose

TWO_PER_SECOND = limit("2/s")
BURST_THREE = limit("2/s", burst=3)


def request(n: int = 0) -> Request:
    return Request(f"http://a.example/{n}")


@async_test
async def test_a_request_within_the_burst_goes_at_once_and_is_counted() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    assert await throttle.take(request(), TWO_PER_SECOND) is None
    assert throttle.clock.now == start, "no wait"
    assert throttle.stat("allowed_immediately") == 1
    assert throttle.stat("requests") == 1
    assert throttle.stat("delayed") is None
    assert len(throttle.scripts.calls) == 1


@async_test
async def test_requests_over_the_burst_go_each_at_its_moment() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    went: list[float] = []

    async def turn(n: int) -> None:
        assert await throttle.start(request(n), TWO_PER_SECOND) is None
        went.append(throttle.clock.now - start)

    await throttle.clock.run(asyncio.gather(*(turn(n) for n in range(4))))
    assert went == [0.0, 0.5, 1.0, 1.5]
    assert len(throttle.scripts.calls) == 4, "one call per request: its moment is reserved"
    assert throttle.stat("delayed") == 3
    assert throttle.stat("wait_time_max") == pytest.approx(1.5)
    assert throttle.stat("wait_time_total") == pytest.approx(3.0)


@async_test
async def test_a_burst_lets_that_many_go_at_once() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    went: list[float] = []

    async def turn(n: int) -> None:
        await throttle.start(request(n), BURST_THREE)
        went.append(throttle.clock.now - start)

    await throttle.clock.run(asyncio.gather(*(turn(n) for n in range(5))))
    assert went == [0.0, 0.0, 0.0, 0.5, 1.0]


@async_test
async def test_a_wait_over_max_hold_parks_the_request_with_its_moment_reserved() -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_HOLD=1.0)
    start = throttle.clock.now
    for _n in range(3):  # moments at 0, 0.5 and 1.0 s: held
        throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    ticket = await throttle.take(request(), TWO_PER_SECOND, may_park=True)
    assert isinstance(ticket, Ticket)
    assert throttle.clock.now == start, "parked at once, not held"
    assert ticket.reserved
    assert not ticket.locally
    assert ticket.due == pytest.approx(start + 1.5)
    assert ticket.reserved_at == throttle.clock.wall()
    assert throttle.stat("park_requests") == 1
    assert throttle.stat("requests") is None, "it has not gone"


@async_test
async def test_a_request_that_may_not_park_holds_however_long() -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_HOLD=1.0)
    start = throttle.clock.now
    for _ in range(5):
        throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    assert await throttle.take(request(), TWO_PER_SECOND) is None
    assert throttle.clock.now - start == pytest.approx(2.5)


@async_test
async def test_a_wait_of_max_hold_exactly_is_held_not_parked() -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_HOLD=0.5)
    throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    result = await throttle.take(request(), TWO_PER_SECOND, may_park=True)
    assert result is None


@async_test
async def test_a_ticket_back_with_its_moment_goes_then_without_asking() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    ticket = Ticket(
        domain="a.example",
        due=now + RELEASE_AHEAD,
        reserved=True,
        locally=False,
        reserved_at=wall - 10,
        waiting_since=wall - 20,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert throttle.clock.now == now + RELEASE_AHEAD, "at its moment"
    assert throttle.scripts.calls == [], "its tokens were reserved before it was parked"
    assert throttle.stat("delayed") == 1
    assert throttle.stat("wait_time_max") == pytest.approx(20 + RELEASE_AHEAD), "since first seen"


@async_test
async def test_a_ticket_without_a_reservation_asks_when_it_comes_back() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    ticket = Ticket(
        domain="a.example",
        due=now,
        reserved=False,
        locally=False,
        reserved_at=wall,
        waiting_since=wall,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert len(throttle.scripts.calls) == 1
    assert throttle.stat("delayed") == 1, "a parked request counts as delayed"


@async_test
async def test_a_ticket_back_too_late_for_its_moment_asks_anew() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    late = Ticket(
        domain="a.example",
        due=now - 2 * MISSED_AFTER,
        reserved=True,
        locally=False,
        reserved_at=wall,
        waiting_since=wall,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, late) is None
    assert throttle.stat("missed_moments") == 1
    assert len(throttle.scripts.calls) == 1, "a new moment"


@async_test
async def test_a_ticket_back_just_within_missed_after_still_goes() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    ticket = Ticket(
        domain="a.example",
        due=now - MISSED_AFTER / 2,
        reserved=True,
        locally=False,
        reserved_at=wall,
        waiting_since=wall,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert throttle.stat("missed_moments") is None
    assert throttle.scripts.calls == []


@async_test
async def test_a_moment_the_worker_wakes_late_for_is_missed_and_asked_anew() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    turn = throttle.start(request(), TWO_PER_SECOND)
    await throttle.clock.advance(0)
    assert throttle.clock.sleeping == [start + 0.5]
    # The process is busy: its timer fires 0.2 s late.
    throttle.clock.now = start + 0.7
    await throttle.clock.advance(0)
    await throttle.clock.run(turn)
    assert throttle.stat("missed_moments") == 1
    assert len(throttle.scripts.calls) == 2
    # The missed moment's token stays spent (the site may have seen another request then):
    # the new moment is the next free one.
    assert throttle.clock.now == pytest.approx(start + 1.0)


@async_test
async def test_a_reply_read_late_with_an_allowed_request_asks_anew() -> None:
    throttle = Throttle()
    decided = throttle.clock.now - 1.0  # Redis decided 1 s before the reply was read
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=True,
            reserved=False,
            tokens_left=0.0,
            retry_after=0.0,
            reset_after=0.0,
            decided_at=decided,
        )
    )
    assert await throttle.take(request(), TWO_PER_SECOND) is None
    assert throttle.stat("missed_moments") == 1
    assert len(throttle.scripts.calls) == 2


@async_test
async def test_through_a_latency_spike_no_request_goes_early_and_the_rate_holds() -> None:
    """Three workers, two requests under way in each, share a 5/s bucket that answers 0.2 s
    late each way for 20 s. A late reply means a moment reserved late, never a request that
    may go late and fast to catch up: a site allowing 5/s refuses none of the sends, and the
    round trips overlap, so the domain keeps >= 0.8 of its rate."""
    five = limit("5/s")
    first = Throttle()
    clock, scripts = first.clock, first.scripts
    workers = [first, Throttle(clock, scripts), Throttle(clock, scripts)]
    scripts.latency = 0.2
    sent: list[float] = []
    until = clock.now + 20

    async def one_at_a_time(worker: Throttle) -> None:
        while clock.now < until:
            budget = RequestBudget("a.example", five)
            assert await worker.turns.take(request(), budget, None, False) is None
            sent.append(clock.now)

    await clock.run(asyncio.gather(*(one_at_a_time(each) for each in workers for _ in range(2))))
    assert refused_by_the_site(sent, five) == []
    assert len([at for at in sent if at < until]) >= 0.8 * 5 * 20, len(sent)


@pytest.mark.parametrize(("before", "after"), [("5/s", "1/s"), ("1/s", "5/s")])
@async_test
async def test_a_live_change_re_paces_the_waiting_requests_at_once(before: str, after: str) -> None:
    """100 requests hold moments reserved at *before* when the domain's limit is set live to
    *after* (2 s in): the change voids them, and every one asks again at once. From the change
    on, the domain goes at the new limit: never closer than it allows, never a gap over 1.5 of
    its intervals, nothing at the old pace."""
    throttle = Throttle()
    clock, old, new = throttle.clock, limit(before), limit(after)
    changed_at = clock.now + 2.0

    async def sent_at(n: int) -> float:
        assert (
            await throttle.turns.take(request(n), RequestBudget("a.example", old), None, False)
            is None
        )
        return clock.now

    async def change() -> None:
        await clock.sleep(changed_at - clock.now)
        void = throttle.scripts.set_live("a.example", new)
        throttle.pauses.pause("a.example", void)  # as the workers hear it

    sent = await clock.run(asyncio.gather(change(), *(sent_at(n) for n in range(100))))
    times = sorted(at for at in sent[1:] if at is not None)
    since = [at for at in times if at >= changed_at]
    assert refused_by_the_site(since, new) == []
    interval = 1 / new.rate
    assert since[0] - changed_at <= interval
    gaps = [b - a for a, b in itertools.pairwise(since)]
    assert max(gaps) <= 1.5 * interval, max(gaps)
    assert len(times) == 100


@async_test
async def test_a_moment_counts_from_when_redis_decided_not_from_the_reply() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    # Decided 0.03 s before it was read (within MISSED_AFTER), to go 0.5 s after that.
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=False,
            reserved=True,
            tokens_left=0.0,
            retry_after=0.5,
            reset_after=0.5,
            decided_at=start - 0.03,
        )
    )
    await throttle.take(request(), TWO_PER_SECOND)
    assert throttle.clock.now == pytest.approx(start + 0.47)


@async_test
async def test_a_pause_heard_while_holding_voids_the_moment_and_it_asks_again() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    turn = throttle.start(request(), TWO_PER_SECOND)
    await throttle.clock.advance(0.1)
    throttle.pauses.pause("a.example", 5.0)  # its moment (0.5 s) is within it
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=False, reserved=True, tokens_left=0.0, retry_after=5.0, reset_after=5.5
        )
    )
    await throttle.clock.advance(0)
    assert len(throttle.scripts.calls) == 2, "woken at once to ask again"
    assert throttle.clock.now == pytest.approx(start + 0.1)
    assert throttle.stat("paused_reservations") == 1
    await throttle.clock.run(turn)
    assert throttle.clock.now == pytest.approx(start + 5.1)


@async_test
async def test_a_pause_that_ends_before_the_moment_leaves_it_alone() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    for _ in range(3):
        throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    turn = throttle.start(request(), TWO_PER_SECOND)  # its moment: 1.5 s
    await throttle.clock.advance(0.1)
    throttle.pauses.pause("a.example", 1.0)  # until 1.1 s
    await throttle.clock.run(turn)
    assert throttle.clock.now == pytest.approx(start + 1.5)
    assert len(throttle.scripts.calls) == 1
    assert throttle.stat("paused_reservations") is None


@async_test
async def test_a_pause_of_another_domain_leaves_the_moment_alone() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    turn = throttle.start(request(), TWO_PER_SECOND)
    await throttle.clock.advance(0.1)
    throttle.pauses.pause("b.example", 5.0)
    await throttle.clock.run(turn)
    assert throttle.clock.now == pytest.approx(start + 0.5)
    assert len(throttle.scripts.calls) == 1


@async_test
async def test_a_moment_reserved_after_a_pause_was_heard_is_not_voided_by_it() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    throttle.pauses.pause("a.example", 5.0)
    await throttle.clock.advance(0.01)
    throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    await throttle.take(request(), TWO_PER_SECOND)
    assert throttle.clock.now == pytest.approx(start + 0.51)
    assert len(throttle.scripts.calls) == 1


@async_test
async def test_a_domain_paused_live_waits_and_asks_again() -> None:
    throttle = Throttle()
    start = throttle.clock.now
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=False,
            reserved=False,
            tokens_left=0.0,
            retry_after=2.0,
            reset_after=0.0,
            paused=True,
        )
    )
    await throttle.take(request(), TWO_PER_SECOND)
    assert throttle.stat("paused_live") == 1
    assert [at - start for at in throttle.scripts.asked_at] == [0.0, 2.0]


@async_test
async def test_a_domain_paused_live_for_long_parks_its_request() -> None:
    throttle = Throttle()
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=False,
            reserved=False,
            tokens_left=0.0,
            retry_after=2.0,
            reset_after=0.0,
            paused=True,
        )
    )
    ticket = await throttle.take(request(), TWO_PER_SECOND, may_park=True)
    assert isinstance(ticket, Ticket)
    assert not ticket.reserved, "nothing was reserved: it asks again then"
    assert ticket.due == pytest.approx(throttle.clock.now + 2.0)


@async_test
async def test_a_request_refused_beyond_max_reserve_comes_back_before_its_time() -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_RESERVE=10)
    start = throttle.clock.now
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=False, reserved=False, tokens_left=0.0, retry_after=30.0, reset_after=30.0
        )
    )
    await throttle.take(request(), TWO_PER_SECOND)
    # Back when its moment can be reserved: 30 s minus half of MAX_RESERVE.
    assert [at - start for at in throttle.scripts.asked_at] == [0.0, 25.0]


@async_test
async def test_a_refusal_within_max_reserve_asks_again_at_the_time_given() -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_RESERVE=10)
    start = throttle.clock.now
    # A fixed window's room too many windows ahead: near, though not reserved.
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=False, reserved=False, tokens_left=0.0, retry_after=4.0, reset_after=4.0
        )
    )
    await throttle.take(request(), TWO_PER_SECOND)
    assert [at - start for at in throttle.scripts.asked_at] == [0.0, 4.0]


@pytest.mark.parametrize(
    ("retry_after", "reserved", "due_after"),
    [
        (5.0, True, 5.0),  # reserved: due at its moment
        (5.0, False, 5.0 + RELEASE_AHEAD),  # near but refused: back then, given back early
    ],
)
@async_test
async def test_a_parked_request_is_due_when_it_can_go_or_ask(
    retry_after: float, reserved: bool, due_after: float
) -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_RESERVE=10)
    result = AcquireResult(
        allowed=False,
        reserved=reserved,
        tokens_left=0.0,
        retry_after=retry_after,
        reset_after=retry_after,
    )
    throttle.scripts.answers.append(result)
    ticket = await throttle.take(request(), TWO_PER_SECOND, may_park=True)
    assert isinstance(ticket, Ticket)
    assert ticket.reserved is reserved
    assert ticket.due == pytest.approx(throttle.clock.now + due_after)


@async_test
async def test_a_request_too_far_ahead_to_reserve_parks_until_it_can() -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_RESERVE=10)
    throttle.scripts.answers.append(
        AcquireResult(
            allowed=False, reserved=False, tokens_left=0.0, retry_after=100.0, reset_after=100.0
        )
    )
    ticket = await throttle.take(request(), TWO_PER_SECOND, may_park=True)
    assert isinstance(ticket, Ticket)
    assert not ticket.reserved
    # Back within MAX_RESERVE of its time (spread over the last half), RELEASE_AHEAD early.
    due_in = ticket.due - throttle.clock.now
    assert 100 + RELEASE_AHEAD - 10 <= due_in <= 100 + RELEASE_AHEAD - 5


@async_test
async def test_paced_locally_a_pause_heard_holds_the_request_back() -> None:
    throttle = Throttle(REDIS_THROTTLE_FALLBACK_WORKERS=1)
    start = throttle.clock.now
    throttle.scripts.up = False  # the fallback decides: no bucket in Redis holds the pause
    throttle.pauses.pause("a.example", 3.0)
    await throttle.take(request(), TWO_PER_SECOND)
    assert throttle.clock.now == pytest.approx(start + 3.0)
    assert throttle.stat("fallback/local") == 2, "asked again once the pause ended"
    await throttle.bucket.aclose()  # its probe of Redis


@async_test
async def test_a_reserved_moment_from_another_worker_reads_the_voidings_it_missed() -> None:
    """A parked request reserved before this worker listened: the last voiding is read from
    Redis, and one that covers its moment makes it ask again."""
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    throttle.scripts.voiding = Voiding(left=10.0, age=1.0)
    ticket = Ticket(
        domain="a.example",
        due=now,
        reserved=True,
        locally=False,
        reserved_at=wall - 5,
        waiting_since=wall - 5,
        elsewhere=True,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert throttle.scripts.voiding_reads == 1
    assert throttle.stat("voidings_read") == 1
    assert throttle.stat("paused_reservations") == 1
    assert len(throttle.scripts.calls) == 1, "asked again"


@async_test
async def test_a_voiding_read_that_voids_nothing_lets_the_moment_stand() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    ticket = Ticket(
        domain="a.example",
        due=now,
        reserved=True,
        locally=False,
        reserved_at=wall - 5,
        waiting_since=wall - 5,
        elsewhere=True,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert throttle.scripts.voiding_reads == 1
    assert throttle.scripts.calls == []


@async_test
async def test_a_listening_worker_reads_the_voidings_within_the_wait_not_at_the_moment() -> None:
    """A slow Redis answers the read in 0.4 s: read at its moment (0.5 s ahead), the request
    would miss it; read first, it goes at it. Listening, the worker does not read the fleet's
    secret with it (its subscription, still in force, read it)."""
    throttle = Throttle()
    throttle.pauses._listening_since = throttle.clock.wall()
    throttle.scripts.voiding_read_time = 0.4
    now, wall = throttle.clock.now, throttle.clock.wall()
    ticket = Ticket(
        domain="a.example",
        due=now + 0.5,
        reserved=True,
        locally=False,
        reserved_at=wall - 5,
        waiting_since=wall - 5,
        elsewhere=True,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert throttle.clock.now == pytest.approx(now + 0.5)
    assert throttle.scripts.calls == [], "went at its moment, without asking again"
    assert throttle.stat("missed_moments") is None
    assert throttle.scripts.secret_reads == 0, "listening: the fleet's secret is not read"


@pytest.mark.parametrize(("policy", "asks_again"), [(FALLBACK_WAIT, True), (FALLBACK_LOCAL, False)])
@async_test
async def test_voidings_redis_cannot_tell_go_by_the_policy(policy: str, asks_again: bool) -> None:
    throttle = Throttle(REDIS_THROTTLE_ON_REDIS_ERROR=policy)
    now, wall = throttle.clock.now, throttle.clock.wall()
    throttle.scripts.voiding_fails = True
    ticket = Ticket(
        domain="a.example",
        due=now,
        reserved=True,
        locally=False,
        reserved_at=wall - 5,
        waiting_since=wall - 5,
        elsewhere=True,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert len(throttle.scripts.calls) == (1 if asks_again else 0)
    await throttle.bucket.aclose()  # its probe of Redis


@async_test
async def test_a_moment_reserved_locally_never_reads_voidings_from_redis() -> None:
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    ticket = Ticket(
        domain="a.example",
        due=now,
        reserved=True,
        locally=True,
        reserved_at=wall - 5,
        waiting_since=wall - 5,
    )
    assert await throttle.take(request(), TWO_PER_SECOND, ticket) is None
    assert throttle.scripts.voiding_reads == 0


@async_test
async def test_the_adaptive_rate_gets_when_a_request_left() -> None:
    throttle = Throttle(REDIS_THROTTLE_ADAPTIVE_ENABLED=True)
    sent = request()
    throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    await throttle.take(sent, TWO_PER_SECOND)
    assert sent.meta[SENT_META] == throttle.clock.now


@async_test
async def test_without_the_adaptive_rate_nothing_is_written_into_meta() -> None:
    throttle = Throttle()
    sent = request()
    await throttle.take(sent, TWO_PER_SECOND)
    assert SENT_META not in sent.meta


@async_test
async def test_a_request_cancelled_while_holding_leaves_no_sleep_behind() -> None:
    throttle = Throttle()
    throttle.scripts.bucket.acquire("a.example", TWO_PER_SECOND, 1, 60, 1)
    turn = throttle.start(request(), TWO_PER_SECOND)
    await throttle.clock.advance(0.1)
    assert throttle.clock.sleeping
    turn.cancel()
    await throttle.clock.advance(0)
    assert throttle.clock.sleeping == []
    assert turn.cancelled()


@async_test
async def test_at_a_close_a_request_that_would_wait_again_is_parked_or_dropped() -> None:
    """Paused live for 0.5 s, under REDIS_THROTTLE_MAX_HOLD: held, asking again, until the
    spider closes; then parked if it may be, else dropped. A reserved moment still goes."""
    throttle = Throttle()
    paused = AcquireResult(
        allowed=False,
        reserved=False,
        tokens_left=0.0,
        retry_after=0.5,
        reset_after=0.0,
        paused=True,
    )
    throttle.scripts.answers.extend([paused, paused])
    throttle.turns.closing = True
    ticket = await throttle.take(request(), TWO_PER_SECOND, may_park=True)
    assert isinstance(ticket, Ticket)
    assert ticket.due == pytest.approx(throttle.clock.now + 0.5)
    with pytest.raises(DroppedAtClose):
        await throttle.take(request(), TWO_PER_SECOND)
    assert len(throttle.scripts.calls) == 2, "each asked once, and waited no more"
    # The bucket's own answers: the first goes at once, the second at its moment, 0.5 s later.
    start = throttle.clock.now
    assert await throttle.take(request(), TWO_PER_SECOND) is None
    assert await throttle.take(request(), TWO_PER_SECOND) is None
    assert throttle.clock.now - start == pytest.approx(0.5)


class Lent:
    """Lends the *tickets* of the requests waiting for a robots.txt, in turn (see
    :meth:`.Handoff.lend`)."""

    def __init__(self, *tickets: Ticket) -> None:
        self._tickets = list(tickets)

    def lend(self, domain: str) -> Ticket | None:
        return self._tickets.pop(0) if self._tickets else None


@async_test
async def test_a_request_that_misses_a_lent_moment_is_lent_the_next() -> None:
    """A robots.txt lent the moments of requests waiting for it (see Handoff.lend): its worker
    too busy for the first, it goes at the next one lent, without asking Redis; its wait counts
    from its own first turn."""
    throttle = Throttle()
    now, wall = throttle.clock.now, throttle.clock.wall()
    missed = Ticket(
        domain="a.example",
        due=now - 2 * MISSED_AFTER,
        reserved=True,
        locally=False,
        reserved_at=wall,
        waiting_since=wall - 30,
    )
    lent = Lent(
        missed,
        Ticket(
            domain="a.example",
            due=now + 0.4,
            reserved=True,
            locally=False,
            reserved_at=wall,
            waiting_since=wall - 30,
        ),
    )
    throttle.turns.handoff = lent
    robots = Request("http://a.example/robots.txt", meta={"dont_obey_robotstxt": True})
    budget = RequestBudget("a.example", TWO_PER_SECOND)
    turn = throttle.turns.take(robots, budget, None, False)
    assert await throttle.clock.run(turn) is None
    assert throttle.clock.now == pytest.approx(now + 0.4)
    assert throttle.scripts.calls == [], "no new moment asked for"
    assert throttle.stat("missed_moments") == 1
    assert throttle.stat("wait_time_max") == pytest.approx(0.4), "from its own first turn"
