"""Every call of the throttle's scripts behind the circuit breaker: counted; the first failure
(refused, timed out, stalled, read-only replica, out of memory, ...) opens the breaker, and from
then on no request calls Redis. A probe in the background does, after a delay that doubles up
to ``REDIS_THROTTLE_PROBE_INTERVAL``; its first success closes the breaker. The probe spends no
domain's tokens: a request's own acquire would be granted without what the fallback gave out
while the probe was under way. The fleet's secret is read at start, at each subscription of the
pauses' listener, and before the breaker closes (see :mod:`.lost_state`).

A call a script refuses (its arguments, or what it read, are no limit: ``ERR redis_throttle:
...``), or that met one of the domain's keys holding another type (``WRONGTYPE``: something else
wrote it), is no failure of Redis, which answered: it is that request's problem. The breaker
stays closed, the refusal is counted (``redis_throttle/rejected/script_call``) and logged once
per domain, and :class:`ScriptRefused` tells the caller.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, TypeVar

from redis.exceptions import RedisError, ResponseError

from .connection import ClusterClient, ping
from .stats import STATS_PREFIX, redis_error_stat
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Awaitable, Sequence

    from scrapy.statscollectors import StatsCollector

    from .breaker import CircuitBreaker
    from .bucket import TokenBucket
    from .clock import Clock
    from .connection import ThrottleRedis
    from .fallback import Fallback
    from .lost_state import LostState
    from .rejections import Rejections

_T = TypeVar("_T")

# How the scripts' error replies begin, once redis-py has taken "ERR " off; and Redis's reply
# to a script that met a key of another type (something else wrote it): that domain's problem,
# not a failure of Redis.
REFUSAL = "redis_throttle:"
WRONG_TYPE = "WRONGTYPE"


class ScriptRefused(Exception):
    """A script refused a call (see the module's docstring)."""


class RedisGuard:
    """The calls of *scripts* in *redis* behind *breaker*; *fallback* hears when Redis fails and
    when it is back, *lost_state* what each read of the fleet's secret found."""

    def __init__(
        self,
        redis: ThrottleRedis,
        scripts: TokenBucket,
        breaker: CircuitBreaker,
        fallback: Fallback,
        lost_state: LostState,
        stats: StatsCollector,
        rejections: Rejections,
        clock: Clock,
    ) -> None:
        self._redis = redis
        self._scripts = scripts
        self._breaker = breaker
        self._fallback = fallback
        self._lost_state = lost_state
        self._stats = stats
        self._rejections = rejections
        self._clock = clock
        self._prober: asyncio.Task[None] | None = None
        self.openings = 0
        """How many times the breaker opened."""
        # The domain of the last call that failed (and its other scopes' budgets): on a Redis
        # Cluster, the probe tries their primaries (another one may answer while one is down).
        self._failed_domains: tuple[str | None, ...] = (None,)

    async def start(self) -> None:
        """PING Redis at start-up, so that an unavailable Redis is reported before the first
        request (and the first requests go by the policy at once), read its clock and the
        fleet's secret."""
        try:
            await ping(self._redis)
            await self._scripts.read_time()
        except RedisError as exc:
            self._failed(exc)
            return
        await self._try_read_state()

    async def read_state(self) -> None:
        """Read the fleet's secret, which Redis loses with the rest of the throttle's state (see
        :class:`.LostState`); RedisError when Redis does not answer. The pauses' listener reads
        it each time it subscribes (a restart drops its subscription), and a request whose
        moment was reserved before that reads it before it goes."""
        self._lost_state.read(*await self._scripts.load_secret())
        if not isinstance(self._redis, ClusterClient):
            # Redis answers (on a cluster, this says nothing of the other primaries): a worker
            # that paced alone meanwhile would go on from a view of the buckets that may be void.
            self._succeeded()

    async def _try_read_state(self) -> None:
        """:meth:`read_state`, at start and once Redis is back, where a failure is not fatal."""
        try:
            await self.read_state()
        except RedisError as exc:
            # Meanwhile what this worker parks asks anew when it comes back.
            self._rejections.reject(
                "secret", "", str(exc)[:300], "parked requests keep no reservation"
            )

    async def answered(self, domain: str, call: Awaitable[_T]) -> _T | None:
        """:meth:`call`, with a refused call taken as no answer."""
        try:
            return await self.call(domain, call)
        except ScriptRefused:
            return None

    async def call(self, domain: str, call: Awaitable[_T], also: Sequence[str] = ()) -> _T | None:
        """Await a script *call* for *domain* (and the budgets *also*), counted; None when it
        failed (the breaker hears of both, and the probe then tries where *domain* and *also*
        live); ScriptRefused when the script refused it (Redis answered: a success to the
        breaker)."""
        self._stats.inc_value(f"{STATS_PREFIX}/redis_calls")
        try:
            result = await call
        except RedisError as exc:
            if isinstance(exc, ResponseError) and str(exc).startswith((REFUSAL, WRONG_TYPE)):
                self._succeeded()
                self._rejections.reject(
                    "script_call",
                    domain,
                    str(exc)[:300],
                    "this request is paced by this worker alone",
                )
                raise ScriptRefused(str(exc)) from None
            self._failed_domains = (domain, *also)
            self._failed(exc)
            return None
        self._succeeded()
        return result

    def _failed(self, exc: RedisError) -> None:
        self._stats.inc_value(redis_error_stat(type(exc).__name__))
        if not self._breaker.failed():
            return
        self.openings += 1
        self._fallback.redis_failed(exc)
        self._prober = asyncio.ensure_future(self._probe_until_back())

    def _succeeded(self) -> None:
        outage = self._breaker.succeeded()
        if outage is not None:
            self._fallback.redis_back(outage)

    async def _probe_until_back(self) -> None:
        while self._breaker.is_open:
            await self._clock.sleep(self._breaker.next_probe_in())
            if not self._breaker.is_open:  # a call under way got through meanwhile
                await self._try_read_state()
                return
            self._stats.inc_value(f"{STATS_PREFIX}/redis_calls")
            try:
                for name in self._failed_domains:
                    await self._scripts.probe(name)
                # Whether it restarted empty, before the requests waiting for it call it: they
                # would tell it the moments this worker saw reserved, lost.
                await self.read_state()
            except RedisError as exc:
                self._stats.inc_value(redis_error_stat(type(exc).__name__))
                continue
            self._succeeded()

    async def aclose(self) -> None:
        """Stop probing; count an outage still under way in the stats."""
        if self._prober is not None:
            await cancel_and_wait(self._prober, "the probe of Redis")
        outage = self._breaker.open_for()
        if outage is not None:
            self._fallback.count_outage(outage)
