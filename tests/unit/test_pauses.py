"""The pauses a worker knows of (:class:`.Pauses`): which reserved moments they void, whom they
wake, what they keep in memory, and what a message on the channel may do; on a fake clock."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import Throttle, limit
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.pauses import (
    CLOCK_MARGIN,
    PAUSES_PER_DOMAIN,
    SAME_PAUSE,
    SWEEP_STEP,
    Message,
    Pause,
    parse_message,
    parse_retry_after,
)
from scrapy_redis_throttle.replies import Reservation, Voiding
from scrapy_redis_throttle.tickets import Ticket

A, B = "a.example", "b.example"


@async_test
async def test_a_pause_voids_moments_within_it_reserved_before_it() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    reserved_at = clock.wall() - 1
    pauses.pause(A, 10.0)
    assert pauses.is_void(A, reserved_at, clock.now + 5)
    assert pauses.is_void(A, reserved_at, clock.now + 10), "its last moment too"


@async_test
async def test_a_pause_leaves_moments_after_it_alone() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    pauses.pause(A, 10.0)
    assert not pauses.is_void(A, clock.wall() - 1, clock.now + 10.5)


@async_test
async def test_a_pause_leaves_moments_reserved_after_it_alone() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    pauses.pause(A, 10.0)
    await clock.advance(0.1)
    assert not pauses.is_void(A, clock.wall(), clock.now + 5)


@async_test
async def test_a_pause_leaves_other_domains_alone() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    pauses.pause(A, 10.0)
    assert not pauses.is_void(B, clock.wall() - 1, clock.now + 5)


@async_test
async def test_a_moment_reserved_in_another_process_counts_its_clocks_margin() -> None:
    """Its wall clock may be CLOCK_MARGIN ahead: reserved "after" the pause by less than that,
    it may have been reserved before."""
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    pauses.pause(A, 10.0)
    reserved_at = clock.wall() + CLOCK_MARGIN / 2
    assert pauses.is_void(A, reserved_at, clock.now + 5, elsewhere=True)
    assert not pauses.is_void(A, reserved_at, clock.now + 5)
    assert not pauses.is_void(A, clock.wall() + 2 * CLOCK_MARGIN, clock.now + 5, elsewhere=True)


@async_test
async def test_a_pause_heard_late_counts_from_when_it_happened() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    reserved_at = clock.wall() - 2  # before the pause (3 s ago), heard only now
    pauses.pause(A, 10.0, age=3.0)
    assert not pauses.is_void(A, reserved_at, clock.now + 5)
    assert pauses.is_void(A, clock.wall() - 4, clock.now + 5)


@async_test
async def test_a_pause_is_no_longer_than_the_longest_allowed() -> None:
    throttle = Throttle(REDIS_THROTTLE_MAX_PAUSE=60, REDIS_THROTTLE_MAX_RESERVE=30)
    pauses, clock = throttle.pauses, throttle.clock
    pauses.pause(A, 10_000.0)  # a message may say anything
    assert pauses.paused_for(A) == pytest.approx(60.0)
    assert not pauses.is_void(A, clock.wall() - 1, clock.now + 61)


@async_test
async def test_paused_for_counts_down_and_ends() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    assert pauses.paused_for(A) == 0.0
    pauses.pause(A, 3.0)
    await clock.advance(1.0)
    assert pauses.paused_for(A) == pytest.approx(2.0)
    await clock.advance(2.5)
    assert pauses.paused_for(A) == 0.0


@async_test
async def test_a_pause_wakes_the_sleeps_of_moments_within_it_only() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    start = clock.now
    woken: dict[float, float] = {}

    async def hold(seconds: float) -> None:
        await pauses.sleep(A, seconds)
        woken[seconds] = clock.now - start

    holds = asyncio.gather(hold(1.0), hold(5.0), hold(20.0))
    await clock.advance(0.5)
    pauses.pause(A, 6.0)
    await clock.advance(0)
    assert woken == {1.0: 0.5, 5.0: 0.5}, "those within the pause wake at once"
    await clock.run(holds)
    assert woken[20.0] == 20.0


@async_test
async def test_a_pause_of_another_domain_wakes_nobody() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    start = clock.now
    sleep = asyncio.ensure_future(pauses.sleep(A, 1.0))
    await clock.advance(0.1)
    pauses.pause(B, 5.0)
    await clock.advance(0)
    assert not sleep.done()
    await clock.run(sleep)
    assert clock.now == pytest.approx(start + 1.0)


@async_test
async def test_a_sleep_leaves_nothing_behind() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    await clock.run(pauses.sleep(A, 1.0))
    pauses.pause(A, 5.0)  # nobody to wake
    sleep = asyncio.ensure_future(pauses.sleep(A, 1.0))
    await clock.advance(0)
    sleep.cancel()
    await clock.advance(0)
    assert clock.sleeping == [], "a cancelled wait cancels its timer"


@async_test
async def test_every_pause_tells_the_parking_area_and_forgets_the_local_view() -> None:
    throttle = Throttle()
    local = throttle.bucket.fallback.local
    local.acquire(A, limit("1/s"), 1, 60, 1)
    assert local.seen(A)
    throttle.pauses.pause(A, 5.0)
    heard, until = throttle.clock.wall(), throttle.clock.now + 5.0
    assert throttle.voidings == [(A, Pause(heard, until))]
    assert not local.seen(A), "what this worker saw of the bucket is forgotten"


@async_test
async def test_the_same_pause_heard_twice_is_kept_once() -> None:
    throttle = Throttle()
    throttle.pauses.pause(A, 5.0)
    await throttle.clock.advance(SAME_PAUSE / 2)
    throttle.pauses.pause(A, 5.0 - SAME_PAUSE / 2)
    assert len(throttle.voidings) == 1, "the second is the first, read again"


@async_test
async def test_a_domains_pauses_are_merged_past_the_most_kept() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    first_heard = clock.wall()
    for n in range(PAUSES_PER_DOMAIN + 1):
        pauses.pause(A, 100.0 - n)  # each heard later, ending sooner: kept apart
        await clock.advance(1.0)
    # Merged into one that voids all they voided, and more: the polite side.
    assert pauses.is_void(A, first_heard - 1, clock.now + 90)
    assert pauses.is_void(A, clock.wall() - 1.5, clock.now + 90)


@async_test
async def test_ended_pauses_are_forgotten_as_new_ones_come() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    for n in range(100):
        pauses.pause(f"d{n}.example", 1.0)
    await clock.advance(2.0)
    for n in range(100, 100 + 100 // SWEEP_STEP + 1):
        pauses.pause(f"d{n}.example", 60.0)
    # Each new pause forgets up to SWEEP_STEP ended ones: memory holds the pauses under way.
    assert len(pauses._pauses) == 100 // SWEEP_STEP + 1


@async_test
async def test_without_a_subscription_no_voiding_is_known() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    assert not pauses.knows_voidings(A, clock.wall(), elsewhere=False)


@async_test
async def test_a_subscription_knows_the_voidings_of_moments_reserved_since() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    pauses._listening_since = clock.wall()
    await clock.advance(0.1)
    assert pauses.knows_voidings(A, clock.wall(), elsewhere=False)
    assert not pauses.knows_voidings(A, clock.wall() - 1, elsewhere=False), "reserved before"
    assert not pauses.knows_voidings(A, clock.wall(), elsewhere=True), "within the margin"
    await clock.advance(CLOCK_MARGIN)
    assert pauses.knows_voidings(A, clock.wall(), elsewhere=True)


@async_test
async def test_a_voiding_read_while_listening_serves_that_domain_from_then_on() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    pauses._listening_since = clock.wall()
    pauses.read(A, None, clock.wall())
    assert pauses.knows_voidings(A, clock.wall() - 100, elsewhere=True)
    assert not pauses.knows_voidings(B, clock.wall() - 100, elsewhere=True)


@async_test
async def test_a_voiding_read_from_redis_voids_what_it_voided() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    pauses.read(A, Voiding(age=2.0, left=10.0), clock.wall())
    assert pauses.is_void(A, clock.wall() - 3, clock.now + 9)
    assert not pauses.is_void(A, clock.wall() - 1, clock.now + 9), "reserved after it"


@async_test
async def test_a_voiding_read_before_the_subscription_serves_nothing() -> None:
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    read_at = clock.wall()
    await clock.advance(1.0)
    pauses._listening_since = clock.wall()
    pauses.read(A, None, read_at)
    assert not pauses.knows_voidings(A, clock.wall() - 100, elsewhere=True)


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"7",
        b"5000000",  # no time, no domain
        b"5000000 7",  # no domain
        b"5000000 a.example",  # no time
        b"-5 7 a.example",
        b"1.5 7 a.example",
        b"5 -7 a.example",
        b"5 7.5 a.example",
        "²³ 7 a.example".encode(),
        b"1" + b"0" * 15 + b" 7 a.example",  # more digits than any pause
        b"5 1" + b"0" * 15 + b" a.example",  # more digits than any time
        b"\xff\xfe 7 a.example",
    ],
)
@async_test
async def test_a_message_that_is_no_pause_is_counted_and_voids_nothing(message: bytes) -> None:
    throttle = Throttle()
    throttle.pauses._received(message)
    assert throttle.voidings == []
    assert throttle.stat("bad_messages") == 1


@async_test
async def test_a_pause_message_pauses_its_domain() -> None:
    throttle = Throttle()
    throttle.pauses._received(b"2500000 7 a.example")
    assert throttle.pauses.paused_for(A) == pytest.approx(2.5)
    assert throttle.stat("bad_messages") is None


@async_test
async def test_a_change_of_rate_voids_moments_and_pauses_nothing() -> None:
    """A limit set live or an adaptive decrease voids the moments reserved before it (up to the
    last of them, here 80 s ahead), but requests may go at once: a worker that paces alone
    does not hold the domain, and the log's summary says no pause."""
    throttle = Throttle()
    wall = throttle.clock.wall()
    throttle.pauses._received(b"v80000000 7 a.example")
    assert throttle.pauses.is_void(A, wall - 1, throttle.clock.now + 60)
    assert throttle.pauses.paused_for(A) == 0.0
    throttle.pauses._received(b"2500000 7 a.example")
    assert throttle.pauses.paused_for(A) == pytest.approx(2.5), "a pause after it holds"
    assert throttle.pauses.is_void(A, wall - 1, throttle.clock.now + 60), "both kept"


