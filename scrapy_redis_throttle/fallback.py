"""What requests get while the throttle's Redis fails, by ``REDIS_THROTTLE_ON_REDIS_ERROR``:

* ``"local"`` (default): each domain is paced in this process, at its rate (and burst)
  divided by the number of workers that were live in Redis just before it failed (see
  :attr:`.Activity.fleet_size`; ``REDIS_THROTTLE_FALLBACK_WORKERS`` overrides it), starting
  where the shared bucket was last seen, so that the fleet together keeps the limit. Not at
  once in a fleet: for ``REDIS_THROTTLE_FALLBACK_AFTER`` the outage may be this worker's alone,
  while the others draw whole budgets from Redis, and only the moments it reserved there go. A
  worker that never reached Redis does not know the fleet's size: its requests wait for Redis;
* ``"open"``: requests go unthrottled;
* ``"wait"``: requests wait until Redis answers again.

Once Redis is back, under ``"local"``, requests keep to this worker's share for one more
``REDIS_THROTTLE_PROBE_INTERVAL`` (the handover, see :meth:`Fallback.handover_wait`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import FALLBACK_LOCAL, FALLBACK_OPEN
from .local_buckets import LocalBuckets
from .pauses import CLOCK_MARGIN
from .replies import AcquireResult
from .stats import STATS_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from redis.exceptions import RedisError
    from scrapy.statscollectors import StatsCollector

    from .budgets import Budget
    from .clock import Clock
    from .config import ThrottleConfig
    from .fleet import Fleet
    from .live_limits import LiveLimits
    from .rates import Limit

logger = logging.getLogger(__name__)

_ALLOWED = AcquireResult(allowed=True, reserved=False, tokens_left=0, retry_after=0, reset_after=0)


# A request that must wait for Redis (this worker knows no share for it) asks again after this
# long: over REDIS_THROTTLE_MAX_HOLD by default, so it is parked meanwhile and holds no download
# slot, nor delays a close.
WAIT_FOR_REDIS = 5.0


def later(seconds: float) -> AcquireResult:
    """Nothing reserved: ask again in *seconds* (held or parked meanwhile)."""
    return AcquireResult(
        allowed=False, reserved=False, tokens_left=0.0, retry_after=seconds, reset_after=0.0
    )


class Source(enum.Enum):
    """Who decided a request's turn."""

    REDIS = "redis"
    """The shared bucket in Redis."""
    ALONE = "alone"
    """This worker alone, at its share (``"local"`` policy, or a call the script refused)."""
    HANDOVER = "handover"
    """This worker's share, just after an outage (see :meth:`Fallback.handover_wait`): it asks
    Redis again once its share allows it."""
    WAIT = "wait"
    """Nobody: it waits for Redis (held at an outage's start, no share known, ``"wait"``)."""
    OPEN = "open"
    """The ``"open"`` policy, unthrottled."""


@dataclass(frozen=True)
class Grant:
    """The answer to one acquire, and who gave it."""

    result: AcquireResult
    source: Source
    waited_for_redis: bool = False
    """Redis decided, after the request waited for it to answer again."""

    @property
    def shared(self) -> bool:
        """Decided by Redis, for the fleet."""
        return self.source is Source.REDIS

    @property
    def asks_again(self) -> bool:
        """It reserved nothing and asks again in ``result.retry_after`` seconds: its domain is
        paused live, or it waits for Redis or for this worker's share."""
        return self.result.paused or self.source in (Source.WAIT, Source.HANDOVER)


