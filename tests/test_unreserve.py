"""Reserved moments given back (lua/unreserve.lua), run in a real redis-server.

Reservations are taken at a slow rate (one token a minute): between two calls the bucket cannot
refill, so every moment below is exact whatever the machine's load."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from local_redis import RedisServer
from support import redis_now_us

from scrapy_redis_throttle.one_node import UNRESERVE_BATCH, parse_reply, script_args
from scrapy_redis_throttle.rates import Limit, parse_limit
from scrapy_redis_throttle.redis_schema import UNRESERVED_SUFFIX, void_key
from scrapy_redis_throttle.replies import Reservation
from scrapy_redis_throttle.scripts import load_script

KEY = "test:{example.com}"
ASIDE = KEY + UNRESERVED_SUFFIX
VOID = void_key("test", "example.com")
SLOW = Limit(rate=1 / 60, burst=1, text="1/m")
MINUTE_US = 60_000_000


class Bucket:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.acquire_script = client.register_script(load_script("token_bucket.lua"))
        self.unreserve_script = client.register_script(load_script("unreserve.lua"))

    def reserve(self, limit: Limit = SLOW) -> Reservation:
        """Reserve the next moment (an hour ahead at most)."""
        reply = self.acquire_script(keys=[KEY], args=script_args(limit, 1, reserve=3600))
        result = parse_reply(reply, limit)
        if result.allowed:
            return self.reserve(limit)  # the bucket's burst: the next one is reserved
        assert result.reserved, reply
        assert result.reservation is not None, reply
        return result.reservation

    def unreserve(self, *reservations: Reservation) -> list[int]:
        args = [value for reservation in reservations for value in reservation]
        return self.unreserve_script(keys=[KEY, ASIDE, VOID], args=args)  # type: ignore[no-any-return]

    def tat(self) -> int | None:
        value = self.client.get(KEY)
        return None if value is None else int(value.split()[0])


@pytest.fixture
def bucket(redis_server: RedisServer) -> Iterator[Bucket]:
    with redis_server.client() as client:
        yield Bucket(client)


def test_a_reservation_says_where_the_bucket_was_and_where_it_went(bucket: Bucket) -> None:
    first, second = bucket.reserve(), bucket.reserve()
    assert first.step == second.step == MINUTE_US
    assert second.after == first.after + MINUTE_US
    assert bucket.tat() == second.after


def test_the_last_reservations_go_back_at_once(bucket: Bucket) -> None:
    went = bucket.reserve()  # (sent: not given back)
    kept = [bucket.reserve(), bucket.reserve(), bucket.reserve()]

    assert bucket.unreserve(*reversed(kept)) == [3, 0]
    assert bucket.tat() == went.after, "as if the three were never reserved"
    again = bucket.reserve()
    assert again[:2] == kept[0][:2], "the next request gets the first moment given back"


def test_one_reserved_before_others_waits_for_them_to_be_given_back(bucket: Bucket) -> None:
    """Two workers' reservations, interleaved: one worker's alone cannot go back (a new
    request would share a moment the other worker still holds), until the other's do."""
    went = bucket.reserve()
    one = [bucket.reserve(), bucket.reserve()]
    other = bucket.reserve()
    one.append(bucket.reserve())

    assert bucket.unreserve(one[0]) == [0, 1], "set aside: others were reserved after it"
    assert bucket.tat() == one[-1].after
    assert bucket.unreserve(one[-1], one[1]) == [1, 1], "the last went; the other waits"
    assert bucket.tat() == other.after
    # Meanwhile a new request still gets a moment of its own, after every one held...
    latest = bucket.reserve()
    assert latest.after == other.after + MINUTE_US
    assert bucket.unreserve(latest) == [1, 0]
    assert bucket.unreserve(other) == [3, 0], "with the two set aside below it"
    assert bucket.tat() == went.after
    assert bucket.client.exists(ASIDE) == 0, "nothing left aside"


def test_what_is_set_aside_expires_with_the_bucket(bucket: Bucket) -> None:
    bucket.reserve()
    aside = bucket.reserve()
    bucket.reserve()
    assert bucket.unreserve(aside) == [0, 1]
    # Read in one transaction: at one moment of Redis's clock (two calls were 2 ms apart once).
    pipe = bucket.client.pipeline(transaction=True)
    pipe.pttl(ASIDE)
    pipe.pttl(KEY)
    aside_ttl, bucket_ttl = pipe.execute()
    assert abs(aside_ttl - bucket_ttl) <= 1


def test_moments_past_and_moments_the_bucket_never_held_are_not_given_back(
    bucket: Bucket,
) -> None:
    went = bucket.reserve()
    kept = bucket.reserve()
    now = redis_now_us(bucket.client)
    passed = Reservation(now - 1, 1, now - 2)
    unknown = Reservation(kept.after + 1, 2, now)
    # Made "after" now: Redis's clock stepped back since (a failover): none to trust.
    stepped = Reservation(kept.after, kept.step, now + 10_000_000)
    assert bucket.unreserve(passed, unknown, stepped) == [0, 0]
    assert bucket.tat() == kept.after
    assert bucket.client.exists(ASIDE) == 0
    assert bucket.unreserve(kept) == [1, 0]
    assert bucket.tat() == went.after


def test_a_limit_set_live_stays_when_moments_are_given_back(bucket: Bucket) -> None:
    went = bucket.reserve()
    kept = bucket.reserve()
    bucket.client.set(KEY, f"{kept.after} 0.5 2 0 t5/200000")
    assert bucket.unreserve(kept) == [1, 0]
    assert bucket.client.get(KEY) == f"{went.after} 0.5 2 0 t5/200000".encode()
    assert bucket.client.pttl(KEY) == -1, "a live limit lives as long as it is set"


