"""Whether Redis lost the throttle's state (restarted empty, or its keys deleted), as this
worker last read it: the fleet's secret (see :mod:`.seals`) is new. Every moment reserved in
Redis before that may be given to another request, and is lost."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .pauses import CLOCK_MARGIN
from .seals import Seals
from .stats import STATS_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy.statscollectors import StatsCollector

    from .clock import Clock
    from .config import ThrottleConfig
    from .fallback import Fallback
    from .rates import Limit
    from .rejections import Rejections
    from .replies import Reservation
    from .server_clock import ServerClock

logger = logging.getLogger(__name__)


class LostState:
    """What this worker read of the fleet's secret in the Redis of *config*, and since when the
    moments reserved there before are lost; *fallback* hears of each loss."""

    def __init__(
        self,
        config: ThrottleConfig,
        stats: StatsCollector,
        rejections: Rejections,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
        fallback: Fallback,
    ) -> None:
        self._config = config
        self._stats = stats
        self._rejections = rejections
        self._log_extra = log_extra
        self._clock = clock
        self._fallback = fallback
        self.seals = Seals()
        # When this worker last read that Redis lost the throttle's state (wall and monotonic
        # time; None: never).
        self._lost_at: tuple[float, float] | None = None

    def read(self, secret: bytes, replaced: bool) -> None:
        """The fleet's *secret*, as just read from Redis (*replaced*: the key held something a
        worker did not make, and was replaced)."""
        if replaced:
            self._rejections.reject(
                "secret",
                "",
                "the fleet's secret in Redis was not one a worker made",
                "replaced it: the moments reserved before are taken as lost",
            )
        if self.seals.know(secret) or replaced:
            self._lost_at = (self._clock.wall(), self._clock.monotonic())
            self._stats.inc_value(f"{STATS_PREFIX}/state_lost")
            self._fallback.redis_lost()
            logger.warning(
                "Redis throttle: Redis at %s lost the throttle's state (restarted empty, or its "
                "keys were deleted): the requests that waited for moments reserved there before "
                "ask for new ones",
                self._config.redis_location,
                extra=self._log_extra(),
            )

    def lost(self, reserved_at: float, elsewhere: bool = False) -> bool:
        """Whether a moment reserved at *reserved_at* (wall time; *elsewhere*: by another
        process, whose clock may differ by up to CLOCK_MARGIN) was reserved before Redis lost
        the throttle's state, as far as this worker has read. It must not be used: its bucket
        may give a moment reserved there to another request, and one taken alone while Redis
        failed was placed after moments that are no more."""
        if self._lost_at is None:
            return False
        return reserved_at < self._lost_at[0] + (CLOCK_MARGIN if elsewhere else 0.0)

    def drained_until(self, limit: Limit) -> float:
        """Until when (loop time; 0: not later than now) a bucket of *limit* counts as busy
        after Redis lost the throttle's state: drained when this worker read the loss. The
        fleet may have spent the whole burst just before, and nothing in Redis says otherwise;
        every moment reserved before is void (see :meth:`lost`), so none goes after that."""
        if self._lost_at is None:
            return 0.0
        until = self._lost_at[1] + limit.burst / limit.rate
        return until if until > self._clock.monotonic() else 0.0

    def since_loss(self, reservations: list[Reservation], clock: ServerClock) -> list[Reservation]:
        """Those of *reservations* made after Redis lost the throttle's state (by *clock*, their
        node's): the others are not its new buckets' to take back."""
        if self._lost_at is None:
            return reservations
        lost_us = clock.moment_us(self._lost_at[1])
        return [each for each in reservations if lost_us is not None and each.at > lost_us]
