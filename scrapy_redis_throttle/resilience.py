"""What the throttle does when its Redis fails: a circuit breaker, and the fallback policies.

Every acquire goes to Redis while it answers. The first failure (refused, timed out, stalled,
read-only replica, out of memory, ...) opens the breaker: from then on no request calls Redis.
A probe in the background does, after a delay that doubles up to
``REDIS_THROTTLE_PROBE_INTERVAL``; its first success closes the breaker. The probe spends no
domain's tokens: a request's own acquire would be granted without what the fallback gave out
while the probe was under way. Meanwhile :mod:`.fallback` decides, by
``REDIS_THROTTLE_ON_REDIS_ERROR``.

A failed call is never replayed: a call that timed out may have taken its tokens in Redis, and a
replay would take them twice. The request is decided by the policy instead.

A call a script refuses (its arguments, or what it read, are no limit: ``ERR redis_throttle:
...``), or that met one of the domain's keys holding another type (``WRONGTYPE``: something else
wrote it), is no failure of Redis, which answered: it is that request's problem. The breaker stays
closed, the refusal is counted (``redis_throttle/rejected/script_call``) and logged once per
domain, and the request is paced by this worker alone, at its share (whatever the policy: it
never goes unthrottled, nor asks again at once).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import RedisError, ResponseError

from .across_nodes import CallsStopped
from .breaker import CircuitBreaker
from .bucket import AcquireResult, TokenBucket, Unreserved
from .config import FALLBACK_LOCAL, STATS_PREFIX
from .connection import ClusterClient, ping
from .fallback import WAIT_FOR_REDIS, Fallback, Grant, later
from .penalties import CLOCK_MARGIN
from .rejections import Rejections
from .seals import Seals
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from scrapy.statscollectors import StatsCollector

    from .bucket import Penalty, Reservation, SlowDown, Voiding
    from .budgets import Budget
    from .clock import Clock
    from .config import ThrottleConfig
    from .connection import ThrottleRedis
    from .rates import Limit
    from .server_clock import ServerClock

logger = logging.getLogger(__name__)


def redis_error_stat(error: str) -> str:
    """The stat that counts the failed Redis calls that raised *error* (an exception's name)."""
    return f"{STATS_PREFIX}/redis_errors/{error}"


_T = TypeVar("_T")

# The first probe of a failed Redis; later ones back off up to REDIS_THROTTLE_PROBE_INTERVAL.
FIRST_PROBE_DELAY = 0.5

# How the scripts' error replies begin, once redis-py has taken "ERR " off; and Redis's reply
# to a script that met a key of another type (something else wrote it): that domain's problem,
# not a failure of Redis.
REFUSAL = "redis_throttle:"
WRONG_TYPE = "WRONGTYPE"


class ScriptRefused(Exception):
    """A script refused a call (see the module's docstring)."""


class ResilientBucket:
    """The shared bucket behind a circuit breaker, with the configured fallback policy."""

    def __init__(
        self,
        redis: ThrottleRedis,
        config: ThrottleConfig,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
        fleet_size: Callable[[], int | None] = lambda: None,
        bucket: TokenBucket | None = None,
    ) -> None:
        self._redis = redis
        self._clock = clock
        # The scripts' calls (a test passes its own).
        self._bucket = bucket or TokenBucket(
            redis,
            config.key_prefix,
            adaptive=config.adaptive is not None,
            may_call=lambda: self.breaker.open_for() is None,
            clock=clock,
        )
        self._config = config
        self._stats = stats
        self._log_extra = log_extra
        self._rejections = Rejections(stats, log_extra)
        self.breaker = CircuitBreaker(FIRST_PROBE_DELAY, config.probe_interval, clock)
        self._closing = False
        self.fallback = Fallback(config, stats, log_extra, clock, fleet_size)
        self._prober: asyncio.Task[None] | None = None
        self._openings = 0
        # The domain of the last call that failed (and its other scopes' budgets): on a Redis
        # Cluster, the probe tries their primaries (another one may answer while one is down).
        self._failed_domains: tuple[str | None, ...] = (None,)
        self.seals = Seals()
        # When this worker last read that Redis lost the throttle's state (wall and monotonic
        # time; None: never).
        self._lost_at: tuple[float, float] | None = None

    async def check(self) -> None:
        """PING Redis at start-up, so that an unavailable Redis is reported before the first
        request (and the first requests go by the policy at once), read its clock and the
        fleet's secret."""
        try:
            await ping(self._redis)
            await self._bucket.read_time()
        except RedisError as exc:
            self._failed(exc)
            return
        await self._checked_state()

    async def check_state(self) -> None:
        """Read the fleet's secret (see :mod:`.seals`), which Redis loses with the rest of the
        throttle's state: a new one means that every moment reserved in Redis before now may
        be given to another request, and is lost (see :meth:`lost`). RedisError when Redis
        does not answer. The pauses' listener calls it each time it subscribes (a restart
        drops its subscription), and a request whose moment was reserved before that calls it
        before it goes (see :meth:`last_voiding`)."""
        secret, replaced = await self._bucket.load_secret()
        if replaced:
            self._rejections.reject(
                "secret",
                "",
                "the fleet's secret in Redis was not one a worker made",
                "replaced it: the moments reserved before are taken as lost",
            )
        if self.seals.know(secret) or replaced:
            self._state_lost()
        if not isinstance(self._redis, ClusterClient):
            # Redis answers (on a cluster, this says nothing of the other primaries): a worker
            # that paced alone meanwhile would go on from a view of the buckets that may be void.
            self._succeeded()

    async def _checked_state(self) -> None:
        """:meth:`check_state`, at start and once Redis is back, where a failure is not fatal."""
        try:
            await self.check_state()
        except RedisError as exc:
            # Meanwhile what this worker parks asks anew when it comes back.
            self._rejections.reject(
                "secret", "", str(exc)[:300], "parked requests keep no reservation"
            )

    def _state_lost(self) -> None:
        self._lost_at = (self._clock.wall(), self._clock.monotonic())
        self._stats.inc_value(f"{STATS_PREFIX}/state_lost")
        self.fallback.redis_lost()
        logger.warning(
            "Redis throttle: Redis at %s lost the throttle's state (restarted empty, or its keys "
            "were deleted): the requests that waited for moments reserved there before ask for "
            "new ones",
            self._config.redis_location,
            extra=self._log_extra(),
        )

    def lost(self, reserved_at: float, elsewhere: bool = False) -> bool:
        """Whether a moment reserved at *reserved_at* (wall time; *elsewhere*: by another
        process, whose clock may differ by up to CLOCK_MARGIN) was reserved before Redis lost
        the throttle's state, as far as this worker has read (see :meth:`check_state`). It
        must not be used: its bucket may give a moment reserved there to another request, and
        one taken alone while Redis failed was placed after moments that are no more."""
        if self._lost_at is None:
            return False
        return reserved_at < self._lost_at[0] + (CLOCK_MARGIN if elsewhere else 0.0)

    def _drained_until(self, limit: Limit) -> float:
        """Until when (loop time; 0: not later than now) a bucket of *limit* counts as busy
        after Redis lost the throttle's state: drained when this worker read the loss. The
        fleet may have spent the whole burst just before, and nothing in Redis says otherwise;
        every moment reserved before is void (see :meth:`lost`), so none goes after that."""
        if self._lost_at is None:
            return 0.0
        until = self._lost_at[1] + limit.burst / limit.rate
        return until if until > self._clock.monotonic() else 0.0

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        others: Sequence[Budget] = (),
    ) -> Grant:
        """The decision for a request of *domain* (and of its *others* scopes, see
        :meth:`.TokenBucket.acquire`): Redis's, or the fallback policy's."""
        waited = False
        while True:
            if self.breaker.open_for() is None:
                share = self.fallback.handover_wait(domain, limit, cost, others)
                if share:
                    return Grant(later(share), shared=False, handover=True)
                try:
                    result = await self._call_redis(domain, limit, cost, others)
                except ScriptRefused:
                    return self.fallback.paced_alone(domain, limit, cost, others)
                if result is not None:
                    return Grant(result, shared=True, waited_for_redis=waited)
            grant = self.fallback.decide(
                domain, limit, cost, others, self.breaker.open_for() or 0.0
            )
            if grant is not None:
                return grant
            if self._closing:  # the request asks again, and is parked or dropped meanwhile
                return Grant(later(WAIT_FOR_REDIS), shared=False)
            waited = True
            await self.breaker.wait_closed()

    async def _call_redis(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        others: Sequence[Budget],
    ) -> AcquireResult | None:
        openings = self._openings
        local = self.fallback.local
        untold = local.untold([domain, *(name for name, _ in others)])
        try:
            result = await self._guarded(
                domain,
                self._bucket.acquire(
                    domain,
                    limit,
                    cost,
                    self._config.max_reserve,
                    busy_until=max(local.busy_until(domain), self._drained_until(limit)),
                    others=[
                        (name, each, max(local.busy_until(name), self._drained_until(each)))
                        for name, each in others
                    ],
                ),
                also=[name for name, _ in others],
            )
        except CallsStopped:
            return None
        if result is None:
            return None
        if result.live_invalid:
            self._rejections.reject(
                "live_limit",
                domain,
                "a limit set live with a field that is no limit (scrapy-redis-throttle get "
                "names it)",
                "that field is ignored, the workers' own limit applies for it",
            )
        if result.allowed or result.reserved:
            # Only a call that takes tokens writes the buckets (busy_until with them): after a
            # refusal or a pause, what was taken locally is still to tell.
            local.told(untold)
        local.follow(domain, result, others, cost)
        if openings != self._openings and self._config.on_redis_error == FALLBACK_LOCAL:
            # Redis answered a call sent before it failed: its moment was chosen without what
            # the fallback gave out meanwhile, and may collide with it. The request goes by the
            # fallback's pace instead (its tokens in Redis stay spent: on the polite side).
            return None
        return result

    def server_clock(self, domain: str) -> ServerClock:
        """Redis's clock as *domain*'s bucket sees it (see :meth:`.TokenBucket.server_clock`)."""
        return self._bucket.server_clock(domain)

    async def last_voiding(
        self, domain: str, listening: bool = False
    ) -> tuple[bool, Voiding | None]:
        """Whether Redis could tell, and the last voiding of *domain*'s reserved moments (see
        :meth:`.TokenBucket.last_voiding`), for a request whose moment was reserved before this
        worker's subscription. *listening*: that subscription is in force (see
        :attr:`.Pauses.listening`), so Redis has not restarted since it read the fleet's
        secret."""
        if not listening:
            # First whether Redis lost the throttle's state since (see :meth:`lost`): read now,
            # even while the breaker is open, since a Redis back (restarted empty) before the
            # next probe may already give the moment to another request. It goes on a new
            # connection: only a failure of that one says Redis does not answer now.
            try:
                await self.check_state()
            except RedisError:
                return False, None
        if self.breaker.open_for() is not None:
            return False, None
        reply = await self._answered(domain, self._last_voiding(domain))
        return (False, None) if reply is None else (True, reply[0])

    async def _last_voiding(self, domain: str) -> tuple[Voiding | None]:
        # In a tuple: None is an answer here, and _guarded's word for a failed call.
        return (await self._bucket.last_voiding(domain),)

    async def penalize(
        self, domain: str, limit: Limit, retry_after: float | None
    ) -> Penalty | None:
        """Pause *domain* for the fleet (see :mod:`.penalties`); None when Redis could not be
        told."""
        if self.breaker.open_for() is not None:
            return None
        return await self._answered(
            domain, self._bucket.penalize(domain, limit, retry_after, self._config.backoff)
        )

    async def slow_down(
        self, domain: str, limit: Limit, age: float, hold: float = 0
    ) -> SlowDown | None:
        """Lower *domain*'s adaptive rate for the fleet (see :meth:`TokenBucket.slow_down`); None
        when the adaptive rate is off or Redis could not be told."""
        adaptive = self._config.adaptive
        if adaptive is None or self.breaker.open_for() is not None:
            return None
        return await self._answered(
            domain, self._bucket.slow_down(domain, limit, adaptive, age, hold)
        )

    async def unreserve(self, domain: str, reservations: list[Reservation]) -> Unreserved | None:
        """Give *domain*'s bucket back *reservations* (see :meth:`.TokenBucket.unreserve`); None
        when Redis could not be told (they expire with their moments)."""
        if self.breaker.open_for() is not None:
            return None
        if self._lost_at is not None:
            # Those reserved before Redis lost the throttle's state are not the new bucket's.
            lost_us = self._bucket.server_clock(domain).moment_us(self._lost_at[1])
            reservations = [
                each for each in reservations if lost_us is not None and each.at > lost_us
            ]
            if not reservations:
                return Unreserved(0, 0)
        return await self._answered(domain, self._bucket.unreserve(domain, reservations))

    async def _answered(self, domain: str, call: Awaitable[_T]) -> _T | None:
        """:meth:`_guarded`, with a refused call taken as no answer."""
        try:
            return await self._guarded(domain, call)
        except ScriptRefused:
            return None

    async def _guarded(
        self, domain: str, call: Awaitable[_T], also: Sequence[str] = ()
    ) -> _T | None:
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
        if not self.breaker.failed():
            return
        self._openings += 1
        self.fallback.redis_failed(exc)
        self._prober = asyncio.ensure_future(self._probe_until_back())

    def _succeeded(self) -> None:
        outage = self.breaker.succeeded()
        if outage is not None:
            self.fallback.redis_back(outage)

    async def _probe_until_back(self) -> None:
        while self.breaker.open_for() is not None:
            await self._clock.sleep(self.breaker.next_probe_in())
            if self.breaker.open_for() is None:  # a call under way got through meanwhile
                await self._checked_state()
                return
            self._stats.inc_value(f"{STATS_PREFIX}/redis_calls")
            try:
                for name in self._failed_domains:
                    await self._bucket.probe(name)
                # Whether it restarted empty, before the requests waiting for it call it: they
                # would tell it the moments this worker saw reserved, lost (see lost()).
                await self.check_state()
            except RedisError as exc:
                self._stats.inc_value(redis_error_stat(type(exc).__name__))
                continue
            self._succeeded()

    def closing(self) -> None:
        """The spider closes: no request waits for Redis any more (see :meth:`acquire`)."""
        self._closing = True
        self.breaker.stop_waiting()

    async def aclose(self) -> None:
        """Stop probing, disconnect; count an outage still under way in the stats."""
        if self._prober is not None:
            await cancel_and_wait(self._prober, "the probe of Redis")
        outage = self.breaker.open_for()
        if outage is not None:
            self.fallback.count_outage(outage)
        await self._bucket.aclose()
