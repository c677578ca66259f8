"""The parking area (:class:`.ParkingArea`, with the in-process store): what it takes, when it
gives requests back, what a voiding does, and what it keeps or drops at the close; on a fake
clock and a fake engine."""

from __future__ import annotations

import pytest
from fakes import RESERVATION, FakeClock, Yard
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.parking import BUSY_RETRY, RELEASE_AHEAD
from scrapy_redis_throttle.parking_stores import MemoryParking
from scrapy_redis_throttle.pauses import Pause
from scrapy_redis_throttle.replies import Reservation
from scrapy_redis_throttle.request_codec import Unparkable
from scrapy_redis_throttle.tickets import TICKET_META, Ticket

A, B = "a.example", "b.example"


@async_test
async def test_a_request_with_a_ticket_is_parked_not_scheduled() -> None:
    yard = Yard()
    request = yard.park(yard.ticket(5.0))
    await yard.clock.advance(0)
    assert TICKET_META not in request.meta
    assert yard.store.parked == 1
    assert yard.stat("parked") == 1
    assert yard.area.has_pending_requests(), "the spider stays open"
    assert yard.next_request() is None


@async_test
async def test_a_request_without_a_ticket_is_the_schedulers() -> None:
    yard = Yard()
    assert yard.area.enqueue_request(Request("http://a.example/")) is None
    assert not yard.area.has_pending_requests()


@pytest.mark.parametrize("due_in", [0.3, 2.0, 5.0, 37.25])
@async_test
async def test_a_parked_request_comes_back_release_ahead_before_it_is_due(due_in: float) -> None:
    yard = Yard()
    start = yard.clock.now
    ticket = yard.ticket(due_in)
    request = yard.park(ticket)
    back_at: list[float] = []
    while not back_at:
        await yard.clock.advance(0.01)
        if yard.crawler.engine.crawled:
            back_at.append(yard.clock.now - start)
    assert back_at[0] == pytest.approx(max(0.0, due_in - RELEASE_AHEAD), abs=0.011)
    assert yard.crawler.engine.crawled == [request]
    assert yard.next_request() is request
    assert yard.area.handoff.handed_out(request) == (True, ticket), "with its ticket, beside it"
    assert yard.store.parked == 0


@async_test
async def test_parked_requests_come_back_in_the_order_they_are_due() -> None:
    yard = Yard()
    late = yard.park(yard.ticket(3.0), 1)
    early = yard.park(yard.ticket(1.0), 2)
    await yard.clock.advance(3.0)
    assert yard.crawler.engine.crawled == [early, late]
    assert [yard.next_request(), yard.next_request()] == [early, late]


@async_test
async def test_requests_given_back_go_before_the_schedulers_own() -> None:
    yard = Yard()
    own = Request("http://b.example/own")
    yard.scheduled.append(own)
    parked = yard.park(yard.ticket(0.1))
    await yard.clock.advance(0.2)
    assert yard.next_request() is parked
    assert yard.next_request() is own
    assert yard.area.handoff.handed_out(own) == (True, None), "the scheduler's: it may be parked"


@async_test
async def test_handed_out_answers_once_and_only_for_what_was_handed_out() -> None:
    yard = Yard()
    own = Request("http://b.example/own")
    yard.scheduled.append(own)
    assert yard.next_request() is own
    assert yard.area.handoff.handed_out(own) == (True, None)
    assert yard.area.handoff.handed_out(own) == (False, None), "asked once per request"
    direct = Request("http://a.example/robots.txt")  # engine.download_async(): never parked
    assert yard.area.handoff.handed_out(direct) == (False, None)


@async_test
async def test_nothing_comes_back_while_the_engine_backs_out() -> None:
    yard = Yard()
    yard.crawler.engine.backout = True
    yard.park(yard.ticket(0.1))
    await yard.clock.advance(5.0)
    assert yard.crawler.engine.crawled == []
    yard.crawler.engine.backout = False
    await yard.clock.advance(BUSY_RETRY)
    assert len(yard.crawler.engine.crawled) == 1


@async_test
async def test_no_more_come_back_than_the_downloader_has_room_for() -> None:
    yard = Yard(concurrency=3)
    yard.crawler.engine.downloader.active = {Request(f"http://b.example/{n}") for n in range(2)}
    for n in range(3):
        yard.park(yard.ticket(0.1), n)
    await yard.clock.advance(1.0)
    assert len(yard.crawler.engine.crawled) == 1, "one free unit"
    yard.crawler.engine.downloader.active = set()
    await yard.clock.advance(BUSY_RETRY)
    assert len(yard.crawler.engine.crawled) == 3


