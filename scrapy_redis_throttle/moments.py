"""Whether a request's reserved moment comes and still holds: a pause, a change of the rate, or
Redis losing the throttle's state may void it while the request waits, and a busy worker may
wake too late for it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from .config import FALLBACK_WAIT
from .stats import STATS_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from scrapy.statscollectors import StatsCollector

    from .budgets import Budget
    from .clock import Clock
    from .config import ThrottleConfig
    from .fallback import Grant
    from .pauses import Pauses
    from .rates import Limit
    from .replies import Reservation, Voiding
    from .server_clock import ServerClock

logger = logging.getLogger(__name__)

# A request that cannot go within this long after its reserved moment (given back late by the
# parking area, woken late by a busy process, or whose answer was read late, even one that let
# it go at once) asks for a new one: going that late would squeeze it against the requests of
# the moments after its own, at the site.
MISSED_AFTER = 0.05
# A timer may fire this early (the loop's clock resolution): the moment has come.
MOMENT_SLACK = 0.001


class SharedBucket(Protocol):
    """What a request's turn asks of the shared bucket (:class:`.ResilientBucket`)."""

    async def acquire(
        self, domain: str, limit: Limit, cost: float, others: Sequence[Budget] = ()
    ) -> Grant: ...

    def server_clock(self, domain: str) -> ServerClock: ...

    async def last_voiding(
        self, domain: str, listening: bool = False
    ) -> tuple[bool, Voiding | None]: ...

    def lost(self, reserved_at: float, elsewhere: bool = False) -> bool: ...

    def returned_since(self, reserved_at: float, elsewhere: bool = False) -> bool: ...


class Moments:
    """Waits for reserved moments, and tells whether each still holds when it comes."""

    def __init__(
        self,
        config: ThrottleConfig,
        bucket: SharedBucket,
        pauses: Pauses,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
    ) -> None:
        self._config = config
        self._bucket = bucket
        self._pauses = pauses
        self._stats = stats
        self._log_extra = log_extra
        self._clock = clock

    async def hold_until(
        self,
        domain: str,
        moment: float,
        moment_us: float | None,
        reserved_at: float,
        elsewhere: bool = False,
        local: bool = False,
        reservation: Reservation | None = None,
    ) -> bool:
        """Wait for the *moment* (loop time; *moment_us*: by Redis's clock, if Redis gave it)
        reserved for *domain* at *reserved_at* (*reservation*: in Redis): True when it comes,
        False as soon as it is void (see :meth:`_still_reserved`) or missed (see
        :meth:`missed`)."""
        # The voidings it may have missed are read first, within its wait (read at its moment,
        # a slow Redis's answer would come too late for it); the listener hears those after.
        if self._pauses.listening and not await self._read_voidings(
            domain, reserved_at, elsewhere, local
        ):
            return False
        while True:
            await self._pauses.sleep(domain, moment - self._clock.monotonic())
            # Placed by the bounds Redis's clock had then: those of a reply read late put it
            # late, and the replies read since may tell that it has passed.
            moment = self._bucket.server_clock(domain).placed(moment, moment_us)
            if (
                self.missed(domain, moment)
                or not await self._still_reserved(
                    domain, reserved_at, moment, elsewhere, local, reservation
                )
                or self.missed(domain, moment)  # Redis answered the voiding's read too late
            ):
                return False
            # Else woken early by a pause that does not void this moment (one that came after
            # it was reserved): the rest of the wait still holds.
            if self._clock.monotonic() >= moment - MOMENT_SLACK:
                return True

    def missed(self, domain: str, moment: float) -> bool:
        """Whether it is over ``MISSED_AFTER`` too late to go at *moment* (counted)."""
        late = self._clock.monotonic() - moment
        if late <= MISSED_AFTER:
            return False
        self._stats.inc_value(f"{STATS_PREFIX}/missed_moments")
        logger.debug(
            "Redis throttle: a request missed its moment for %(domain)r by %(late).3f s (its "
            "worker was busy): it asks for a new one",
            {"domain": domain, "late": late},
            extra=self._log_extra(),
        )
        return True

    async def _still_reserved(
        self,
        domain: str,
        reserved_at: float,
        moment: float,
        elsewhere: bool = False,
        local: bool = False,
        reservation: Reservation | None = None,
    ) -> bool:
        """Whether a request may go at the *moment* it reserved at *reserved_at* (see
        :meth:`.Pauses.is_void`; *elsewhere*: in another process, maybe; *reservation*: in
        Redis, which tells when by Redis's clock): not if a pause, or a change of the rate,
        voided it since, or Redis lost the throttle's state since it was reserved, there or
        alone (see :meth:`.ResilientBucket.lost`); it must ask Redis again. For a moment
        reserved in Redis (not *local*ly, while Redis failed), a pause published while this
        worker was not listening is read from Redis; if Redis cannot tell, the request goes by
        what this worker heard (under the ``"wait"`` policy, it asks again)."""
        if not await self._read_voidings(domain, reserved_at, elsewhere, local):
            return False
        reserved_us = None if reservation is None else reservation.at
        if self._pauses.is_void(domain, reserved_at, moment, elsewhere, reserved_us):
            self._stats.inc_value(f"{STATS_PREFIX}/paused_reservations")
            return False
        if self._bucket.lost(reserved_at, elsewhere):
            # Redis restarted empty since: its bucket may give the moment to another request,
            # and one taken alone was placed after moments that are no more.
            self._stats.inc_value(f"{STATS_PREFIX}/lost_reservations")
            return False
        if local and self._bucket.returned_since(reserved_at, elsewhere):
            # Given out alone while Redis failed, and Redis answers again since: Redis was not
            # told of it, and may have given its time to another worker.
            self._stats.inc_value(f"{STATS_PREFIX}/fallback/returned_reservations")
            return False
        return True

    async def _read_voidings(
        self, domain: str, reserved_at: float, elsewhere: bool, local: bool
    ) -> bool:
        """Read *domain*'s last voiding from Redis if this worker may have missed one since
        *reserved_at* (see :meth:`.Pauses.knows_voidings`; never for a moment reserved
        *local*ly): False when Redis cannot tell and the ``"wait"`` policy says to ask again."""
        if local or self._pauses.knows_voidings(domain, reserved_at, elsewhere):
            return True
        self._stats.inc_value(f"{STATS_PREFIX}/voidings_read")
        read_at = self._clock.wall()
        known, voiding = await self._bucket.last_voiding(domain, self._pauses.listening)
        if known:
            self._pauses.read(domain, voiding, read_at)
            return True
        # Else Redis fails, and what this worker heard is all it can know: a moment reserved in
        # Redis is still the fleet's, where a new one (paced alone) would know no more of the
        # pauses published meanwhile. Under the "wait" policy nothing goes on a guess: it asks
        # again, and waits for Redis.
        return self._config.on_redis_error != FALLBACK_WAIT
