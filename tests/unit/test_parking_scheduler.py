"""The scheduler's side of parking (:class:`.ParkingScheduler`): composed with the project's
scheduler, as the add-on makes it, or bound onto it, as the middleware line alone does; and
the settings the add-on writes for it. On a fake clock, with a scheduler of a list."""

from __future__ import annotations

import pytest
from fakes import ListScheduler, Yard, with_addon
from scrapy import Request, Spider
from scrapy.settings import Settings
from scrapy.utils.defer import maybe_deferred_to_future
from support import async_test

from scrapy_redis_throttle import ParkingScheduler, ThrottleConfigError
from scrapy_redis_throttle.config import inner_scheduler
from scrapy_redis_throttle.engine_hooks import bind_parking


def composed(yard: Yard | None = None) -> tuple[ParkingScheduler, ListScheduler]:
    inner = ListScheduler()
    scheduler = ParkingScheduler(inner)
    if yard is not None:
        scheduler.park_with(yard.area)
        yard.crawler.engine.enqueue = scheduler.enqueue_request
    return scheduler, inner


def test_without_a_parking_area_it_is_the_project_scheduler() -> None:
    """What the peers' own scheduler tests check too (tests/peers), bound onto theirs."""
    scheduler, inner = composed()
    spider = Spider("s")
    scheduler.open(spider)
    request = Request("http://a.example/1")
    assert scheduler.enqueue_request(request) is True
    assert len(scheduler) == 1
    assert scheduler.has_pending_requests()
    assert scheduler.queue is inner.queue, "what is read of it is the inner scheduler's"
    assert scheduler.next_request() is request
    assert scheduler.close("finished") is None, "its own close, at once"
    assert inner.calls[:2] == ["open", "enqueue http://a.example/1"]
    assert inner.calls[-1] == "close finished"


@async_test
async def test_a_request_with_a_ticket_is_parked_not_queued() -> None:
    yard = Yard()
    scheduler, inner = composed(yard)
    yard.park(yard.ticket(5.0))
    scheduler.enqueue_request(Request("http://b.example/own"))
    await yard.clock.advance(0)
    assert [request.url for request in inner.queue] == ["http://b.example/own"]
    assert yard.store.parked == 1


@async_test
async def test_parked_requests_come_back_ahead_of_the_projects_own() -> None:
    yard = Yard()
    scheduler, inner = composed(yard)
    inner.enqueue_request(Request("http://b.example/own"))
    parked = yard.park(yard.ticket(0.2))
    await yard.clock.advance(0.5)
    assert scheduler.next_request() is parked
    assert scheduler.next_request().url == "http://b.example/own"  # type: ignore[union-attr]


@async_test
async def test_the_spider_stays_open_while_requests_are_parked() -> None:
    yard = Yard()
    scheduler, inner = composed(yard)
    assert not scheduler.has_pending_requests()
    yard.park(yard.ticket(60.0))
    await yard.clock.advance(0)
    assert scheduler.has_pending_requests(), "parked, though the project's queue is empty"
    assert not inner.has_pending_requests()


@async_test
async def test_while_it_is_busy_the_project_scheduler_does_not_block_for_more() -> None:
    """scrapy-redis's SCHEDULER_IDLE_BEFORE_CLOSE blocks an empty queue's pop: not while
    requests are parked (or downloading), whose moments it would delay."""
    yard = Yard()
    scheduler, inner = composed(yard)
    inner.idle_before_close = 5
    yard.park(yard.ticket(60.0))
    await yard.clock.advance(0)
    assert scheduler.next_request() is None
    assert inner.calls[-1] == "next idle_before_close=0"
    assert inner.idle_before_close == 5, "restored"


@async_test
async def test_at_the_close_parked_requests_are_kept_before_the_project_closes() -> None:
    inner = ListScheduler()
    yard = Yard(keep=True, keep_into=inner.enqueue_request)
    scheduler = ParkingScheduler(inner)
    scheduler.park_with(yard.area)
    yard.park(yard.ticket(60.0))
    await yard.clock.advance(0)
    closing = scheduler.close("finished")
    assert closing is not None, "it stops the parking area first"
    await yard.clock.run(maybe_deferred_to_future(closing))
    assert inner.calls == ["enqueue http://a.example/0", "close finished"]


@async_test
async def test_bound_onto_the_project_scheduler_it_decides_the_same() -> None:
    """With the middleware line alone, the engine runs the project's scheduler: its methods
    become a ParkingScheduler's, which still calls the originals (no recursion)."""
    yard = Yard()
    inner = ListScheduler()
    scheduler = bind_parking(inner)
    scheduler.park_with(yard.area)
    yard.crawler.engine.enqueue = inner.enqueue_request
    inner.enqueue_request(Request("http://b.example/own"))
    parked = yard.park(yard.ticket(0.2))
    await yard.clock.advance(0.5)
    assert inner.has_pending_requests()
    assert inner.next_request() is parked
    assert inner.next_request().url == "http://b.example/own"  # type: ignore[union-attr]
    assert inner.next_request() is None


def test_the_addon_composes_the_projects_scheduler_with_parking() -> None:
    settings = with_addon(SCHEDULER="scrapy_redis.scheduler.Scheduler")
    assert settings["SCHEDULER"] == "scrapy_redis_throttle.parking_scheduler.ParkingScheduler"
    assert settings["REDIS_THROTTLE_SCHEDULER"] == "scrapy_redis.scheduler.Scheduler"
    assert settings.getpriority("SCHEDULER") == settings.getpriority("REDIS_THROTTLE_SCHEDULER")
    assert inner_scheduler(settings, ParkingScheduler).__module__ == "scrapy_redis.scheduler"


def test_the_addon_composes_scrapys_scheduler_by_default() -> None:
    settings = with_addon()
    assert settings["REDIS_THROTTLE_SCHEDULER"] == "scrapy.core.scheduler.Scheduler"


class ProjectParkingScheduler(ParkingScheduler):
    """A project's own subclass."""


def test_the_addon_leaves_a_projects_own_parking_scheduler_alone() -> None:
    path = f"{__name__}.ProjectParkingScheduler"
    settings = with_addon(
        SCHEDULER=path, REDIS_THROTTLE_SCHEDULER="scrapy_redis.scheduler.Scheduler"
    )
    assert settings["SCHEDULER"] == path
    assert settings["REDIS_THROTTLE_SCHEDULER"] == "scrapy_redis.scheduler.Scheduler"


def test_the_addon_leaves_a_parking_scheduler_the_project_names_alone() -> None:
    settings = with_addon(
        SCHEDULER=ParkingScheduler, REDIS_THROTTLE_SCHEDULER="scrapy_redis.scheduler.Scheduler"
    )
    assert settings["SCHEDULER"] is ParkingScheduler
    assert settings["REDIS_THROTTLE_SCHEDULER"] == "scrapy_redis.scheduler.Scheduler"


@pytest.mark.parametrize(
    "value",
    [
        "no.such.Scheduler",
        "scrapy.Request",
        "scrapy_redis_throttle.ParkingScheduler",
        ParkingScheduler,
        42,
    ],
)
def test_a_scheduler_to_compose_that_is_none_fails_at_start_naming_the_setting(
    value: object,
) -> None:
    with pytest.raises(ThrottleConfigError, match="REDIS_THROTTLE_SCHEDULER"):
        inner_scheduler(Settings({"REDIS_THROTTLE_SCHEDULER": value}), ParkingScheduler)
