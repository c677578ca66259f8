"""A request's turn: ask the shared bucket, then go now, wait a little in the middleware, or be
parked until its moment (a :class:`~.tickets.Ticket` for the parking area)."""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from scrapy.exceptions import IgnoreRequest
from scrapy.utils.httpobj import urlparse_cached

from .fallback import Source
from .metrics import ACQUIRED, PAUSED_LIVE, UNTHROTTLED
from .moments import Moments
from .parking import RELEASE_AHEAD
from .rates import limit_in_force
from .stats import STATS_PREFIX
from .tickets import OTHERS_META, Ticket

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request
    from scrapy.statscollectors import StatsCollector

    from .activity import Activity
    from .budgets import RequestBudget
    from .clock import Clock
    from .config import ThrottleConfig
    from .fallback import Grant
    from .live_limits import LiveLimits
    from .metrics import ThrottleMetrics
    from .moments import SharedBucket
    from .pauses import Pauses
    from .rates import Limit
    from .replies import Reservation

logger = logging.getLogger(__name__)

# When the request left for the download (loop time), for the adaptive rate.
SENT_META = "_redis_throttle_sent_at"


class DroppedAtClose(IgnoreRequest):
    """A request that would have waited again while the spider closes, and could not be
    parked: dropped, so that the close does not wait for it (with scrapy-redis, its lease gives
    it back to the queue)."""


class Lender(Protocol):
    """What lends a robots.txt request the moment of a request waiting for it
    (:class:`.Handoff`)."""

    def lend(self, domain: str) -> Ticket | None: ...