@async_test
async def test_requests_given_back_and_not_yet_taken_use_up_the_room() -> None:
    yard = Yard(concurrency=2)
    for n in range(3):
        yard.park(yard.ticket(0.1), n)
    await yard.clock.advance(1.0)
    assert len(yard.crawler.engine.crawled) == 2
    yard.next_request()  # the engine takes one: its unit is the downloader's now
    yard.crawler.engine.downloader.active = {Request("http://a.example/taken")}
    await yard.clock.advance(1.0)
    assert len(yard.crawler.engine.crawled) == 2, "one downloading, one waiting to be taken"
    yard.next_request()
    yard.crawler.engine.downloader.active = set()
    await yard.clock.advance(BUSY_RETRY)
    assert len(yard.crawler.engine.crawled) == 3


@async_test
async def test_a_voiding_brings_back_what_it_voids_to_ask_again() -> None:
    yard = Yard()
    voided = yard.park(yard.ticket(10.0), 1)
    await yard.clock.advance(0.1)
    yard.area.void(A, Pause(yard.clock.wall(), yard.clock.now + 20))
    await yard.clock.advance(0)
    assert yard.crawler.engine.crawled == [voided], "back at once"
    assert yard.next_request() is voided
    handed, ticket = yard.area.handoff.handed_out(voided)
    assert handed
    assert ticket is not None
    assert not ticket.reserved, "it asks again"
    assert yard.stat("paused_reservations") == 1


@async_test
async def test_a_voiding_timed_by_redis_brings_back_only_moments_reserved_before_it() -> None:
    """Both reserved before the voiding was heard, by this worker's wall clock; by Redis's
    clock, which times the voiding and the reservations alike, one after it: it stays."""
    yard = Yard()
    wall, due = yard.clock.wall(), yard.clock.now + 10
    before = Ticket(
        domain=A,
        due=due,
        reserved=True,
        locally=False,
        reserved_at=wall,
        waiting_since=wall,
        reservation=Reservation(1, 1, 900_000),
    )
    after = Ticket(
        domain=A,
        due=due,
        reserved=True,
        locally=False,
        reserved_at=wall,
        waiting_since=wall,
        reservation=Reservation(1, 1, 1_100_000),
    )
    voided, kept = yard.park(before, 1), yard.park(after, 2)
    await yard.clock.advance(0.1)
    yard.area.void(A, Pause(yard.clock.wall(), yard.clock.now + 20, at_us=1_000_000))
    await yard.clock.advance(0)
    assert yard.crawler.engine.crawled == [voided]
    assert kept not in yard.crawler.engine.crawled
    assert yard.store.parked == 1


@async_test
async def test_a_voiding_leaves_alone_what_it_does_not_void() -> None:
    yard = Yard()
    heard_at = yard.clock.wall()
    yard.park(yard.ticket(30.0), 1)  # due after the voiding ends
    yard.park(yard.ticket(10.0, domain=B), 2)  # another domain
    yard.park(yard.ticket(10.0, reserved=False), 3)  # nothing reserved
    await yard.clock.advance(0.1)
    yard.park(yard.ticket(10.0), 4)  # reserved after the voiding was heard
    yard.area.void(A, Pause(heard_at + 0.05, yard.clock.now + 20))
    await yard.clock.advance(1.0)
    assert yard.crawler.engine.crawled == []
    assert yard.store.parked == 4


@async_test
async def test_two_voidings_of_a_domain_reach_the_area_as_one_that_covers_both() -> None:
    yard = Yard()
    early = yard.park(yard.ticket(10.0), 1)
    far = yard.park(yard.ticket(25.0), 2)
    await yard.clock.advance(0.1)
    yard.area.void(A, Pause(yard.clock.wall(), yard.clock.now + 12))
    yard.area.void(A, Pause(yard.clock.wall() - 50, yard.clock.now + 30))
    await yard.clock.advance(0)
    assert sorted(r.url for r in yard.crawler.engine.crawled) == sorted([early.url, far.url])


@async_test
async def test_at_the_close_without_keep_what_is_parked_is_dropped_and_given_back() -> None:
    yard = Yard(keep=False)
    for n in range(3):
        yard.park(yard.ticket(60.0), n)
    yard.park(yard.ticket(60.0, reserved=False), 3)
    await yard.clock.advance(0)
    await yard.clock.run(yard.area.stop())
    assert yard.stat("parked_not_crawled") == 4
    assert yard.metrics.snapshot().series[A].requests == {"canceled": 4}
    assert yard.given_back == [(A, [RESERVATION] * 3)], "the moments reserved go back"
    assert yard.stat("unreserved") == 3
    assert yard.kept == []


@async_test
async def test_at_the_close_with_keep_what_is_parked_goes_to_the_scheduler() -> None:
    yard = Yard(keep=True)
    parked = [yard.park(yard.ticket(60.0), n) for n in range(2)]
    await yard.clock.advance(0)
    await yard.clock.run(yard.area.stop())
    assert yard.kept == parked
    assert yard.stat("parked_not_crawled") is None
    assert yard.metrics.snapshot().series == {}, "kept: none canceled"
    assert yard.given_back == []


