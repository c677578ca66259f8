"""The shared token bucket: one atomic Lua call in Redis per attempt."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import ResponseError

from .across_nodes import AcrossNodes
from .clock import Clock
from .connection import ClusterClient, drop_idle_connections
from .rates import Limit, Quota
from .redis_schema import (
    LOG_SUFFIX,
    PROBE_KEY_TAG,
    PROBE_SUFFIX,
    QUOTA_SUFFIX,
    RATE_SUFFIX,
    UNRESERVED_SUFFIX,
    bucket_key,
    penalty_channel,
    penalty_key,
    rate_key,
    secret_key,
    tagged_key,
    void_key,
)
from .scripts import lua_script
from .server_clock import ServerClocks

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .config import Adaptive, Backoff
    from .connection import ThrottleRedis
    from .server_clock import ServerClock


class Reservation(NamedTuple):
    """A moment reserved in a domain's bucket, as ``lua/unreserve.lua`` gives it back: the
    bucket's time right *after* it (µs since the scripts' epoch), the *step* it added, and when
    Redis reserved it (*at*, µs since the epoch)."""

    after: int
    step: int
    at: int


class Unreserved(NamedTuple):
    """What :meth:`TokenBucket.unreserve` did with the reservations given back."""

    taken: int
    """Taken out of the bucket (with those set aside before that they freed)."""
    set_aside: int
    """Set aside until the reservations after them are given back too."""


@dataclass(frozen=True)
class AcquireResult:
    allowed: bool
    """The request may go now."""
    reserved: bool
    """The request's tokens are taken for later: it must go in ``retry_after`` seconds."""
    tokens_left: float
    """At the configured rate (the adaptive rate may be lower)."""
    retry_after: float
    """Seconds until this request may go (0 when allowed)."""
    reset_after: float
    """Seconds until the bucket is full again."""
    paused: bool = False
    """The domain is paused (set live), or this worker waits for a failed Redis: the request
    asks again in ``retry_after`` seconds."""
    decided_at: float | None = None
    """When Redis decided (loop time, see :class:`.ServerClock`): ``retry_after`` and
    ``reset_after`` count from then. None: decided in this process, as it was returned."""
    moment_us: float | None = None
    """When the request may go by Redis's clock (µs since the scripts' epoch): the moment
    Redis gave it, exact in any process that knows Redis's clock. None: not given by Redis."""
    reservation: Reservation | None = None
    """Reserved in Redis: what to give back if the request does not go (see
    :meth:`TokenBucket.unreserve`)."""
    live_invalid: bool = False
    """The domain's limit set live has a field that is no limit: the workers' own applies for
    it."""

    def decided(self, now: float) -> float:
        """When it was decided, by the loop's clock at *now*."""
        return now if self.decided_at is None else self.decided_at


# The fleet's secret: random bytes, kept in Redis as hex digits.
SECRET_BYTES = 32
_SECRET = re.compile(rb"[0-9a-f]{%d}" % (2 * SECRET_BYTES))

# Reservations given back in one call: lua/unreserve.lua's MAX_RESERVATIONS.
UNRESERVE_BATCH = 1000

# Added to token_bucket.lua's status when the domain's limit set live has a field that is no limit.
LIVE_INVALID = 8
# How often the requests of a domain paused live ask whether it was resumed.
PAUSED_POLL = 2.0


