"""One call of a script on the node of a domain's bucket: ``token_bucket.lua`` (a request's
acquire, its arguments and its reply), and ``unreserve.lua``. Redis's clock is learnt from
each reply (see :class:`.ServerClocks`)."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .live_limits import from_reply
from .rates import Limit, Quota
from .redis_schema import (
    LOG_SUFFIX,
    QUOTA_SUFFIX,
    RATE_SUFFIX,
    UNRESERVED_SUFFIX,
    bucket_key,
    void_key,
)
from .replies import AcquireResult, Reservation, Unreserved
from .scripts import lua_script
from .server_clock import ServerClocks

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .clock import Clock
    from .connection import ThrottleRedis
    from .server_clock import ServerClock

# Reservations given back in one call: lua/unreserve.lua's MAX_RESERVATIONS.
UNRESERVE_BATCH = 1000

# Added to token_bucket.lua's status when the domain's limit set live has a field that is no limit.
LIVE_INVALID = 8
# How often the requests of a domain paused live ask whether it was resumed.
PAUSED_POLL = 2.0


def parse_reply(reply: list[Any], limit: Limit, decided_at: float | None = None) -> AcquireResult:
    """The result of ``token_bucket.lua``'s reply (integers: status, microseconds, Redis's time,
    the requests the quotas allow when it checked some, and a reservation's step; last, the
    domain's limit set live, a string, when the call was in its own bucket), decided at
    *decided_at*."""
    status, retry_after_us, reset_after_us, now_us, *quotas_left = reply
    live = None
    if quotas_left and not isinstance(quotas_left[-1], int):
        live = from_reply(quotas_left.pop())
    live_invalid = status >= LIVE_INVALID
    if live_invalid:
        status -= LIVE_INVALID
    reservation = None
    if status == 2:
        reservation = Reservation(now_us + reset_after_us, quotas_left.pop(), now_us)
    if status == 3:
        return AcquireResult(
            allowed=False,
            reserved=False,
            tokens_left=0.0,
            retry_after=PAUSED_POLL,
            reset_after=0.0,
            paused=True,
            decided_at=decided_at,
            live=live,
        )
    return AcquireResult(
        allowed=status == 1,
        reserved=status == 2,
        tokens_left=float(
            max(0, min([limit.burst - reset_after_us / limit.interval_us, *quotas_left]))
        ),
        retry_after=retry_after_us / 1e6,
        reset_after=reset_after_us / 1e6,
        decided_at=decided_at,
        moment_us=float(now_us + retry_after_us),
        reservation=reservation,
        live_invalid=live_invalid,
        live=live,
    )


# token_bucket.lua's reply when a limit set live has quotas and the call did not pass their keys.
QUOTA_KEYS_NEEDED = 4
# Domains remembered as having quotas set live, at most (a hostile Redis may set them on every
# domain a crawl meets).
LIVE_QUOTAS_KEPT = 10_000


def script_args(
    limit: Limit,
    cost: float,
    reserve: float = 0,
    busy_until: int = 0,
    others: Sequence[tuple[str, Limit, int]] = (),
    not_before: int = 0,
    alone: bool = False,
) -> list[bytes]:
    """ARGV of ``token_bucket.lua`` (``busy_until`` and ``not_before``: µs by Redis's clock, 0:
    none). ``busy_until``, ``not_before`` and ``alone`` are sent only when they are not the
    script's defaults or more arguments follow: every argument costs client CPU on every
    request."""
    args = _fixed_args(limit, cost, reserve)
    if busy_until or limit.quotas or others or not_before or alone:
        return [
            *args,
            b"%d" % busy_until,
            b"%d" % not_before,
            b"1" if alone else b"0",
            *_quota_args(limit.quotas),
            *(part for _, other, busy in others for part in (*_other_args(other), b"%d" % busy)),
        ]
    return list(args)


@lru_cache(maxsize=1024)
def _fixed_args(limit: Limit, cost: float, reserve: float) -> tuple[bytes, ...]:
    # The same for every request of a domain: encoded once (repr keeps every digit of floats).
    values = repr(limit.interval_us), str(limit.burst), repr(float(cost)), repr(reserve * 1e6)
    return tuple(value.encode() for value in values)


@lru_cache(maxsize=1024)
def _other_args(limit: Limit) -> tuple[bytes, bytes]:
    """Another scope's limit, as the script takes it: its rate and burst (see
    ``lua/token_bucket.lua``; its more limits count only where it is a request's domain)."""
    return repr(limit.interval_us).encode(), str(limit.burst).encode()


def _moment_us(clock: ServerClock, moment: float) -> int:
    """*moment* (loop time; 0: none) by *clock* (see :meth:`.ServerClock.moment_us`), in whole
    µs as the script takes it (0: none, or the clock is unknown: the next call tells it)."""
    if moment <= 0:
        return 0
    moment_us = clock.moment_us(moment)
    return 0 if moment_us is None else max(0, round(moment_us))


