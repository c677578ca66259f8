"""What a worker sends ``lua/token_bucket.lua`` and reads back (:func:`.script_args`,
:func:`.parse_reply`), without Redis: the positions tests/test_token_bucket.py exercises
through a real script."""

from __future__ import annotations

from fakes import limit

from scrapy_redis_throttle.one_node import LIVE_INVALID, PAUSED_POLL, parse_reply, script_args
from scrapy_redis_throttle.replies import Reservation

FIVE = limit("5/s", burst=2)  # an interval of 200,000 µs


def test_a_plain_call_sends_the_four_fixed_arguments_only() -> None:
    assert script_args(FIVE, 1, reserve=3) == [b"200000.0", b"2", b"1.0", b"3000000.0"]


def test_a_moment_or_another_scope_sends_the_optional_ones_in_their_places() -> None:
    """busy_until, not_before and alone follow the fixed four; then the domain's quotas (none
    here), then each other scope's interval, burst and busy_until."""
    one = limit("1/s")
    args = script_args(FIVE, 1, 0, busy_until=7, others=[("b.example", one, 9)], alone=True)
    assert args[4:] == [b"7", b"0", b"1", b"1000000.0", b"1", b"9"]
    assert script_args(FIVE, 1, not_before=5)[4:] == [b"0", b"5", b"0"]


def test_an_allowed_reply_tells_the_tokens_left_and_when_the_bucket_is_full() -> None:
    # status, retry_after µs, reset_after µs, Redis's time µs
    result = parse_reply([1, 0, 100_000, 5_000_000], FIVE, decided_at=10.0)
    assert result.allowed
    assert not result.reserved
    assert result.tokens_left == 1.5  # burst 2, half an interval to full
    assert result.reset_after == 0.1
    assert result.decided_at == 10.0
    assert result.moment_us == 5_000_000
    assert result.reservation is None


def test_a_reserved_reply_carries_what_gives_its_moment_back() -> None:
    # ... and, reserved, the step its tokens added to the bucket.
    result = parse_reply([2, 400_000, 600_000, 5_000_000, 200_000], FIVE)
    assert result.reserved
    assert result.retry_after == 0.4
    assert result.moment_us == 5_400_000
    assert result.reservation == Reservation(after=5_600_000, step=200_000, at=5_000_000)
    assert result.tokens_left == 0.0


def test_a_paused_reply_asks_again_later_and_a_bad_live_limit_is_flagged() -> None:
    paused = parse_reply([3, 0, 0, 5_000_000], FIVE)
    assert paused.paused
    assert not paused.allowed
    assert paused.retry_after == PAUSED_POLL
    flagged = parse_reply([1 + LIVE_INVALID, 0, 0, 5_000_000], FIVE)
    assert flagged.allowed
    assert flagged.live_invalid


def test_the_quotas_left_bound_the_tokens_left() -> None:
    result = parse_reply([1, 0, 0, 5_000_000, 1], FIVE)
    assert result.tokens_left == 1
