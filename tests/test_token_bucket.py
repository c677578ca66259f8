"""The Lua token bucket, run in a real redis-server.

Exact expectations use the fact that the script only moves with Redis's clock: between two calls
the bucket can have refilled at most ``rate x elapsed`` tokens, where ``elapsed`` is measured around
the calls, so every bound below holds whatever the machine's load.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from local_redis import RedisServer
from support import async_test, redis_now_us, wait_until

from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.one_node import parse_reply, script_args
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.redis_schema import bucket_key
from scrapy_redis_throttle.replies import AcquireResult
from scrapy_redis_throttle.scripts import load_script

KEY = "test:{example.com}"


def _ms(result: AcquireResult) -> tuple[float, float]:
    return result.retry_after * 1000, result.reset_after * 1000


class Bucket:
    """Calls the script the way the middleware does, with a synchronous client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.script = client.register_script(load_script("token_bucket.lua"))

    def call(
        self, rate: float, burst: int, cost: float = 1, key: str = KEY
    ) -> tuple[bool, float, float, float]:
        limit = Limit(rate, burst, "test")
        result = parse_reply(self.script(keys=[key], args=script_args(limit, cost)), limit)
        return result.allowed, result.tokens_left, *_ms(result)

    def reserve(
        self, rate: float, burst: int, ahead: float, cost: float = 1
    ) -> tuple[int, float, float, float]:
        limit = Limit(rate, burst, "test")
        result = parse_reply(self.script(keys=[KEY], args=script_args(limit, cost, ahead)), limit)
        status = 1 if result.allowed else 2 if result.reserved else 0
        return status, result.tokens_left, *_ms(result)

    def call_raw(self, *args: Any) -> Any:
        return self.script(keys=[KEY], args=list(args))


@pytest.fixture
def bucket(redis_server: RedisServer) -> Iterator[Bucket]:
    with redis_server.client() as client:
        yield Bucket(client)


def test_burst_then_refuse_with_exact_wait(bucket: Bucket) -> None:
    started = time.monotonic()
    results = [bucket.call(rate=10, burst=3) for _ in range(4)]
    elapsed = time.monotonic() - started
    refill = 10 * elapsed  # tokens that may have come back meanwhile

    assert [r[0] for r in results] == [True, True, True, False]
    for expected, (_, tokens, _, _) in zip([2, 1, 0], results, strict=False):
        assert expected <= tokens <= expected + refill
    _, tokens, retry_ms, reset_ms = results[3]
    assert 0 <= tokens < 1
    # One token takes 100 ms to come back; part of it may already have.
    assert 100 - 1000 * elapsed <= retry_ms <= 100
    assert 300 - 1000 * elapsed <= reset_ms <= 300


def test_refills_at_the_configured_rate(bucket: Bucket) -> None:
    bucket.call(rate=20, burst=2)
    bucket.call(rate=20, burst=2)
    allowed, _, retry_ms, _ = bucket.call(rate=20, burst=2)
    assert not allowed
    time.sleep(retry_ms / 1000)  # exactly the wait the script asked for
    allowed, tokens, _, _ = bucket.call(rate=20, burst=2)
    assert allowed, "a request must go once the returned wait has passed"
    assert tokens < 1
    assert not bucket.call(rate=20, burst=2)[0], "only one token came back"


def test_cost_takes_several_tokens(bucket: Bucket) -> None:
    started = time.monotonic()
    allowed, tokens, _, _ = bucket.call(rate=1, burst=10, cost=4)
    assert allowed
    assert 6 <= tokens <= 6 + (time.monotonic() - started)
    allowed, tokens, retry_ms, _ = bucket.call(rate=1, burst=10, cost=7)
    elapsed = time.monotonic() - started
    assert not allowed, "7 tokens asked, about 6 left"
    assert 6 <= tokens <= 6 + elapsed
    assert 1000 - 1000 * elapsed <= retry_ms <= 1000
    assert bucket.call(rate=1, burst=10, cost=6)[0], "what is left can still be taken"


def test_rates_below_one_per_second(bucket: Bucket) -> None:
    assert bucket.call(rate=0.1, burst=1)[0]  # "1/10s"
    allowed, _, retry_ms, _ = bucket.call(rate=0.1, burst=1)
    assert not allowed
    assert 9_000 < retry_ms <= 10_000
    assert bucket.call(rate=1 / 3600, burst=1, key="test:{hourly}")[0]  # "1/h"
    allowed, _, retry_ms, reset_ms = bucket.call(rate=1 / 3600, burst=1, key="test:{hourly}")
    assert not allowed
    assert 3_599_000 < retry_ms <= 3_600_000
    assert 3_599_000 < reset_ms <= 3_600_000