@async_test
async def test_a_domain_of_any_bytes_in_a_message_is_that_domain() -> None:
    throttle = Throttle()
    throttle.pauses._received(b"1000000 7 \xff.example")
    assert throttle.voidings[0][0] == "\udcff.example"


@pytest.mark.parametrize(
    ("value", "date", "seconds"),
    [
        (None, None, None),
        (b"", None, None),
        (b"120", None, 120.0),
        (b" 007 ", None, 7.0),
        (b"0", None, 0.0),
        (b"9" * 400, None, 1e9),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", b"Wed, 21 Oct 2015 07:27:00 GMT", 60.0),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", b"Wed, 21 Oct 2015 07:29:00 GMT", 0.0),
    ],
)
def test_retry_after_is_seconds_or_a_date_by_the_sites_clock(
    value: bytes | None, date: bytes | None, seconds: float | None
) -> None:
    assert parse_retry_after(value, date, time.time()) == seconds


def test_a_retry_after_date_without_the_sites_date_counts_from_now() -> None:
    """*now*: the clock's wall time, not the machine's."""
    date = b"Wed, 21 Oct 2015 07:28:00 GMT"
    at = 1445412480.0  # that date, by the epoch
    assert parse_retry_after(date, None, at - 30) == 30.0
    assert parse_retry_after(date, None, at + 30) == 0.0


