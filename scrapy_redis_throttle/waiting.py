"""A request's turn: ask the shared bucket, then go now, wait a little in the middleware, or be
parked until its moment (a :class:`~.parking.Ticket` for the parking area)."""

from __future__ import annotations

import enum
import logging
import random
from typing import TYPE_CHECKING, Any, Protocol

from scrapy.exceptions import IgnoreRequest

from .config import FALLBACK_WAIT, STATS_PREFIX
from .metrics import ACQUIRED, PAUSED_LIVE, UNTHROTTLED
from .parking import RELEASE_AHEAD
from .tickets import Ticket

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from scrapy import Request
    from scrapy.statscollectors import StatsCollector

    from .activity import Activity
    from .bucket import Reservation, Voiding
    from .budgets import Budget, RequestBudget
    from .clock import Clock
    from .config import ThrottleConfig
    from .fallback import Grant
    from .metrics import ThrottleMetrics
    from .penalties import Pauses
    from .rates import Limit
    from .server_clock import ServerClock

logger = logging.getLogger(__name__)

# A request that cannot go within this long after its reserved moment (given back late by the
# parking area, woken late by a busy process, or whose answer was read late, even one that let
# it go at once) asks for a new one: going that late would squeeze it against the requests of
# the moments after its own, at the site.
MISSED_AFTER = 0.05
# A timer may fire this early (the loop's clock resolution): the moment has come.
MOMENT_SLACK = 0.001
# When the request left for the download (loop time), for the adaptive rate.
SENT_META = "_redis_throttle_sent_at"


class DroppedAtClose(IgnoreRequest):
    """A request that would have waited again while the spider closes, and could not be
    parked: dropped, so that the close does not wait for it (with scrapy-redis, its lease gives
    it back to the queue)."""


class Went(enum.Enum):
    """A request's turn came, and it left for the download."""

    WENT = "went"


WENT = Went.WENT


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