@async_test
async def test_given_back_but_not_taken_at_the_close_is_parked_again_to_ask_anew() -> None:
    yard = Yard(keep=True)
    request = yard.park(yard.ticket(0.1))
    await yard.clock.advance(0.2)
    assert yard.crawler.engine.crawled == [request]  # the engine has not taken it
    await yard.clock.run(yard.area.stop())
    assert yard.kept == [request]
    assert yard.given_back == [(A, [RESERVATION])], "its moment will not be used"


@async_test
async def test_a_request_that_cannot_be_parked_waits_in_the_downloader() -> None:
    yard = Yard()

    async def refuse(request: Request, ticket: Ticket) -> None:
        raise Unparkable("a callback that is no spider method")

    yard.store.park = refuse  # type: ignore[method-assign]
    ticket = yard.ticket(5.0)
    request = yard.park(ticket)
    await yard.clock.advance(0)
    assert yard.stat("unparkable") == 1
    assert yard.next_request() is request
    assert yard.area.handoff.handed_out(request) == (False, ticket), "not parked again: it holds"


@async_test
async def test_a_park_that_fails_otherwise_holds_the_request_too() -> None:
    yard = Yard()

    async def fail(request: Request, ticket: Ticket) -> None:
        raise OSError("disk full")

    yard.store.park = fail  # type: ignore[method-assign]
    request = yard.park(yard.ticket(5.0))
    await yard.clock.advance(0)
    assert yard.next_request() is request
    assert yard.area.handoff.handed_out(request)[0] is False
    assert yard.stat("parked") is None


@async_test
async def test_a_request_dropped_on_its_way_back_is_counted() -> None:
    yard = Yard()
    yard.crawler.engine.enqueue = None  # a request_scheduled handler dropped it
    yard.park(yard.ticket(0.1))
    await yard.clock.advance(0.2)
    assert yard.stat("parked_dropped") == 1
    assert yard.next_request() is None


@async_test
async def test_a_request_the_engine_refuses_to_take_back_waits_to_be_asked_for() -> None:
    yard = Yard()

    def refuse(request: Request) -> None:
        raise RuntimeError("the engine is closing")

    yard.crawler.engine.crawl = refuse  # type: ignore[method-assign]
    request = yard.park(yard.ticket(0.1))
    await yard.clock.advance(0.2)
    assert yard.next_request() is request, "taken when the engine next asks"


@async_test
async def test_the_in_process_store_gives_back_at_most_what_it_is_asked_for() -> None:
    clock = FakeClock()
    store = MemoryParking(None, clock)
    for n in range(5):
        ticket = Ticket(
            domain=A,
            due=clock.now + n * 0.1,
            reserved=False,
            locally=False,
            reserved_at=0.0,
            waiting_since=0.0,
        )
        await store.park(Request(f"http://a.example/{n}"), ticket)
    due, next_due = await store.unpark(ahead=1.0, limit=2)
    assert [request.url for request, _ in due] == ["http://a.example/0", "http://a.example/1"]
    assert next_due == pytest.approx(0.2)
    due, next_due = await store.unpark(ahead=0.0, limit=10)
    assert due == []
    assert store.parked == 3


@async_test
async def test_a_robots_txt_borrows_the_soonest_moment_of_a_request_waiting_for_it() -> None:
    """Requests back from the parking area with their moments, not yet seen by the middleware
    (they wait for their worker's robots.txt): the robots.txt of their domain goes at the
    soonest, whose request asks anew; another domain's, and an unreserved one, are left."""
    yard = Yard()
    later = yard.park(yard.ticket(0.3), 1)
    sooner = yard.park(yard.ticket(0.2), 2)
    other = yard.park(yard.ticket(0.1, domain="b.example"), 3)
    unreserved = yard.park(yard.ticket(0.1, reserved=False), 4)
    await yard.clock.advance(0.4)
    handed = [yard.next_request() for _ in range(4)]
    assert set(map(id, handed)) == set(map(id, [later, sooner, other, unreserved]))
    handoff = yard.area.handoff
    lent = handoff.lend(A)
    assert lent is not None
    assert lent.reserved
    assert lent.due == pytest.approx(yard.clock.now - 0.4 + 0.2), "the soonest"
    _, asks_anew = handoff.handed_out(sooner)
    assert asks_anew is not None
    assert (asks_anew.reserved, asks_anew.waiting_since) == (False, lent.waiting_since)
    assert handoff.lend(A) is not None, "the next: the later one's"
    assert handoff.lend(A) is None, "none reserved left for A"
    kept = handoff.handed_out(other)[1]
    assert kept is not None
    assert kept.reserved, "another domain's moment stays its request's"