@pytest.mark.parametrize("value", [b"-1", b"1.5", "²".encode(), b"soon", b"\xff"])
def test_a_retry_after_of_another_form_is_refused_saying_why(value: bytes) -> None:
    with pytest.raises(ValueError, match="neither seconds nor an HTTP-date"):
        parse_retry_after(value, None, time.time())


@async_test
async def test_a_wait_cancelled_as_a_pause_wakes_it_stays_cancelled() -> None:
    """A pause wakes a held request by cancelling its sleep: a cancellation of the request
    itself in the same turn is not taken for that wake-up."""
    pauses, clock = (throttle := Throttle()).pauses, throttle.clock
    wait = asyncio.ensure_future(pauses.sleep(A, 5.0))
    await clock.advance(0)
    pauses.pause(A, 10.0)
    wait.cancel()
    await clock.advance(0)
    assert wait.cancelled()
    assert clock.sleeping == []


@async_test
async def test_a_moment_reserved_after_a_voiding_by_redis_s_clock_is_not_void() -> None:
    """A limit set live (or a lower adaptive rate) starts the bucket again at once: its next
    moments fall within the voided ones, reserved just after the voiding. Redis's clock tells
    them apart exactly; the wall clocks, allowing 1 s for another machine's, took every moment
    reserved in the next second as void too (each asked again, its moment a hole at the site:
    gaps of 1 to 4 intervals, the domain on the old pace for the whole backlog, issue #43)."""
    throttle = Throttle()
    throttle.pauses._received(b"5000000 1000000 a.example")  # at 1 s by Redis's clock, for 5 s
    moment, wall = throttle.clock.now + 1, throttle.clock.wall()
    assert not throttle.pauses.is_void(A, wall + 0.5, moment, True, reserved_us=1_000_001)
    assert throttle.pauses.is_void(A, wall + 0.5, moment, True, reserved_us=999_999)
    assert not throttle.pauses.is_void(A, wall, moment + 5, True, reserved_us=999_999)
    # Without Redis's time (a moment taken alone while Redis failed): the wall clocks.
    assert throttle.pauses.is_void(A, wall + 0.5, moment, elsewhere=True)
    assert not throttle.pauses.is_void(A, wall + 0.5, moment, elsewhere=False)