class Turns:
    """Decides when each throttled request goes. Waits longer than ``max_hold`` are parked,
    for the requests that may be (see :meth:`.ParkingArea.handed_out`)."""

    def __init__(
        self,
        config: ThrottleConfig,
        bucket: SharedBucket,
        pauses: Pauses,
        activity: Activity,
        stats: StatsCollector,
        metrics: ThrottleMetrics,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
    ) -> None:
        self._clock = clock
        self._config = config
        self._bucket = bucket
        self._pauses = pauses
        self._activity = activity
        self._stats = stats
        self._metrics = metrics
        self._log_extra = log_extra
        self.closing = False
        """The spider closes: a request that would wait again is parked, or dropped."""

    async def take(
        self,
        request: Request,
        budget: RequestBudget,
        ticket: Ticket | None,
        may_park: bool,
        lend: Callable[[], Ticket | None] | None = None,
    ) -> Ticket | Went:
        """Wait until *request*, drawing on *budget*, may go (:data:`WENT`), or return the
        ticket to park it with (only if it *may_park*). *ticket*: the request is back from the
        parking area with it, or was lent one; *lend*: lends it another when it misses that
        one's moment (see :meth:`.Handoff.lend`)."""
        domain, limit, others = budget.domain, budget.limit, budget.others
        with self._activity.holding(domain), self._metrics.holding(domain):
            stats = self._stats
            # Its wait counts from its first turn, before it was parked (a lent ticket's is
            # another request's).
            since = self._clock.wall() if ticket is None or lend else ticket.waiting_since
            # Back from the parking area with its tokens reserved: it goes at its moment.
            delayed = ticket is not None
            while ticket is not None and ticket.reserved:
                if await self._hold_until(
                    domain,
                    ticket.moment(self._bucket.server_clock(domain)),
                    ticket.moment_us,
                    ticket.reserved_at,
                    ticket.elsewhere,
                    ticket.locally,
                    ticket.reservation,
                ):
                    self._went(request, budget, since, True, ticket.reservation)
                    return WENT
                ticket = None if lend is None else lend()
            while True:
                asked_at = self._clock.wall()
                grant = await self._bucket.acquire(domain, limit, budget.cost, others)
                result = grant.result
                decided = result.decided(self._clock.monotonic())
                delayed = delayed or grant.waited_for_redis
                paused = 0.0 if grant.shared else self._pauses.paused_for(domain)
                if self.closing and (paused or not (result.allowed or result.reserved)):
                    # It would wait again: parked (kept or dropped with the others at the close),
                    # or dropped, so that the close does not wait for it.
                    if not may_park:
                        raise DroppedAtClose(
                            f"the spider closes; it would wait again for {domain!r}"
                        )
                    return self._park(request, domain, limit, grant, asked_at, since)
                if paused:
                    # Without Redis no bucket holds the pause back: this worker does.
                    delayed = True
                    await self._clock.sleep(paused)
                    continue
                if result.allowed:
                    if self._missed(domain, decided):
                        # Read too late to go now (see MISSED_AFTER): its token is spent.
                        delayed = True
                        continue
                    self._went(request, budget, since, delayed, None, grant.unthrottled)
                    return WENT
                if result.paused and grant.shared:
                    stats.inc_value(f"{STATS_PREFIX}/paused_live")
                    self._metrics.paused(domain, PAUSED_LIVE)
                if may_park and result.retry_after > self._config.max_hold:
                    return self._park(request, domain, limit, grant, asked_at, since)
                if grant.handover:
                    why = ", keeping to this worker's share just after an outage"
                elif result.paused:
                    why = ", paused live" if grant.shared else ", until Redis answers"
                else:
                    why = "" if grant.shared else ", paced locally while Redis fails"
                logger.debug(
                    "Redis throttle: %(request)s waits %(delay).3f s for %(domain)r "
                    "(%(limit)s)%(others)s%(why)s",
                    {
                        "request": request,
                        "delay": result.retry_after,
                        "domain": domain,
                        "limit": limit,
                        "others": "".join(f" and {name!r} ({each})" for name, each in others),
                        "why": why,
                    },
                    extra=self._log_extra(),
                )
                delayed = True
                if result.reserved:
                    moment = decided + result.retry_after
                    moment_us = result.moment_us if grant.shared else None
                    if await self._hold_until(
                        domain,
                        moment,
                        moment_us,
                        asked_at,
                        local=not grant.shared,
                        reservation=result.reservation if grant.shared else None,
                    ):
                        self._went(request, budget, since, delayed, result.reservation)
                        return WENT
                    continue
                if result.paused:
                    await self._clock.sleep(result.retry_after)
                    continue
                if result.retry_after <= self._config.max_reserve:
                    # Not reserved though near (a fixed window's room too many windows ahead):
                    # it asks again then.
                    await self._clock.sleep(result.retry_after)
                    continue
                # Too far ahead to reserve: come back when it is not.
                await self._clock.sleep(result.retry_after - self._config.max_reserve / 2)

    async def _hold_until(
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
        :meth:`_missed`)."""
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
                self._missed(domain, moment)
                or not await self._still_reserved(
                    domain, reserved_at, moment, elsewhere, local, reservation
                )
                or self._missed(domain, moment)  # Redis answered the voiding's read too late
            ):
                return False
            # Else woken early by a pause that does not void this moment (one that came after
            # it was reserved): the rest of the wait still holds.
            if self._clock.monotonic() >= moment - MOMENT_SLACK:
                return True

    def _missed(self, domain: str, moment: float) -> bool:
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

    def _went(
        self,
        request: Request,
        budget: RequestBudget,
        since: float,
        delayed: bool,
        reservation: Reservation | None,
        unthrottled: bool = False,
    ) -> None:
        """Count a request that leaves for the download, first seen at *since* (wall time),
        at the moment of its *reservation* if it had one in Redis; *unthrottled*: let go by
        the ``"open"`` policy."""
        stats = self._stats
        domain = budget.domain
        self._activity.went(domain)
        if self._config.adaptive is not None:
            request.meta[SENT_META] = self._clock.monotonic()
        stats.inc_value(f"{STATS_PREFIX}/requests")
        # Wall time: a parked request may have been first seen in another process.
        waited = max(0.0, self._clock.wall() - since)
        self._metrics.went(
            domain,
            UNTHROTTLED if unthrottled else ACQUIRED,
            waited,
            budget.limit.sustained_rate,
            # The µs its tokens added to the bucket: the interval in force, times the cost.
            budget.cost * 1e6 / reservation.step if reservation and reservation.step else None,
        )
        if not delayed:
            stats.inc_value(f"{STATS_PREFIX}/allowed_immediately")
            return
        stats.inc_value(f"{STATS_PREFIX}/delayed")
        total_key = f"{STATS_PREFIX}/wait_time_total"
        stats.set_value(total_key, stats.get_value(total_key, 0.0) + waited)
        stats.max_value(f"{STATS_PREFIX}/wait_time_max", waited)

    def _park(
        self,
        request: Request,
        domain: str,
        limit: Limit,
        grant: Grant,
        asked_at: float,
        since: float,
    ) -> Ticket:
        """The ticket that parks *request* until shortly before it may go."""
        result = grant.result
        if result.reserved or result.paused:
            delay = result.retry_after
        elif result.retry_after <= self._config.max_reserve:
            # Refused though near (a fixed window's room too many windows ahead): back then,
            # given back RELEASE_AHEAD early.
            delay = result.retry_after + RELEASE_AHEAD
        else:
            # Due when its tokens can be reserved, counting that the parking area gives it back
            # RELEASE_AHEAD early (or it would come back too early, again and again); spread
            # out, so that the requests parked together do not all come back at once.
            delay = (
                result.retry_after
                + RELEASE_AHEAD
                - self._config.max_reserve * random.uniform(0.5, 1)
            )
        logger.debug(
            "Redis throttle: %(request)s parked for %(delay).3f s for %(domain)r (%(limit)s)",
            {"request": request, "delay": delay, "domain": domain, "limit": limit},
            extra=self._log_extra(),
        )
        self._stats.inc_value(f"{STATS_PREFIX}/park_requests")
        self._activity.park(domain, 1)
        due = result.decided(self._clock.monotonic()) + delay
        reservation = result.reservation if grant.shared else None
        return Ticket(
            domain,
            due,
            result.reserved,
            not grant.shared,
            asked_at,
            since,
            False,
            result.moment_us if result.reserved and grant.shared else None,
            reservation,
        )
