"""The fleet's "achieved" rate in ``status``: over the last minute, or over the time the fleet
has run when that is shorter (9 s after the start, 9 requests are 1/s, not 9 in 60 s)."""

from __future__ import annotations

import pytest
from fakes import Throttle, limit
from scrapy import Request
from support import async_test

from scrapy_redis_throttle.control import FleetActivity, _report

A = "a.example"


@async_test
async def test_a_worker_reports_how_long_its_last_minute_is() -> None:
    throttle = Throttle()
    activity = throttle.throttle.activity
    for n in range(3):
        assert await throttle.take(Request(f"http://{A}/{n}"), limit("1/s")) is None
    await throttle.clock.advance(7)  # 9 s after the start
    assert activity.report() == {A: [3, 0, 9000]}
    await throttle.clock.advance(120)
    assert activity.report() == {}, "nothing went in the last minute"


@pytest.mark.parametrize(
    ("reply", "entries"),
    [
        (b'{"a.example": [9, 2, 9000]}', [(A, 9, 2, 9.0)]),
        (b'{"a.example": [9, 2]}', [(A, 9, 2, 60.0)]),  # a worker of an earlier version
        (b'{"a.example": [9, 2, 9000000000]}', [(A, 9, 2, 60.0)]),  # a minute at most
    ],
)
def test_a_report_is_read_with_its_minute(reply: bytes, entries: list[object]) -> None:
    assert _report(reply) == entries


@pytest.mark.parametrize("counts", ["[9, 2, -1]", "[9, 2, 1.5]", "[9]", "[9, 2, 3, 4]", '"9"'])
def test_a_report_that_is_no_counts_is_refused(counts: str) -> None:
    with pytest.raises(ValueError, match="is not"):
        _report(f'{{"a.example": {counts}}}'.encode())


def test_the_achieved_rate_counts_over_the_time_the_fleet_has_run() -> None:
    assert FleetActivity(went=9, held=0, parked=0, counted=9.0).achieved_rate == 1.0
    assert FleetActivity(went=120, held=0, parked=0).achieved_rate == 2.0, "a whole minute"