@lru_cache(maxsize=1024)
def _quota_args(quotas: tuple[Quota, ...]) -> tuple[bytes, ...]:
    return tuple(part.encode() for quota in quotas for part in quota.script_args)


class OneNode:
    """The calls of the scripts that decide in one domain's bucket (and those of its other
    scopes on the same node), in the Redis *redis*."""

    def __init__(self, redis: ThrottleRedis, key_prefix: str, adaptive: bool, clock: Clock) -> None:
        self._clock = clock
        self._key_prefix = key_prefix
        self._adaptive = adaptive
        self._live_quotas: set[str] = set()
        """Domains whose limit set live has quotas (or had)."""
        self._clocks = ServerClocks(redis, clock)
        self._script = lua_script(redis, "token_bucket.lua", clock)
        self._unreserve_script = lua_script(redis, "unreserve.lua", clock)

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        reserve: float,
        busy_until: float,
        not_before: int,
        alone: bool = False,
        others: Sequence[tuple[str, Limit, float]] = (),
    ) -> AcquireResult:
        """One call of ``token_bucket.lua`` (see :meth:`.TokenBucket.acquire`): *domain*'s bucket
        and its *others* on one node. Not before *not_before* (µs by Redis's clock; 0: now), from
        which *reserve* counts; a *reserve* below 0 takes nothing (a peek). *alone*: *domain* is
        another scope's budget, asked on its own (see :mod:`.across_nodes`): its bucket alone,
        read as in one call."""
        key = bucket_key(self._key_prefix, domain)
        with_quotas = bool(limit.quotas) or domain in self._live_quotas
        if alone:
            keys = [key]
        elif with_quotas or others:
            keys = [key, key + RATE_SUFFIX, key + QUOTA_SUFFIX, key + LOG_SUFFIX]
            keys += [bucket_key(self._key_prefix, name) for name, _, _ in others]
        else:
            keys = [key, key + RATE_SUFFIX] if self._adaptive else [key]
        clock = await self._clocks.known(key)
        # Moments by the node's clock: one a call reaches late is the same moment.
        args = script_args(
            limit,
            cost,
            reserve,
            _moment_us(clock, busy_until),
            [(name, each, _moment_us(clock, busy)) for name, each, busy in others],
            not_before,
            alone,
        )
        sent = self._clock.monotonic()
        reply: list[Any] = await self._script(keys=keys, args=args)
        read = self._clock.monotonic()
        if reply[0] == QUOTA_KEYS_NEEDED:
            # Remembered: the domain's calls pass the quotas' keys from now on (an unused key
            # costs the script nothing).
            if len(self._live_quotas) >= LIVE_QUOTAS_KEPT:
                self._live_quotas.clear()  # bounded: a domain forgotten costs one call more
            self._live_quotas.add(domain)
            return await self.acquire(
                domain, limit, cost, reserve, busy_until, not_before, alone, others
            )
        return parse_reply(reply, limit, clock.decided_at(sent, read, reply[3]))

    async def unreserve(self, domain: str, reservations: Sequence[Reservation]) -> Unreserved:
        """Give *domain*'s bucket back *reservations* whose requests will not go (see
        ``lua/unreserve.lua``): those that are the last ones reserved at once, the others when
        the ones after them are given back too; none reserved before the domain's last
        voiding."""
        key = bucket_key(self._key_prefix, domain)
        keys = [key, key + UNRESERVED_SUFFIX, void_key(self._key_prefix, domain)]
        taken = set_aside = 0
        # Latest first: each call takes out what it can from the bucket's end. Once each: the
        # script takes a reservation given twice in one call once, not in two calls.
        ordered = sorted(set(reservations), reverse=True)
        for start in range(0, len(ordered), UNRESERVE_BATCH):
            batch = ordered[start : start + UNRESERVE_BATCH]
            args = [str(value) for reservation in batch for value in reservation]
            reply = await self._unreserve_script(keys=keys, args=args)
            taken, set_aside = taken + int(reply[0]), set_aside + int(reply[1])
        return Unreserved(taken, set_aside)

    def server_clock(self, domain: str) -> ServerClock:
        """Redis's clock as *domain*'s bucket sees it (see :meth:`.ServerClocks.of`)."""
        return self._clocks.of(bucket_key(self._key_prefix, domain))

    async def read_time(self) -> None:
        """Learn Redis's clock before the first requests (see :meth:`.ServerClocks.read`)."""
        await self._clocks.read()

    async def probe(self, key: str) -> None:
        """Run ``token_bucket.lua`` as an acquire would, on the bucket *key* (see
        :meth:`.TokenBucket.probe`)."""
        await self._script(keys=[key], args=script_args(PROBE, 1))

    async def aclose(self) -> None:
        for script in (self._script, self._unreserve_script):
            await script.aclose()


# The probe's limit: its bucket vanishes within a millisecond.
PROBE = Limit(rate=1e6, burst=1, text="probe")