def test_a_bucket_given_back_everything_is_full_and_gone(bucket: Bucket) -> None:
    # A reservation whose "before" has passed: the request before it went long ago.
    after = redis_now_us(bucket.client) + MINUTE_US
    bucket.client.set(KEY, str(after), px=MINUTE_US // 1000)
    # One set aside whose moment passed (it expires with the last one set aside).
    bucket.client.hset(ASIDE, str(after - 2 * MINUTE_US), f"5 {after - 3 * MINUTE_US}")
    assert bucket.unreserve(Reservation(after, 2 * MINUTE_US, after - 2 * MINUTE_US)) == [1, 0]
    assert bucket.client.exists(KEY) == 0, "full: an idle domain's key vanishes"
    assert bucket.client.hlen(ASIDE) == 1, "what was reserved before a full bucket is spent"


@pytest.mark.parametrize(
    "args",
    [
        ["1", "1"],
        ["x", "1", "0"],
        ["nan", "1", "0"],
        ["1e400", "1", "0"],
        ["1.5", "1", "0"],
        ["100", "0", "0"],
        ["100", "-5", "0"],
        ["100", "101", "0"],
        ["100", "2.5", "0"],
        ["100", "1", "0.5"],
        ["100", "1", "nan"],
        ["100", "1", "1e16"],
        ["1e16", "1", "0"],
        ["1", "1", "0"] * (UNRESERVE_BATCH + 1),
    ],
)
def test_bad_arguments_are_refused_naming_them(bucket: Bucket, args: list[str]) -> None:
    bucket.reserve()
    kept = bucket.reserve()
    with pytest.raises(redis.ResponseError, match="redis_throttle: "):
        bucket.unreserve_script(keys=[KEY, ASIDE, VOID], args=args)
    assert bucket.tat() == kept.after, "nothing changed"


def test_python_sends_at_most_what_the_script_takes() -> None:
    assert f"local MAX_RESERVATIONS = {UNRESERVE_BATCH}\n" in load_script("unreserve.lua")


@pytest.mark.parametrize(
    "garbage",
    [b"x", b"-5", b"1.5", b"nan", b"9" * 40, b"0", b"5", b"5 x", b"0 1", b"5 " + b"9" * 40],
)
def test_garbage_set_aside_is_ignored_not_an_error(bucket: Bucket, garbage: bytes) -> None:
    went = bucket.reserve()
    aside, kept = bucket.reserve(), bucket.reserve()
    bucket.client.hset(ASIDE, str(aside.after), garbage)
    assert bucket.unreserve(kept) == [1, 0], "the cascade stops at what is no step"
    assert bucket.tat() == aside.after
    assert went.after < aside.after


@pytest.mark.parametrize("state", [b"garbage", b"12 x", b"9" * 5000, b"1" + b"0" * 30])
def test_a_garbage_bucket_is_left_alone(bucket: Bucket, state: bytes) -> None:
    bucket.reserve()
    kept = bucket.reserve()
    bucket.client.set(KEY, state)
    assert bucket.unreserve(kept) == [0, 0]
    assert bucket.client.get(KEY) == state


def test_a_reservation_with_more_limits_says_where_the_bucket_went(bucket: Bucket) -> None:
    """With quotas the reply carries the requests they allow before the step: still read."""
    limit = parse_limit(
        ["1/m", {"rate": "10/h", "algorithm": "sliding_window"}], default_burst=1, source="test"
    )
    assert limit is not None
    keys = [KEY, KEY + ":rate", KEY + ":quota", KEY + ":log"]
    replies = [
        bucket.acquire_script(keys=keys, args=script_args(limit, 1, reserve=3600)) for _ in range(2)
    ]
    reserved = parse_reply(replies[1], limit)
    assert reserved.reserved
    assert reserved.reservation == Reservation(bucket.tat() or 0, MINUTE_US, replies[1][3])
    assert bucket.unreserve(reserved.reservation) == [1, 0]


def test_reservations_made_before_a_voiding_are_never_given_back(bucket: Bucket) -> None:
    """A limit set live (or an adaptive decrease) voids the moments reserved before it and
    sets the bucket's time anew: the new reservations may then have the same "after" values as
    the void ones. A void one, given back or set aside before, must not free a new one's
    moment (its worker holds it)."""
    went = bucket.reserve()
    # Reserved 5 s ago (as if), then voided 3 s ago: the reservations since are 3 s younger.
    void_one, void_two = (
        reservation._replace(at=reservation.at - 5_000_000)
        for reservation in (bucket.reserve(), bucket.reserve())
    )
    assert bucket.unreserve(void_one) == [0, 1], "set aside"
    # The voiding, as set_limit.lua writes it: the bucket's time back to where it was.
    voided_at = redis_now_us(bucket.client) - 3_000_000
    bucket.client.set(VOID, f"{voided_at} {void_two.after}", px=2 * MINUTE_US // 1000)
    bucket.client.set(KEY, str(went.after), px=MINUTE_US // 1000)
    held, latest = bucket.reserve(), bucket.reserve()
    assert (held.after, latest.after) == (void_one.after, void_two.after), "the same times"

    assert bucket.unreserve(void_two) == [0, 0], "void: not given back, nor set aside"
    assert bucket.unreserve(latest) == [1, 0], "the void one set aside is no step to take"
    assert bucket.tat() == held.after, "the moment of the request still held stays its own"
    # Within a second of the voiding, a reservation may be void: one whose Redis stepped back.
    bucket.client.set(VOID, f"{held.at - 500_000} {held.after}", px=MINUTE_US // 1000)
    assert bucket.unreserve(held) == [0, 0]
