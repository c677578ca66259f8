"""A request's path through the :class:`.Throttle`, from the middleware's door: what skips the
throttle, which download slot a paced request goes through, and a ticket that no longer holds
for the request's budget."""

from __future__ import annotations

from typing import Any

from fakes import Throttle, limit
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.budgets import Budget, RequestBudget
from scrapy_redis_throttle.throttle import DOWNLOAD_SLOT_META
from scrapy_redis_throttle.tickets import OTHERS_META, Ticket

A = "a.example"
SLOT = "redis_throttle"
WITH_SLOT: dict[str, Any] = {
    "REDIS_THROTTLE_DOWNLOAD_SLOT": SLOT,
    "DOWNLOAD_SLOTS": {SLOT: {"delay": 0}},
}


def reserved(throttle: Throttle, domain: str = A) -> Ticket:
    """A ticket back from the parking area whose moment, reserved, is now."""
    wall = throttle.clock.wall()
    return Ticket(
        domain=domain,
        due=throttle.clock.now,
        reserved=True,
        locally=False,
        reserved_at=wall,
        waiting_since=wall,
    )


@async_test
async def test_a_paced_request_goes_through_the_throttle_s_download_slot() -> None:
    """Not through its domain's slot, whose per-process delay would hold it below the budget."""
    throttle = Throttle(**WITH_SLOT)
    request = Request(f"http://{A}/")
    assert await throttle.clock.run(throttle.throttle.request(request)) is None
    assert request.meta[DOWNLOAD_SLOT_META] == SLOT
    assert throttle.stat("requests") == 1


@async_test
async def test_a_slot_the_project_chose_stays() -> None:
    throttle = Throttle(**WITH_SLOT)
    request = Request(f"http://{A}/", meta={DOWNLOAD_SLOT_META: "own"})
    await throttle.clock.run(throttle.throttle.request(request))
    assert request.meta[DOWNLOAD_SLOT_META] == "own"


@async_test
async def test_an_opted_out_request_skips_the_throttle_and_leaves_its_slot() -> None:
    """dont_redis_throttle: counted as skipped, no call of Redis, and a redirect that carries
    the throttle's slot from a paced request goes through its own domain's slot again."""
    throttle = Throttle(**WITH_SLOT)
    request = Request(f"http://{A}/", meta={"dont_redis_throttle": True, DOWNLOAD_SLOT_META: SLOT})
    assert await throttle.throttle.request(request) is None
    assert DOWNLOAD_SLOT_META not in request.meta
    assert throttle.stat("skipped") == 1
    assert throttle.scripts.calls == []


@async_test
async def test_a_domain_without_a_limit_is_not_throttled() -> None:
    throttle = Throttle(REDIS_THROTTLE_RATES={A: None}, **WITH_SLOT)
    request = Request(f"http://{A}/")
    assert await throttle.throttle.request(request) is None
    assert DOWNLOAD_SLOT_META not in request.meta, "its own domain's slot"
    assert throttle.stat("unthrottled") == 1
    assert throttle.scripts.calls == []


@async_test
async def test_a_ticket_reserved_under_another_domain_asks_anew() -> None:
    """Its scope names another domain now: its moment was not reserved in this one's bucket."""
    throttle = Throttle()
    budget = RequestBudget(A, limit("2/s"))
    ticket = reserved(throttle, domain="b.example")
    assert (
        await throttle.clock.run(
            throttle.turns.take(Request(f"http://{A}/"), budget, ticket, False)
        )
        is None
    )
    assert [domain for domain, _ in throttle.scripts.calls] == [A]


@async_test
async def test_a_ticket_whose_other_budgets_changed_asks_anew() -> None:
    """Parked through one proxy, back through another: its moment is not reserved there."""
    throttle = Throttle()
    budget = RequestBudget(A, limit("2/s"), (Budget("proxy-b", limit("5/s")),))
    request = Request(f"http://{A}/", meta={OTHERS_META: ["proxy-a"]})
    await throttle.clock.run(throttle.turns.take(request, budget, reserved(throttle), False))
    assert [domain for domain, _ in throttle.scripts.calls] == [A]


@async_test
async def test_a_ticket_that_still_holds_goes_at_its_moment_without_asking() -> None:
    throttle = Throttle()
    budget = RequestBudget(A, limit("2/s"))
    request = Request(f"http://{A}/")
    await throttle.clock.run(throttle.turns.take(request, budget, reserved(throttle), False))
    assert throttle.scripts.calls == []