@async_test
async def test_a_moment_reserved_elsewhere_after_a_live_change_goes_at_its_turn() -> None:
    """Another worker reserved it at the new pace, 0.2 s after the change by Redis's clock,
    and parked it; this one took it back: it goes at its moment, without asking again."""
    throttle = Throttle()
    throttle.pauses._received(b"30000000 1000000 a.example")
    wall = throttle.clock.wall()
    reservation = Reservation(after=2_200_000, step=1_000_000, at=1_200_000)
    ticket = Ticket(
        domain=A, due=throttle.clock.now + 0.5, reserved=True, locally=False, reserved_at=wall, waiting_since=wall, elsewhere=True,
        reservation=reservation,
    )  # fmt: skip
    assert await throttle.take(Request(f"http://{A}/1"), limit("1/s"), ticket) is None
    assert throttle.scripts.calls == [], "not asked again"
    assert throttle.stat("paused_reservations") is None


@pytest.mark.parametrize(
    ("data", "parsed"),
    [
        (
            b"2000000 8000000000000 a.example",
            Message("a.example", 2_000_000, 8_000_000_000_000, True),
        ),
        (b"0 1 a b", Message("a b", 0, 1, True)),
        (b"v2000000 8 a.example", Message("a.example", 2_000_000, 8, False)),  # a change of rate
        (b"v 1 a.example", None),
        (b"vv1 1 a.example", None),
        (b"1v 1 a.example", None),
        (b"2000000 8000000000000", None),  # no domain
        (b"-1 1 a.example", None),
        (b"1.5 1 a.example", None),
        ("² 1 a.example".encode(), None),  # a digit to str.isdigit(), not ASCII
        (b"1" * 16 + b" 1 a.example", None),  # over MAX_PAUSE_DIGITS
        (b"", None),
    ],
)
def test_a_message_on_the_channel_is_a_pause_a_voiding_or_nothing(
    data: bytes, parsed: Message | None
) -> None:
    assert parse_message(data) == parsed
