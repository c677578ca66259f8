"""What of the limits set live reaches a worker (:mod:`.live_limits`): each acquire in a
domain's own bucket tells it; one INFO line at each change, none while it stays."""

from __future__ import annotations

import logging

import pytest
from fakes import Throttle, limit
from scrapy import Request
from support import async_test

from scrapy_redis_throttle import live_limits
from scrapy_redis_throttle.live_limits import NOTHING_LIVE, LiveLimit, LiveLimits
from scrapy_redis_throttle.one_node import parse_reply

A = "a.example"
FIVE = limit("5/s")
ONE = LiveLimit(rate=1, burst=None, paused=False)
PAUSED = LiveLimit(rate=None, burst=None, paused=True)


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    said = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
    caplog.clear()
    return said


def test_each_change_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    live = LiveLimits(dict)
    live.told(A, NOTHING_LIVE, FIVE)
    assert messages(caplog) == [], "its own limit, as ever: nothing to say"
    live.told(A, ONE, FIVE)
    live.told(A, ONE, FIVE)
    live.told(A, None, FIVE)  # not told (another scope's answer, or no Redis)
    assert messages(caplog) == [
        f"Redis throttle: {A!r} follows a limit set live for the fleet: 1/s (burst 1) "
        "(its own: 5/s (burst 1))"
    ]
    assert live.of(A) == ONE
    live.told(A, PAUSED, FIVE)
    live.told(A, PAUSED, FIVE)
    assert messages(caplog) == [
        f"Redis throttle: {A!r} is paused live for the fleet: no request to it until it is "
        f"resumed (scrapy-redis-throttle resume {A})"
    ]
    live.told(A, NOTHING_LIVE, FIVE)
    live.told(A, NOTHING_LIVE, FIVE)
    assert messages(caplog) == [f"Redis throttle: {A!r} is back to its own limit, 5/s (burst 1)"]
    assert live.of(A) is None


def test_the_domains_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_limits, "KEPT", 3)
    live = LiveLimits(dict)
    for n in range(5):
        live.told(f"d{n}.example", ONE, FIVE)
    assert [live.of(f"d{n}.example") for n in range(5)] == [None, None, ONE, ONE, ONE]


@pytest.mark.parametrize(
    ("reply", "live"),
    [
        ([1, 0, 0, 5_000_000, b""], NOTHING_LIVE),
        ([2, 400_000, 600_000, 5_000_000, 200_000, b"2.5 3 0"], LiveLimit(2.5, 3, False)),
        ([3, 0, 0, 5_000_000, b"- - 1"], PAUSED),
        ([1, 0, 0, 5_000_000, b"fast - 0"], None),  # garbage written by hand: not told
        ([1, 0, 0, 5_000_000], None),  # another scope's bucket, asked alone: not told
    ],
)
def test_a_reply_tells_the_limit_set_live_last(reply: list[object], live: object) -> None:
    result = parse_reply(reply, FIVE)
    assert result.live == live
    if reply[0] == 2:
        assert result.reservation is not None
        assert result.reservation.step == 200_000, "the step before the live limit"


def test_a_reply_with_quotas_tells_them_before_the_limit_set_live() -> None:
    result = parse_reply([1, 0, 0, 5_000_000, 1, b"1 - 0 f10/1000000"], FIVE)
    assert result.live is not None
    assert result.live.rate == 1
    assert [str(quota) for quota in result.live.quotas] == ["10/1s (fixed window)"]
    assert result.tokens_left == 1, "the quotas' count before it"


@async_test
async def test_a_worker_says_when_a_live_limit_reaches_it(caplog: pytest.LogCaptureFixture) -> None:
    """Through the worker's turns, in its wait lines and in its summary line."""
    caplog.set_level(logging.DEBUG, logger="scrapy_redis_throttle")
    throttle = Throttle()
    await throttle.take(Request(f"http://{A}/0"), FIVE)
    throttle.scripts.set_live(A, limit("1/s"))
    await throttle.take(Request(f"http://{A}/1"), FIVE)
    await throttle.take(Request(f"http://{A}/2"), FIVE)
    [waits] = [r.getMessage() for r in caplog.records if " waits " in r.getMessage()]
    assert waits.endswith(f"for {A!r} (1/s (burst 1))"), waits
    assert [m for m in messages(caplog) if "set live" in m] == [
        f"Redis throttle: {A!r} follows a limit set live for the fleet: 1/s (burst 1) "
        "(its own: 5/s (burst 1))"
    ]
    [line] = throttle.throttle.log_summary.lines()
    assert str(line).startswith(f"{A} 1/s (burst 1), set live: 3 sent"), str(line)
