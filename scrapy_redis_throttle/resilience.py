"""What the throttle does when its Redis fails: the shared bucket behind the circuit breaker
(see :mod:`.redis_guard`), and the fallback policies (see :mod:`.fallback`, by
``REDIS_THROTTLE_ON_REDIS_ERROR``).

A failed call is never replayed: a call that timed out may have taken its tokens in Redis, and a
replay would take them twice. The request is decided by the policy instead. A call a script
refuses is that request's problem: it is paced by this worker alone, at its share (whatever
the policy: it never goes unthrottled, nor asks again at once).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import RedisError

from .across_nodes import CallsStopped
from .breaker import CircuitBreaker
from .bucket import TokenBucket
from .config import FALLBACK_LOCAL
from .fallback import WAIT_FOR_REDIS, Fallback, Grant, Source, later
from .live_limits import LiveLimits
from .lost_state import LostState
from .redis_guard import RedisGuard, ScriptRefused
from .rejections import Rejections
from .replies import Unreserved

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from scrapy.statscollectors import StatsCollector

    from .budgets import Budget
    from .clock import Clock
    from .config import ThrottleConfig
    from .connection import ThrottleRedis
    from .fleet import Fleet
    from .rates import Limit
    from .replies import AcquireResult, Penalty, Reservation, SlowDown, Voiding
    from .server_clock import ServerClock

logger = logging.getLogger(__name__)


_T = TypeVar("_T")

# The first probe of a failed Redis; later ones back off up to REDIS_THROTTLE_PROBE_INTERVAL.
FIRST_PROBE_DELAY = 0.5


class ResilientBucket:
    """The shared bucket behind a circuit breaker, with the configured fallback policy."""

    def __init__(
        self,
        redis: ThrottleRedis,
        config: ThrottleConfig,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
        fleet: Fleet | None = None,
        bucket: TokenBucket | None = None,
    ) -> None:
        self._redis = redis
        self._clock = clock
        self.breaker = CircuitBreaker(FIRST_PROBE_DELAY, config.probe_interval, clock)
        # The scripts' calls (a test passes its own).
        self._bucket = bucket or TokenBucket(
            redis,
            config.key_prefix,
            adaptive=config.adaptive is not None,
            breaker=self.breaker,
            clock=clock,
        )
        self._config = config
        self._rejections = Rejections(stats, log_extra)
        self._closing = False
        self.live_limits = LiveLimits(log_extra)
        """What of the limits set live reached this worker, as Redis told it: its pace alone
        keeps to them."""
        self.fallback = Fallback(config, stats, log_extra, clock, fleet, self.live_limits)
        self.lost_state = LostState(
            config, stats, self._rejections, log_extra, clock, self.fallback
        )
        self.guard = RedisGuard(
            redis,
            self._bucket,
            self.breaker,
            self.fallback,
            self.lost_state,
            stats,
            self._rejections,
            clock,
        )

    async def start(self) -> None:
        """Reach Redis before the first request (see :meth:`.RedisGuard.start`)."""
        await self.guard.start()

    def lost(self, reserved_at: float, elsewhere: bool = False) -> bool:
        """Whether a moment reserved at *reserved_at* is lost (see :meth:`.LostState.lost`)."""
        return self.lost_state.lost(reserved_at, elsewhere)

    def returned_since(self, reserved_at: float, elsewhere: bool = False) -> bool:
        """Whether a moment given out alone at *reserved_at* is void: Redis answered again since
        (see :meth:`.Fallback.returned_since`)."""
        return self.fallback.returned_since(reserved_at, elsewhere)

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
            if not self.breaker.is_open:
                share = self.fallback.handover_wait(domain, limit, cost, others)
                if share:
                    return Grant(later(share), Source.HANDOVER)
                try:
                    result = await self._call_redis(domain, limit, cost, others)
                except ScriptRefused:
                    return self.fallback.paced_alone(domain, limit, cost, others)
                if result is not None:
                    return Grant(result, Source.REDIS, waited_for_redis=waited)
            grant = self.fallback.decide(
                domain, limit, cost, others, self.breaker.open_for() or 0.0
            )
            if grant is not None:
                return grant
            if self._closing:  # the request asks again, and is parked or dropped meanwhile
                return Grant(later(WAIT_FOR_REDIS), Source.WAIT)
            waited = True
            await self.breaker.wait_closed()

    async def _call_redis(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        others: Sequence[Budget],
    ) -> AcquireResult | None:
        openings = self.guard.openings
        local = self.fallback.local
        untold = local.untold([domain, *(name for name, _ in others)])
        try:
            result = await self.guard.call(
                domain,
                self._bucket.acquire(
                    domain,
                    limit,
                    cost,
                    self._config.max_reserve,
                    busy_until=max(local.busy_until(domain), self.lost_state.drained_until(limit)),
                    others=[
                        (
                            name,
                            each,
                            max(local.busy_until(name), self.lost_state.drained_until(each)),
                        )
                        for name, each in others
                    ],
                ),
                also=[name for name, _ in others],
            )
        except CallsStopped:
            return None
        if result is None:
            return None
        self.live_limits.told(domain, result.live, limit)
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
        if openings != self.guard.openings and self._config.on_redis_error == FALLBACK_LOCAL:
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
                await self.guard.read_state()
            except RedisError:
                return False, None
        if self.breaker.is_open:
            return False, None
        reply = await self.guard.answered(domain, self._last_voiding(domain))
        return (False, None) if reply is None else (True, reply[0])

    async def _last_voiding(self, domain: str) -> tuple[Voiding | None]:
        # In a tuple: None is an answer here, and _guarded's word for a failed call.
        return (await self._bucket.last_voiding(domain),)

    async def penalize(
        self, domain: str, limit: Limit, retry_after: float | None
    ) -> Penalty | None:
        """Pause *domain* for the fleet (see :mod:`.pauses`); None when Redis could not be
        told."""
        if self.breaker.is_open:
            return None
        return await self.guard.answered(
            domain, self._bucket.penalize(domain, limit, retry_after, self._config.backoff)
        )

    async def slow_down(
        self, domain: str, limit: Limit, age: float, hold: float = 0
    ) -> SlowDown | None:
        """Lower *domain*'s adaptive rate for the fleet (see :meth:`TokenBucket.slow_down`); None
        when the adaptive rate is off or Redis could not be told."""
        adaptive = self._config.adaptive
        if adaptive is None or self.breaker.is_open:
            return None
        return await self.guard.answered(
            domain, self._bucket.slow_down(domain, limit, adaptive, age, hold)
        )

    async def unreserve(self, domain: str, reservations: list[Reservation]) -> Unreserved | None:
        """Give *domain*'s bucket back *reservations* (see :meth:`.TokenBucket.unreserve`); None
        when Redis could not be told (they expire with their moments)."""
        if self.breaker.is_open:
            return None
        # Those reserved before Redis lost the throttle's state are not the new bucket's.
        reservations = self.lost_state.since_loss(reservations, self._bucket.server_clock(domain))
        if not reservations:
            return Unreserved(0, 0)
        return await self.guard.answered(domain, self._bucket.unreserve(domain, reservations))

    def closing(self) -> None:
        """The spider closes: no request waits for Redis any more (see :meth:`acquire`)."""
        self._closing = True
        self.breaker.stop_waiting()

    async def aclose(self) -> None:
        """Stop probing, disconnect (see :meth:`.RedisGuard.aclose`)."""
        await self.guard.aclose()
        await self._bucket.aclose()
