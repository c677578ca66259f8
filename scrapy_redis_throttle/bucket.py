"""The shared token bucket: one atomic Lua call in Redis per attempt (see :mod:`.one_node`), or
several on a Redis Cluster (see :mod:`.across_nodes`); the pauses, the adaptive rate's
decreases and the fleet's secret."""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from .across_nodes import AcrossNodes
from .clock import Clock
from .connection import ClusterClient, drop_idle_connections
from .one_node import OneNode
from .redis_schema import (
    PROBE_KEY_TAG,
    PROBE_SUFFIX,
    bucket_key,
    penalty_channel,
    penalty_key,
    rate_key,
    secret_key,
    tagged_key,
    void_key,
)
from .replies import Penalty, SlowDown, Voiding
from .scripts import lua_script

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .breaker import CircuitBreaker
    from .config import Adaptive, Backoff
    from .connection import ThrottleRedis
    from .rates import Limit
    from .replies import AcquireResult, Reservation, Unreserved
    from .server_clock import ServerClock

# The fleet's secret: random bytes, kept in Redis as hex digits.
SECRET_BYTES = 32
_SECRET = re.compile(rb"[0-9a-f]{%d}" % (2 * SECRET_BYTES))


class TokenBucket:
    """Per-domain token buckets stored in one Redis, shared by every process that uses it."""

    def __init__(
        self,
        redis: ThrottleRedis,
        key_prefix: str,
        adaptive: bool = False,
        breaker: CircuitBreaker | None = None,
        clock: Clock | None = None,
    ) -> None:
        """*breaker*: open while Redis fails, when no request calls it (see
        :class:`.across_nodes.CallsStopped`); *clock*: this process's (the real one when
        None)."""
        clock = clock or Clock()
        self._redis = redis
        self._key_prefix = key_prefix
        self.node = OneNode(redis, key_prefix, adaptive, clock)
        self._penalty_script = lua_script(redis, "penalty.lua", clock)
        self._slow_down_script = lua_script(redis, "slow_down.lua", clock)
        self._voided_script = lua_script(redis, "voided.lua", clock)
        self._across = AcrossNodes(self.node, breaker, clock)

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
        return await self.node.acquire(domain, limit, cost, reserve, busy_until, 0, others=others)

    def server_clock(self, domain: str) -> ServerClock:
        """Redis's clock as *domain*'s bucket sees it (see :meth:`.ServerClocks.of`)."""
        return self.node.server_clock(domain)

    async def read_time(self) -> None:
        """Learn Redis's clock before the first requests (see :meth:`.ServerClocks.read`)."""
        await self.node.read_time()

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
        """Give *domain*'s bucket back *reservations* (see :meth:`.OneNode.unreserve`)."""
        return await self.node.unreserve(domain, reservations)

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
        await self.node.aclose()
        for script in (self._penalty_script, self._slow_down_script, self._voided_script):
            await script.aclose()

    async def probe(self, domain: str | None = None) -> None:
        """Run the script as an acquire would, on a bucket of its own that no domain uses and
        that vanishes within a millisecond: it fails where an acquire would fail (Redis down,
        read-only, out of memory, script lost and not reloadable, ...). With *domain*, the
        bucket is in that domain's Cluster slot: on the primary its calls go to."""
        key = (
            tagged_key(self._key_prefix, PROBE_KEY_TAG)
            if domain is None
            else bucket_key(self._key_prefix, domain) + PROBE_SUFFIX
        )
        await self.node.probe(key)