@pytest.mark.parametrize("rate", [3, 7, 1 / 3])
def test_a_full_bucket_lets_the_request_go_whatever_the_interval(
    bucket: Bucket, rate: float
) -> None:
    # 1e6 / rate µs is no whole number: rounding it must not reserve the first token for 1 µs.
    status, _, retry_ms, _ = bucket.reserve(rate=rate, burst=1, ahead=300)
    assert (status, retry_ms) == (1, 0)


def test_high_rates_are_exact_to_the_microsecond(bucket: Bucket) -> None:
    assert bucket.call(rate=5000, burst=1)[0]
    allowed, _, retry_ms, _ = bucket.call(rate=5000, burst=1)
    # Either the 200 µs token already came back, or the wait is at most 0.2 ms.
    assert allowed or 0 < retry_ms <= 0.2


def test_state_expires_when_the_bucket_is_full_again(bucket: Bucket) -> None:
    bucket.call(rate=1, burst=5)
    pttl = bucket.client.pttl(KEY)
    assert 0 < pttl <= 1000, "one token taken: full again within a second"
    assert bucket.client.keys("*") == [KEY.encode()], "the script touches only its key"

    bucket.call(rate=50, burst=1)  # 20 ms to refill
    wait_until(
        lambda: bucket.client.exists(KEY) == 0, timeout=5, message="idle bucket key to expire"
    )


def test_tokens_left_is_never_negative_when_workers_disagree_on_the_burst(bucket: Bucket) -> None:
    assert bucket.call(rate=1, burst=5, cost=5)[0]  # this worker's limit allows a burst of 5
    allowed, tokens, retry_ms, _ = bucket.call(rate=1, burst=1)  # another's allows 1
    assert not allowed
    assert tokens == 0
    assert 4000 < retry_ms <= 5000


def test_reservations_line_up_within_the_horizon(bucket: Bucket) -> None:
    started = time.monotonic()
    statuses = [bucket.reserve(rate=10, burst=1, ahead=0.35) for _ in range(6)]
    elapsed = time.monotonic() - started
    # Now, then reserved 100, 200 and 300 ms ahead; the fifth would be 400 ms ahead: refused.
    assert [s[0] for s in statuses] == [1, 2, 2, 2, 0, 0]
    for n, (_, tokens, retry_ms, _) in enumerate(statuses[1:4], start=1):
        assert tokens == 0
        assert 100 * n - 1000 * elapsed <= retry_ms <= 100 * n
    _, _, retry_ms, reset_ms = statuses[4]
    assert 400 - 1000 * elapsed <= retry_ms <= 400, "a refusal says when it could go"
    assert 400 - 1000 * elapsed <= reset_ms <= 400, "three reservations and one request pending"
    assert 0 < bucket.client.pttl(KEY) <= 400


@pytest.mark.parametrize("ahead", ["-inf", "nan", "abc"])
def test_invalid_reservation_horizon(bucket: Bucket, ahead: str) -> None:
    with pytest.raises(redis.ResponseError, match="reserve must be a finite number > -inf"):
        bucket.call_raw("1000", "1", "1", ahead)


def test_a_peek_takes_nothing_and_says_when(bucket: Bucket) -> None:
    """A reserve below 0 (across_nodes.py's peek): refused, nothing taken, with the wait the
    request would have."""
    limit = Limit(10, 1, "test")
    assert bucket.script(keys=[KEY], args=script_args(limit, 1, -1))[:2] == [0, 0]
    assert bucket.client.get(KEY) is None, "a full bucket stays full"
    assert bucket.script(keys=[KEY], args=script_args(limit, 1))[0] == 1
    taken = bucket.client.get(KEY)
    status, retry_us, *_ = bucket.script(keys=[KEY], args=script_args(limit, 1, -1))
    assert status == 0
    assert 0 < retry_us <= 100_000
    assert bucket.client.get(KEY) == taken