def parse_reply(reply: list[Any], limit: Limit, decided_at: float | None = None) -> AcquireResult:
    """The result of ``token_bucket.lua``'s reply (integers: status, microseconds, Redis's time,
    the requests the quotas allow when it checked some, and a reservation's step), decided at
    *decided_at*."""
    status, retry_after_us, reset_after_us, now_us, *quotas_left = reply
    live_invalid = status >= LIVE_INVALID
    if live_invalid:
        status -= LIVE_INVALID
    reservation = None
    if status == 2:
        reservation = Reservation(now_us + reset_after_us, quotas_left.pop(), now_us)
    if status == 3:
        return AcquireResult(
            False, False, 0.0, PAUSED_POLL, 0.0, paused=True, decided_at=decided_at
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


@dataclass(frozen=True)
class Voiding:
    """The last voiding of a domain's reserved moments, as Redis keeps it for the workers that
    missed its message (see ``lua/voided.lua``)."""

    age: float
    """Seconds since it happened: moments reserved before are void..."""
    left: float
    """...if they come within this many seconds from now."""
    at_us: float | None = None
    """When it happened, by Redis's clock (µs since the scripts' epoch, as
    :attr:`Reservation.at`): the moments reserved there before it are void (None: not told)."""


@dataclass(frozen=True)
class Penalty:
    changed: bool
    """This call started or extended the pause (else one as long was under way)."""
    pause: float
    """Seconds until the pause ends."""
    strikes: int
    """Penalties in a row (each one after the previous pause ended)."""
    at_us: float
    """When Redis decided (as :attr:`Voiding.at_us`): the moments reserved before it within
    the pause are void."""


@dataclass(frozen=True)
class SlowDown:
    lowered: bool
    """This call lowered the rate (else the failed request was sent before the last decrease,
    or the rate cannot go lower)."""
    rate: float
    """The domain's rate now, requests per second."""
    back_in: float
    """When lowered: seconds until the rate is back at the configured one, if no failure
    comes."""
    void: float
    """When lowered: seconds the moments reserved before lasted; the requests holding them
    must ask again (the decrease is published like a pause this long)."""
    at_us: float
    """When Redis decided (as :attr:`Voiding.at_us`): the moments reserved before it are the
    voided ones."""


class TokenBucket:
    """Per-domain token buckets stored in one Redis, shared by every process that uses it."""

    def __init__(
        self,
        redis: ThrottleRedis,
        key_prefix: str,
        adaptive: bool = False,
        may_call: Callable[[], bool] = lambda: True,
        clock: Clock | None = None,
    ) -> None:
        """*may_call*: whether Redis may be called now (False: it failed meanwhile; see
        :class:`.across_nodes.CallsStopped`); *clock*: this process's (the real one when
        None)."""
        clock = clock or Clock()
        self._process_clock = clock
        self._redis = redis
        self._key_prefix = key_prefix
        self._adaptive = adaptive
        self._live_quotas: set[str] = set()
        """Domains whose limit set live has quotas (or had)."""
        self._clocks = ServerClocks(redis, clock)
        self._script = lua_script(redis, "token_bucket.lua", clock)
        self._penalty_script = lua_script(redis, "penalty.lua", clock)
        self._slow_down_script = lua_script(redis, "slow_down.lua", clock)
        self._voided_script = lua_script(redis, "voided.lua", clock)
        self._unreserve_script = lua_script(redis, "unreserve.lua", clock)
        self._across = AcrossNodes(self.acquire_in_one_call, self.unreserve, may_call, clock)

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float = 1,
        reserve: float = 0,
        busy_until: float = 0,
        others: Sequence[tuple[str, Limit, float]] = (),
    ) -> AcquireResult:
        """Take *cost* tokens from *domain*'s bucket if it has them, or reserve them if they will
        be there within *reserve* seconds (atomically, in one call), and as many from the
        buckets of the request's *others* scopes (name, limit and busy_until), which must all
        allow it (see :mod:`.scopes`): every bucket counts it at the latest moment any allows.
        The bucket counts as empty until *busy_until* at least (loop time; 0: none; see
        :meth:`.LocalBuckets.busy_until`). With the adaptive rate, tokens refill at the
        domain's lowered rate, if it has one. On a Redis Cluster, the buckets of several scopes
        are on several nodes: see :mod:`.across_nodes`."""
        if others and isinstance(self._redis, ClusterClient):
            return await self._across.acquire(domain, limit, cost, reserve, busy_until, others)
        return await self.acquire_in_one_call(
            domain, limit, cost, reserve, busy_until, 0, others=others
        )

    async def acquire_in_one_call(
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
        """One call of ``token_bucket.lua`` (see :meth:`acquire`): *domain*'s bucket and its
        *others* on one node. Not before *not_before* (µs by Redis's clock; 0: now), from which
        *reserve* counts; a *reserve* below 0 takes nothing (a peek). *alone*: *domain* is
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
        sent = self._process_clock.monotonic()
        reply: list[Any] = await self._script(keys=keys, args=args)
        read = self._process_clock.monotonic()
        if reply[0] == QUOTA_KEYS_NEEDED:
            # Remembered: the domain's calls pass the quotas' keys from now on (an unused key
            # costs the script nothing).
            if len(self._live_quotas) >= LIVE_QUOTAS_KEPT:
                self._live_quotas.clear()  # bounded: a domain forgotten costs one call more
            self._live_quotas.add(domain)
            return await self.acquire_in_one_call(
                domain, limit, cost, reserve, busy_until, not_before, alone, others
            )
        return parse_reply(reply, limit, clock.decided_at(sent, read, reply[3]))

    def server_clock(self, domain: str) -> ServerClock:
        """Redis's clock as *domain*'s bucket sees it (see :meth:`.ServerClocks.of`)."""
        return self._clocks.of(bucket_key(self._key_prefix, domain))

    async def read_time(self) -> None:
        """Learn Redis's clock before the first requests (see :meth:`.ServerClocks.read`)."""
        await self._clocks.read()

    async def penalize(
        self, domain: str, limit: Limit, retry_after: float | None, backoff: Backoff
    ) -> Penalty:
        """Pause *domain* for every worker: *retry_after* seconds (the site's Retry-After), or
        by *backoff*; publish the pause on :func:`penalty_channel`."""
        changed, pause_us, strikes, at_us = await self._penalty_script(
            keys=[
                bucket_key(self._key_prefix, domain),
                penalty_key(self._key_prefix, domain),
                void_key(self._key_prefix, domain),
            ],
            args=[
                repr(limit.interval_us),
                limit.burst,
                repr(-1.0 if retry_after is None else retry_after * 1e6),
                repr(backoff.first * 1e6),
                repr(backoff.longest * 1e6),
                repr(backoff.decay * 1e6),
                penalty_channel(self._key_prefix),
                domain,
            ],
        )
        return Penalty(changed == 1, pause_us / 1e6, strikes, at_us)

    async def slow_down(
        self, domain: str, limit: Limit, adaptive: Adaptive, age: float, hold: float = 0
    ) -> SlowDown:
        """Lower *domain*'s rate for every worker (unless the failed request, sent *age*
        seconds ago, was sent before the last decrease); it climbs back after *hold* seconds.
        The moments reserved before are void: see ``lua/slow_down.lua``."""
        lowered, rate, back_in_us, void_us, at_us = await self._slow_down_script(
            keys=[
                bucket_key(self._key_prefix, domain),
                rate_key(self._key_prefix, domain),
                void_key(self._key_prefix, domain),
            ],
            args=[
                repr(limit.rate),
                repr(adaptive.min_rate),
                repr(adaptive.decrease),
                repr(adaptive.recovery * 1e6),
                repr(age * 1e6),
                repr(hold * 1e6),
                limit.burst,
                penalty_channel(self._key_prefix),
                domain,
            ],
        )
        return SlowDown(lowered == 1, float(rate), back_in_us / 1e6, void_us / 1e6, at_us)

    async def last_voiding(self, domain: str) -> Voiding | None:
        """The last voiding of *domain*'s reserved moments that still matters (None: none)."""
        reply = await self._voided_script(keys=[void_key(self._key_prefix, domain)], args=[])
        if len(reply) != 3:
            return None
        age_us, left_us, at_us = reply
        return Voiding(age_us / 1e6, left_us / 1e6, at_us)

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

    async def load_secret(self) -> tuple[bytes, bool]:
        """The fleet's secret (made by the first worker that finds none, kept in Redis): it seals
        the tickets of the requests this worker parks, and tells whether Redis lost the
        throttle's state (see :mod:`.seals`). One round trip. Also whether the key held
        something else, which a worker did not make (written by hand, or of another type): it is
        replaced, as if Redis had lost it."""
        key = secret_key(self._key_prefix)
        made = secrets.token_hex(SECRET_BYTES).encode()
        # Its failure must say that Redis does not answer now: a connection redis-py's pool kept
        # across a restart of Redis fails its next command.
        await drop_idle_connections(self._redis)
        try:
            found = await self._redis.set(key, made, nx=True, get=True)
        except ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            found = b""
        if found is None:
            return made, False
        if isinstance(found, bytes) and _SECRET.fullmatch(found):
            return found, False
        # Another worker may replace it at the same time: the last one's stands, and the others
        # find it new at their next read (once).
        await self._redis.set(key, made)
        return made, True

    async def aclose(self) -> None:
        scripts = (
            self._script,
            self._penalty_script,
            self._slow_down_script,
            self._voided_script,
            self._unreserve_script,
        )
        for script in scripts:
            await script.aclose()

    async def probe(self, domain: str | None = None) -> None:
        """Run the script as an acquire would, on a bucket of its own that no domain uses and
        that vanishes within a millisecond: it fails where an acquire would fail (Redis down,
        read-only, out of memory, script lost and not reloadable, ...). With *domain*, the
        bucket is in that domain's Cluster slot: on the primary its calls go to."""
        probe = Limit(rate=1e6, burst=1, text="probe")
        key = (
            tagged_key(self._key_prefix, PROBE_KEY_TAG)
            if domain is None
            else bucket_key(self._key_prefix, domain) + PROBE_SUFFIX
        )
        await self._script(keys=[key], args=script_args(probe, 1))