class Fallback:
    """The fallback policy of *config*, for a worker of *fleet* (None: it knows no fleet)."""

    def __init__(
        self,
        config: ThrottleConfig,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
        fleet: Fleet | None,
        live_limits: LiveLimits,
    ) -> None:
        self._config = config
        self._live_limits = live_limits
        self._stats = stats
        self._log_extra = log_extra
        self._clock = clock
        self._fleet = fleet
        self.local = LocalBuckets(clock)
        """This worker's pace alone, following Redis's while it answers."""
        # Until then (monotonic time), after an outage, requests also keep to this worker's
        # share, in buckets of their own: the other workers may still pace alone.
        self._handover_until = 0.0
        self._handover = LocalBuckets(clock)
        # When Redis last answered again after an outage (wall time; None: never).
        self._returned_at: float | None = None

    def decide(
        self, domain: str, limit: Limit, cost: float, others: Sequence[Budget], outage: float
    ) -> Grant | None:
        """The decision for a request while Redis fails, for *outage* seconds now (None: it
        waits for Redis)."""
        policy = self._config.on_redis_error
        if policy == FALLBACK_LOCAL:
            held = self._config.fallback_after - outage
            if held > 0 and self._holds():
                # This worker cannot tell an outage of its own (its network path cut, a call
                # timed out on a loaded machine) from the fleet's. If it is alone, the others
                # still draw each whole budget from Redis: paced alone, it would add its share
                # on top. Only the moments it reserved there go, until the outage has lasted
                # long enough to be the fleet's too.
                self._stats.inc_value(f"{STATS_PREFIX}/fallback/held")
                return Grant(later(min(held, WAIT_FOR_REDIS)), Source.WAIT)
            if (
                self._config.fallback_workers is None
                and self.workers() is not None
                and not self.local.seen(domain)
            ):
                # This worker never saw the domain's bucket in Redis (or forgot it): it does not
                # know the moments other workers hold there, and would pace beside them from
                # nothing: it asks again later (WAIT_FOR_REDIS). With
                # REDIS_THROTTLE_FALLBACK_WORKERS, the project chose to pace alone anyway.
                self._stats.inc_value(f"{STATS_PREFIX}/fallback/unseen_domain")
                return Grant(later(WAIT_FOR_REDIS), Source.WAIT)
            return self.paced_alone(domain, limit, cost, others)
        if policy == FALLBACK_OPEN:
            self._stats.inc_value(f"{STATS_PREFIX}/fallback/open")
            return Grant(_ALLOWED, Source.OPEN)
        return None

    def paced_alone(
        self, domain: str, limit: Limit, cost: float, others: Sequence[Budget]
    ) -> Grant:
        """A decision of this worker alone: its share of *domain*'s rate (and of its other
        scopes'), under its limit set live as Redis last told it."""
        live = self._live_limits.of(domain)
        if live is not None and live.paused:
            # Paused live for the fleet: only Redis can tell that it was resumed.
            self._stats.inc_value(f"{STATS_PREFIX}/fallback/paused_live")
            return Grant(later(WAIT_FOR_REDIS), Source.WAIT)
        limit = self._live_limits.over(domain, limit)
        workers = self.workers()
        if workers is not None:
            self._stats.inc_value(f"{STATS_PREFIX}/fallback/local")
            result = self.local.acquire(
                domain, limit, cost, self._config.max_reserve, workers, others
            )
            return Grant(result, Source.ALONE)
        # The fleet's size is not known, nor this worker's share: it sends nothing until Redis
        # answers, and asks again later (WAIT_FOR_REDIS).
        self._stats.inc_value(f"{STATS_PREFIX}/fallback/unknown_fleet")
        return Grant(later(WAIT_FOR_REDIS), Source.WAIT)

    def handover_wait(
        self, domain: str, limit: Limit, cost: float, others: Sequence[Budget]
    ) -> float:
        """Right after an outage, how long a request must wait for this worker's share (0: it
        may ask Redis now, and its share is taken). Redis is back for this worker, but another
        one may not have noticed yet (its next probe may be up to
        REDIS_THROTTLE_PROBE_INTERVAL away) and still paces alone at its share, unknown to
        Redis: keeping to its own share meanwhile, this one leaves the other's to it, and
        together they stay within the rate. The share's buckets are this worker's alone:
        neither told to Redis nor following it, so that they hold back no other worker."""
        workers = self.workers()
        if workers is None or self._clock.monotonic() >= self._handover_until:
            return 0.0
        limit = self._live_limits.over(domain, limit)
        share = self._handover.acquire(domain, limit, cost, 0.0, workers, others)
        if share.allowed:
            return 0.0
        self._stats.inc_value(f"{STATS_PREFIX}/handover_waits")
        return share.retry_after

    def returned_since(self, reserved_at: float, elsewhere: bool = False) -> bool:
        """Whether a moment given out alone at *reserved_at* (wall time; *elsewhere*: in another
        process, whose clock may differ by up to CLOCK_MARGIN) was given before Redis answered
        again: it is void, and its request asks Redis. Redis is told only of the moments that
        went alone (see :meth:`.LocalBuckets.returned`), and once another worker's handover is
        over Redis gives it the times of those that had not come yet."""
        if self._returned_at is None:
            return False
        return reserved_at < self._returned_at + (CLOCK_MARGIN if elsewhere else 0.0)

    def workers(self) -> int | None:
        """The ``"local"`` policy's divisor: the setting, else the fleet's size as last seen."""
        return self._config.fallback_workers or self._fleet_size()

    def redis_failed(self, exc: RedisError) -> None:
        """Redis failed (the breaker opened)."""
        # Once it is back, every bucket still busy is told again: it may have lost them.
        self.local.tell_again()
        self._stats.inc_value(f"{STATS_PREFIX}/outages")
        logger.warning(
            "Redis throttle: Redis at %s is unavailable (%s: %s); %s",
            self._config.redis_location,
            type(exc).__name__,
            exc,
            self.describe(),
            extra=self._log_extra(),
        )

    def redis_back(self, outage: float) -> None:
        """Redis answers again after *outage* seconds (the breaker closed)."""
        self._returned_at = self._clock.wall()
        # The moments given out alone that have not come yet are void: Redis, back, does not
        # know them, and gives their times to the other workers once their handover is over.
        self.local.returned()
        self._start_handover()
        self.count_outage(outage)
        logger.info(
            "Redis throttle: Redis at %s is back after %.1f s; limits are shared again",
            self._config.redis_location,
            outage,
            extra=self._log_extra(),
        )

    def redis_lost(self) -> None:
        """Redis lost the throttle's state (restarted empty): what this worker saw reserved
        there is void (its requests ask anew); what it took alone still holds. A handover
        starts."""
        self.local.lost()
        # It was down for every worker (restarted), whether or not this one called it then:
        # the others may still pace alone.
        self._start_handover()

    def _start_handover(self) -> None:
        """Keep to this worker's share for one REDIS_THROTTLE_PROBE_INTERVAL (see
        :meth:`handover_wait`)."""
        if self._config.on_redis_error == FALLBACK_LOCAL:
            self._handover_until = self._clock.monotonic() + self._config.probe_interval
            # Each share goes on from where this worker's pace alone was: no new burst.
            self._handover = self.local.snapshot()

    def count_outage(self, seconds: float) -> None:
        """Add *seconds* of an outage to ``redis_throttle/fallback_time``."""
        key = f"{STATS_PREFIX}/fallback_time"
        self._stats.set_value(key, self._stats.get_value(key, 0.0) + seconds)

    def describe(self) -> str:
        """What requests do while Redis fails, for the logs."""
        policy = self._config.on_redis_error
        if policy == FALLBACK_LOCAL:
            if self._config.fallback_workers is not None:
                return (
                    f"each domain is paced in this process at 1/{self._config.fallback_workers} "
                    f"of its rate (REDIS_THROTTLE_FALLBACK_WORKERS) until it is back" + self._held()
                )
            workers = self._fleet_size()
            if workers is None:
                return (
                    "throttled requests wait until it is back (this worker has not seen the "
                    "fleet's size, so it knows no share of the rates to pace alone)"
                )
            return (
                f"each domain is paced in this process at 1/{workers} of its rate (the "
                f"{workers} worker{'s' if workers != 1 else ''} last seen live) until it is back"
                + self._held()
            )
        if policy == FALLBACK_OPEN:
            return "requests go unthrottled until it is back"
        return "throttled requests wait until it is back"

    def _fleet_size(self) -> int | None:
        return None if self._fleet is None else self._fleet.fleet_size

    def _holds(self) -> bool:
        """Whether, under ``"local"``, this worker holds its requests at the start of an outage
        (see :meth:`decide`): it is one of a fleet, and REDIS_THROTTLE_FALLBACK_AFTER is on."""
        workers = self.workers()
        return workers is not None and workers > 1 and self._config.fallback_after > 0

    def _held(self) -> str:
        if not self._holds():
            return ""
        return (
            f", from {self._config.fallback_after:g} s into the outage "
            f"(REDIS_THROTTLE_FALLBACK_AFTER: it may be this worker's alone); meanwhile only "
            f"the moments reserved in Redis go"
        )