def test_not_before_moves_the_moment_and_the_reserve_counts_from_it(bucket: Bucket) -> None:
    """across_nodes.py's reservation at a moment: the bucket counts the request at not_before
    (not at its own earlier moment), reserve counting from there; a bucket that cannot take it
    then takes nothing and says when it could."""
    limit = Limit(10, 2, "test")
    moment = redis_now_us(bucket.client) + 500_000
    status, retry_us, reset_us, now_us, step, live = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 0, not_before=moment)
    )
    assert (status, now_us + retry_us) == (2, moment), "reserved at not_before exactly"
    assert live == b"", "last, the domain's limit set live: none"
    assert (now_us + reset_us, step) == (moment + 100_000, 100_000), "counted then"
    # The bucket holds one token at that moment (it was full, burst 2): another request may
    # share it, and a third may not.
    status, retry_us, _, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 0, not_before=moment)
    )
    assert (status, now_us + retry_us) == (2, moment)
    taken = bucket.client.get(KEY)
    status, retry_us, _, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 0, not_before=moment)
    )
    assert (status, now_us + retry_us) == (0, moment + 100_000), "refused: when it could go"
    assert bucket.client.get(KEY) == taken, "nothing taken"
    status, retry_us, _, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 0.1, not_before=moment)
    )
    assert (status, now_us + retry_us) == (2, moment + 100_000), "within reserve of not_before"
    # A moment past (or 0) is none: the bucket's own.
    status, retry_us, _, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 0, not_before=1)
    )
    assert (status, now_us + retry_us) == (0, moment + 200_000)


def test_busy_until_counts_from_not_before(bucket: Bucket) -> None:
    """across_nodes.py peeks, then reserves at not_before: busy_until is a moment by Redis's
    clock, the same end for both calls, whenever each runs."""
    limit = Limit(10, 1, "test")
    moment = redis_now_us(bucket.client) + 500_000
    busy_until = moment + 1_000_000
    status, retry_us, _, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 0, busy_until=busy_until, not_before=moment)
    )
    assert (status, now_us + retry_us) == (0, busy_until), "busy until a second after"
    status, retry_us, reset_us, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 2, busy_until=busy_until, not_before=moment)
    )
    assert (status, now_us + retry_us) == (2, busy_until)
    assert now_us + reset_us == busy_until + 100_000


@pytest.mark.parametrize("not_before", ["-1", "nan", "inf", "x", "1e20"])
def test_invalid_not_before(bucket: Bucket, not_before: str) -> None:
    with pytest.raises(redis.ResponseError, match="not_before must be"):
        bucket.call_raw("1000", "1", "1", "0", "0", not_before)
    assert bucket.client.get(KEY) is None


@pytest.mark.parametrize("alone", ["", "2", "true", "1 "])
def test_invalid_alone(bucket: Bucket, alone: str) -> None:
    with pytest.raises(redis.ResponseError, match="alone must be 0 or 1"):
        bucket.call_raw("1000", "1", "1", "0", "0", "0", alone)
    assert bucket.client.get(KEY) is None


def test_busy_until_counts_tokens_taken_elsewhere(bucket: Bucket) -> None:
    """A worker back from its local fallback says until when its local tokens keep the domain
    busy: the shared bucket is empty until then, even if Redis lost or never had the key; a
    moment, the same however late the call comes."""
    limit = Limit(10, 1, "test")
    busy_until = redis_now_us(bucket.client) + 500_000
    status, retry_us, _, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 2.0, busy_until)
    )
    assert (status, now_us + retry_us) == (2, busy_until)
    # Never earlier than what the bucket already holds.
    status, retry_us, _, now_us, *_ = bucket.script(
        keys=[KEY], args=script_args(limit, 1, 2.0, busy_until - 400_000)
    )
    assert (status, now_us + retry_us) == (2, busy_until + 100_000)


@pytest.mark.parametrize("busy_until", ["-1", "nan", "inf", "x", "1e20"])
def test_invalid_busy_until(bucket: Bucket, busy_until: str) -> None:
    with pytest.raises(redis.ResponseError, match="busy_until must be"):
        bucket.call_raw("1000", "1", "1", "0", busy_until)
    assert bucket.client.get(KEY) is None


@pytest.mark.parametrize(
    ("domain", "plain"),
    [
        ("shop.example", True),
        ("xn--bcher-kva.example", True),
        ("api-quota:user_7", True),
        ("a" * 200, True),
        ("a}b", False),
        ("{shop.example}", False),
        ("shop.example}:bucket", False),
        ("]]..redis.call('FLUSHALL')..[[", False),
        ("a" * 201, False),
        ("line\nbreak", False),
        ("ünïcode", False),
        ("\ud800", False),
    ],
)
def test_keys_of_untrusted_domains_are_bounded_and_keep_one_hash_tag(
    domain: str, plain: bool
) -> None:
    key = bucket_key("redis_throttle", domain)
    tag = key.removeprefix("redis_throttle:{").removesuffix("}")
    assert "{" not in tag
    assert "}" not in tag
    assert len(tag) <= 200
    if plain:
        assert tag == domain, "plain names stay readable"
    else:
        assert tag.startswith("#")
        assert len(tag) == 65