class Turns:
    """Decides when each throttled request goes: now, after a wait in the middleware, or, for a
    wait over ``max_hold``, parked (for the requests that may be, see :meth:`.Handoff.handed_out`).
    """

    def __init__(
        self,
        config: ThrottleConfig,
        bucket: SharedBucket,
        pauses: Pauses,
        activity: Activity,
        live_limits: LiveLimits,
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
        self._live_limits = live_limits
        self._stats = stats
        self._metrics = metrics
        self._log_extra = log_extra
        self._moments = Moments(config, bucket, pauses, stats, log_extra, clock)
        self.handoff: Lender | None = None
        """The parking area's, once it is attached at the spider's open (None: none)."""
        self.closing = False
        """The spider closes: a request that would wait again is parked, or dropped."""

    async def take(
        self, request: Request, budget: RequestBudget, ticket: Ticket | None, may_park: bool
    ) -> Ticket | None:
        """Wait until *request*, drawing on *budget*, may go (None), or return the ticket to
        park it with (only if it *may_park*). *ticket*: it is back from the parking area with
        it (see :meth:`.Handoff.handed_out`)."""
        ticket, lend = self._handed(request, budget, ticket)
        domain, limit, others = budget.domain, budget.limit, budget.others
        with self._activity.holding(domain), self._metrics.holding(domain):
            stats = self._stats
            # Its wait counts from its first turn, before it was parked (a lent ticket's is
            # another request's).
            since = self._clock.wall() if ticket is None or lend else ticket.waiting_since
            # Back from the parking area with its tokens reserved: it goes at its moment.
            delayed = ticket is not None
            while ticket is not None and ticket.reserved:
                if await self._moments.hold_until(
                    domain,
                    ticket.moment(self._bucket.server_clock(domain)),
                    ticket.moment_us,
                    ticket.reserved_at,
                    ticket.elsewhere,
                    ticket.locally,
                    ticket.reservation,
                ):
                    self._went(request, budget, since, True, ticket.reservation)
                    return None
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
                    if self._moments.missed(domain, decided):
                        # Read too late to go now (see MISSED_AFTER): its token is spent.
                        delayed = True
                        continue
                    unthrottled = grant.source is Source.OPEN
                    self._went(request, budget, since, delayed, None, unthrottled)
                    return None
                if result.paused:
                    stats.inc_value(f"{STATS_PREFIX}/paused_live")
                    self._metrics.paused(domain, PAUSED_LIVE)
                if may_park and result.retry_after > self._config.max_hold:
                    return self._park(request, domain, limit, grant, asked_at, since)
                self._log_wait(request, budget, grant)
                delayed = True
                if result.reserved:
                    moment = decided + result.retry_after
                    moment_us = result.moment_us if grant.shared else None
                    if await self._moments.hold_until(
                        domain,
                        moment,
                        moment_us,
                        asked_at,
                        local=not grant.shared,
                        reservation=result.reservation if grant.shared else None,
                    ):
                        self._went(request, budget, since, delayed, result.reservation)
                        return None
                    continue
                if grant.asks_again or result.retry_after <= self._config.max_reserve:
                    # Paused, waiting for Redis or for its share, or not reserved though near
                    # (a fixed window's room too many windows ahead): it asks again then.
                    await self._clock.sleep(result.retry_after)
                    continue
                # Too far ahead to reserve: come back when it is not.
                await self._clock.sleep(result.retry_after - self._config.max_reserve / 2)

    def _handed(
        self, request: Request, budget: RequestBudget, ticket: Ticket | None
    ) -> tuple[Ticket | None, Callable[[], Ticket | None] | None]:
        """The ticket *request* goes with: its own, if it still holds for *budget*, or one lent
        (see :meth:`.Handoff.lend`); and how to be lent the next if it misses that one's."""
        lend = None
        if ticket is None and self.handoff is not None and not budget.others and _robots(request):
            # Its worker's requests of the domain back from the parking area wait for it:
            # it goes at the soonest moment one of them holds.
            lend = functools.partial(self.handoff.lend, budget.domain)
            ticket = lend()
        if ticket is not None and (
            ticket.domain != budget.domain
            or request.meta.get(OTHERS_META, []) != budget.other_names
        ):
            # Its scope names another domain now, or its other budgets changed while it was
            # parked (another proxy): its moment was not reserved in them; it asks anew.
            ticket = replace(ticket, domain=budget.domain, reserved=False)
        return ticket, lend

    def _log_wait(self, request: Request, budget: RequestBudget, grant: Grant) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        reservation = grant.result.reservation if grant.shared else None
        limit = limit_in_force(
            self._live_limits.over(budget.domain, budget.limit),
            _rate_in_force(budget, reservation),
        )
        why = {
            Source.HANDOVER: ", keeping to this worker's share just after an outage",
            Source.WAIT: ", until Redis answers",
            Source.ALONE: ", paced locally while Redis fails",
        }.get(grant.source, ", paused live" if grant.result.paused else "")
        logger.debug(
            "Redis throttle: %(request)s waits %(delay).3f s for %(domain)r "
            "(%(limit)s)%(others)s%(why)s",
            {
                "request": request,
                "delay": grant.result.retry_after,
                "domain": budget.domain,
                "limit": limit,
                "others": "".join(f" and {name!r} ({each})" for name, each in budget.others),
                "why": why,
            },
            extra=self._log_extra(),
        )

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
        if self._config.adaptive is not None:
            request.meta[SENT_META] = self._clock.monotonic()
        stats.inc_value(f"{STATS_PREFIX}/requests")
        # Wall time: a parked request may have been first seen in another process.
        waited = max(0.0, self._clock.wall() - since)
        rate = _rate_in_force(budget, reservation)
        limit = self._live_limits.over(domain, budget.limit)
        self._activity.went(domain, waited, limit, rate)
        self._metrics.went(
            domain, UNTHROTTLED if unthrottled else ACQUIRED, waited, limit.sustained_rate, rate
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
        if result.reserved or grant.asks_again:
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
            domain=domain,
            due=due,
            reserved=result.reserved,
            locally=not grant.shared,
            reserved_at=asked_at,
            waiting_since=since,
            elsewhere=False,
            moment_us=result.moment_us if result.reserved and grant.shared else None,
            reservation=reservation,
        )


def _rate_in_force(budget: RequestBudget, reservation: Reservation | None) -> float | None:
    """The rate Redis paced a request of *budget* at (requests per second; None: not told):
    the µs its tokens added to the bucket are the interval in force, times its cost. A limit
    set live, or the adaptive rate, may make it another than the configured one."""
    if reservation is None or not reservation.step:
        return None
    return budget.cost * 1e6 / reservation.step


def _robots(request: Request) -> bool:
    """Whether *request* is RobotsTxtMiddleware's fetch of a robots.txt."""
    return bool(request.meta.get("dont_obey_robotstxt")) and (
        urlparse_cached(request).path == "/robots.txt"
    )