def test_distinct_domains_never_share_a_key() -> None:
    domains = ["a}b", "a{b", "ab", "#" + "0" * 64, "a" * 201, "a" * 202, "A" * 201, "a:b", "a.b"]
    keys = {bucket_key("p", d) for d in domains}
    assert len(keys) == len(domains)
    hashed = bucket_key("p", "a}b").split("{")[1].split("}")[0]
    assert bucket_key("p", hashed) != bucket_key("p", "a}b"), "a hash is no plain name"


@async_test
async def test_hostile_domains_touch_only_their_own_key(redis_server: RedisServer) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_server.url)
    bucket = TokenBucket(client, key_prefix="ns")
    try:
        await client.set("victim", "intact")
        limit = Limit(rate=1, burst=1, text="1/s")
        hostile = ["]]..redis.call('FLUSHALL')..[[", "x}:bucket", "{victim}", "victim"]
        for domain in hostile:
            assert (await bucket.acquire(domain, limit)).allowed, domain
        # Each has a bucket of its own: a second request to any of them waits.
        for domain in hostile:
            assert not (await bucket.acquire(domain, limit)).allowed, domain
        assert await client.get("victim") == b"intact"
        keys = sorted(await client.keys("*"))
        assert keys == sorted([b"victim", *(bucket_key("ns", d).encode() for d in hostile)])
    finally:
        await bucket.aclose()
        await client.aclose()


def test_refused_call_changes_nothing(bucket: Bucket) -> None:
    bucket.call(rate=0.1, burst=1)
    before = bucket.client.get(KEY)
    assert not bucket.call(rate=0.1, burst=1)[0]
    assert bucket.client.get(KEY) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("0", "1", "1"), "interval must be a finite number > 0, got 0"),
        (("-5", "1", "1"), "interval must be a finite number > 0"),
        (("nan", "1", "1"), "interval must be a finite number > 0"),
        (("1e999", "1", "1"), "interval must be a finite number > 0"),
        (("abc", "1", "1"), "interval must be a finite number > 0, got abc"),
        (("1000", "0", "1"), "burst must be a finite number >= 1, got 0"),
        (("1000", "0.5", "0.5"), "burst must be a finite number >= 1, got 0.5"),
        (("1000", "1", "0"), "cost must be a finite number > 0, got 0"),
        (("1000", "1", "-1"), "cost must be a finite number > 0"),
        (("1000", "2", "3"), "cost 3 exceeds burst 2"),
    ],
)
def test_invalid_arguments_are_refused(bucket: Bucket, args: tuple[str, ...], message: str) -> None:
    with pytest.raises(redis.ResponseError, match=message):
        bucket.call_raw(*args)
    assert bucket.client.exists(KEY) == 0


@async_test
async def test_token_bucket_client(redis_server: RedisServer) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_server.url)
    bucket = TokenBucket(client, key_prefix="ns")
    try:
        limit = Limit(rate=2, burst=2, text="2/s")
        first = await bucket.acquire("shop.example", limit)
        assert first.allowed
        assert first.retry_after == 0
        assert 0.49 < first.reset_after <= 0.5
        await bucket.acquire("shop.example", limit)
        third = await bucket.acquire("shop.example", limit)
        assert not third.allowed
        assert 0.4 < third.retry_after <= 0.5
        assert await client.exists(bucket_key("ns", "shop.example")) == 1
        assert await client.keys("*") == [b"ns:{shop.example}"]
    finally:
        await bucket.aclose()
        await client.aclose()


def test_each_reply_tells_when_redis_decided(bucket: Bucket) -> None:
    """The reply's fourth integer is Redis's time (µs since 2024-01-01) when the script ran,
    whatever its status: the worker counts the reply's wait from then."""
    limit = Limit(10, 1, "test")

    replies = []
    for _ in range(3):  # allowed, reserved, refused (nothing reservable that far)
        before = redis_now_us(bucket.client)
        replies.append(bucket.script(keys=[KEY], args=script_args(limit, 1, 0.1)))
        assert before <= replies[-1][3] <= redis_now_us(bucket.client)
    assert [reply[0] for reply in replies] == [1, 2, 0]
