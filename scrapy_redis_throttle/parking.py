"""The parking area: requests whose domain has no budget for a while wait here, out of the
downloader, whatever the scheduler.

A request waiting inside a downloader middleware holds one of the ``CONCURRENT_REQUESTS`` units,
so a slow domain's waiting requests would stall every other domain. The middleware hands such a
request back to the engine with a :class:`Ticket` in its meta (its moment, and whether its
tokens are reserved for it); the parking area, attached to the scheduler the engine runs
(scrapy-redis's, Scrapy's, or a subclass of either), takes it before the scheduler sees it, keeps
it aside and gives it back to the engine shortly before its moment, ahead of the scheduler's own
requests, with its ticket beside it (:meth:`ParkingArea.handed_out`), not in its meta. Only
requests that came out of the scheduler are parked: those the engine downloads directly
(robots.txt, media pipelines: ``engine.download_async()``) would never come back through it.

* With scrapy-redis's scheduler, parked requests wait in a sorted set in scrapy-redis's Redis,
  beside its queue (``<queue key>:parked``), scored by when they are due, shared by the fleet:
  whichever worker has room takes each (exactly one, atomically), and a parked request outlives
  the worker that parked it. They share the queue's fate at the close: kept with
  ``SCHEDULER_PERSIST``, dropped (and counted) without it; emptied by ``SCHEDULER_FLUSH_ON_START``.
* With any other scheduler, they wait in this process; at the close they go into the scheduler's
  own queue when it keeps it on disk (``JOBDIR``), and are dropped (and counted) otherwise.

A voiding of a domain's reserved moments (see :class:`.pauses.Pauses`) reaches the
requests parked with them at once (:meth:`ParkingArea.void`): they come back to ask again,
as held ones wake to, not at their old moments. Both stores index reserved moments by domain.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from .clock import sleep_or_wake
from .handoff import Handoff
from .leases import LEASE_META, Leases
from .metrics import OTHER
from .pauses import Pause
from .redis_parking import ParkUncertain
from .rejections import Once
from .request_codec import Unparkable
from .stats import STATS_PREFIX
from .tickets import TICKET_META, Ticket, Unused, unused_reservation

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector

    from .clock import Clock
    from .metrics import ThrottleMetrics
    from .parking_stores import ParkingStore
    from .replies import Reservation, Unreserved

    Unreserve = Callable[[str, list[Reservation]], Awaitable[Unreserved | None]]
    """Gives a domain's bucket back reservations (:meth:`.ResilientBucket.unreserve`):
    None when Redis could not be told."""

logger = logging.getLogger(__name__)

# Give parked requests back this long before they are due: the middleware holds them for the
# rest, so that they leave exactly on time however busy the engine is.
RELEASE_AHEAD = 0.5
# The least time between two looks for due requests: those due meanwhile are given back
# together, still at least RELEASE_AHEAD - LOOK_INTERVAL early (with one look per request due,
# the parking area cost ~1.6 Redis calls per request more at 35 requests/s: bench/binding.py).
LOOK_INTERVAL = 0.1
# How soon to look again when the engine could take no request.
BUSY_RETRY = 0.05


class ParkingArea:
    """Parked requests of one crawl, attached to its scheduler (see
    :func:`.engine_hooks.attach`): requests with a ticket to park go to *store*, those due
    come back to the engine ahead of the scheduler's own; the spider stays open while any are
    parked. At the close, what is parked is kept when *keep* (else dropped and counted)."""

    def __init__(
        self,
        crawler: Crawler,
        store: ParkingStore,
        keep: bool,
        concurrency: int,
        clock: Clock,
        unreserve: Unreserve | None = None,
        metrics: ThrottleMetrics | None = None,
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        self.store = store
        # With scrapy-redis's queue: what this worker takes from Redis is leased.
        self.leases: Leases | None = getattr(store, "leases", None)
        self._crawler = crawler
        self._keep = keep
        self.handoff = Handoff(crawler)
        self._parking_tasks: set[asyncio.Task[None]] = set()
        self._wake_up = asyncio.Event()
        self._stopping = False
        self._parks_done = 0
        self._once = Once()
        self._next_look = 0.0  # monotonic time of the release loop's next look, while it waits
        self._unpark_failing = False
        self._void_failing = False
        # Voidings not yet passed on to the store, by domain.
        self._voidings: dict[str, Pause] = {}
        self._concurrency = concurrency
        self._unreserve = unreserve
        self._releaser = asyncio.ensure_future(self._release_loop())

    def void(self, domain: str, pause: Pause) -> None:
        """The moments of *domain* that *pause* voids (see :meth:`.Pauses.pause`): the
        requests parked with one come back at once, in the order of their moments, to ask
        again, as held ones do, not at their old moments."""
        if (known := self._voidings.get(domain)) is not None:
            # Two voidings passed on as one that covers both (and errs on the polite side: a
            # moment reserved between them, after the first one's end, asks again too).
            pause = Pause.merged([known, pause])
        self._voidings[domain] = pause
        self._wake_up.set()

    def enqueue_request(self, request: Request) -> bool | None:
        """Take *request* if it comes from the throttle or the parking area (True); None: it
        is the scheduler's."""
        if self.handoff.take(request):  # given back by _release_loop, through engine.crawl()
            return True
        ticket = request.meta.get(TICKET_META)
        if not isinstance(ticket, Ticket):
            return None
        del request.meta[TICKET_META]
        # Its lease goes once it is parked (in Redis again), not when the engine is done.
        lease = request.meta.pop(LEASE_META, None)
        task = asyncio.ensure_future(self._park(request, ticket, lease))
        self._parking_tasks.add(task)
        task.add_done_callback(self._parking_tasks.discard)
        return True

    def has_pending_requests(self) -> bool:
        return (
            bool(self.handoff or self._parking_tasks or self.store.parked)
            or self._wake_up.is_set()  # a park that the parked count may not show yet
            or (self.leases is not None and not self.leases.looked)
        )

    async def _park(self, request: Request, ticket: Ticket, lease: object = None) -> None:
        try:
            await self._park_leased(request, ticket, lease)
        except Unparkable as error:
            self._crawler.stats.inc_value(f"{STATS_PREFIX}/unparkable")
            if self._once.first("unparkable"):
                logger.warning(
                    "Redis throttle: %s cannot be parked (%s); it waits in the downloader, "
                    "as will others that cannot (counted in %s/unparkable, logged once)",
                    request,
                    error,
                    STATS_PREFIX,
                )
            self.handoff.give_back(request, ticket, unparkable=True)
            return
        except Exception as error:
            # Not lost: the middleware holds it until its moment instead; or, when the park may
            # have happened, it asks anew (its moment may be another's, or given back).
            logger.exception(
                "Redis throttle: could not park %s; it waits in the downloader", request
            )
            if isinstance(error, ParkUncertain):
                ticket = replace(ticket, reserved=False, reservation=None)
            self.handoff.give_back(request, ticket, unparkable=True)
            return
        self._parks_done += 1
        self._crawler.stats.inc_value(f"{STATS_PREFIX}/parked")
        if ticket.due - RELEASE_AHEAD < self._next_look:
            # Due before the release loop looks again (a park done while it looks is seen by
            # _release_due itself): one more unpark call, only then.
            self._wake_up.set()

    async def _park_leased(self, request: Request, ticket: Ticket, lease: object) -> None:
        """Park *request*, whose *lease* (taken out of its meta, so that the engine's end of
        it does not acknowledge it) goes once it is parked; not parked, it keeps it."""
        try:
            await self.store.park(request, ticket)
        except BaseException:
            if lease is not None:
                request.meta[LEASE_META] = lease
            raise
        if self.leases is not None:
            self.leases.release(lease)

    async def _release_loop(self) -> None:
        # Stopped by a flag, not by cancelling: a cancellation can get lost.
        while not self._stopping:
            self._wake_up.clear()
            await self._release_voided()
            timeout = await self._release_due()
            self._next_look = self._clock.monotonic() + timeout
            await sleep_or_wake(self._clock, timeout, self._wake_up)

    async def _release_voided(self) -> None:
        # Those heard so far: the ones heard meanwhile wait for the next pass, after the due
        # requests are given back (a flood of voidings must not hold those up).
        voidings, self._voidings = self._voidings, {}
        for domain, pause in voidings.items():
            try:
                released = await self.store.release_voided(domain, pause)
            except (RedisError, OSError) as exc:
                # Once per failure: they ask again at their old moments meanwhile, still safe.
                if not self._void_failing:
                    self._void_failing = True
                    logger.warning(
                        "Redis throttle: could not bring back the parked requests whose "
                        "moments a pause or a change of rate voided (%s: %s); until this "
                        "works, they ask again at their old moments",
                        type(exc).__name__,
                        exc,
                    )
                continue
            except Exception:
                logger.exception("Redis throttle: could not bring back voided parked requests")
                continue
            self._void_failing = False
            if released:
                self._crawler.stats.inc_value(f"{STATS_PREFIX}/paused_reservations", released)
                logger.debug(
                    "Redis throttle: %d requests parked for %r come back to ask again: their "
                    "moments were voided",
                    released,
                    domain,
                )

    async def _release_due(self) -> float:
        """Give back what is due and there is room for; return how long to wait until next."""
        room = self.handoff.room(self._concurrency)
        if not room:
            return BUSY_RETRY
        parks_before = self._parks_done
        retry = self.store.poll_interval or 1.0
        try:
            due, next_due = await self.store.unpark(RELEASE_AHEAD, room)
        except (RedisError, OSError) as exc:
            # Once per failure, not at every look: the parked requests wait in Redis meanwhile.
            if not self._unpark_failing:
                self._unpark_failing = True
                logger.warning(
                    "Redis throttle: could not look for parked requests (%s: %s); trying again "
                    "every %g s",
                    type(exc).__name__,
                    exc,
                    retry,
                )
            return retry
        except Exception:
            logger.exception("Redis throttle: could not look for parked requests")
            return retry
        if self._unpark_failing:
            self._unpark_failing = False
            logger.info("Redis throttle: parked requests can be looked for again")
        if self._parks_done != parks_before:
            self._wake_up.set()  # a park crossed this look: look again, its count may be missing
        for request, ticket in due:
            if self._stopping:  # the engine is closing: park them again in stop()
                self.handoff.hold(request, ticket)
            else:
                self.handoff.give_back(request, ticket)
        if len(due) == room:
            return 0.0
        timeout = self.store.poll_interval or 1.0
        if next_due is not None:
            timeout = min(timeout, max(LOOK_INTERVAL, next_due - RELEASE_AHEAD))
        return timeout

    async def stop(self) -> None:
        """Stop giving requests back; keep or drop what is parked (before the scheduler
        closes: JOBDIR's queues must still be open to keep them)."""
        self._stopping = True
        self._wake_up.set()
        try:
            await self._releaser
        except Exception:
            logger.exception("Redis throttle: the parking area's release loop failed")
        if self._parking_tasks:
            await asyncio.gather(*self._parking_tasks, return_exceptions=True)
        lost: Counter[str] = Counter()
        unused: list[Unused] = []
        # Given back but not yet taken by the engine: park them again, due at once, to ask
        # anew (their moments are too close to wait parked for).
        for request, ticket in self.handoff.take_all():
            if (reservation := unused_reservation(ticket)) is not None:
                unused.append(reservation)
            now = self._clock.monotonic()
            again = replace(ticket, due=now, reserved=False, locally=False, reservation=None)
            try:
                await self._park_leased(request, again, request.meta.pop(LEASE_META, None))
            except Unparkable:  # (waiting in the downloader, it was counted and logged)
                lost[ticket.domain] += 1
            except Exception:
                logger.exception("Redis throttle: could not park %s again at the close", request)
                lost[ticket.domain] += 1
        try:
            parked, dropped, dropped_from = await self.store.close(self._keep)
        except Exception:
            logger.exception("Redis throttle: could not close the parking area")
            parked, dropped, dropped_from = 0, [], {}
        await unreserve_unused([*unused, *dropped], self._unreserve, self._crawler.stats)
        if self._keep and parked:
            logger.info("Redis throttle: %d parked requests are kept for the next run", parked)
        if not self._keep:
            lost.update(dropped_from)
            lost[OTHER] += parked - sum(dropped_from.values())  # those whose domain is unknown
        lost = +lost
        if self._metrics is not None:
            self._metrics.canceled(lost)
        not_crawled = lost.total()
        if not_crawled:
            self._crawler.stats.set_value(f"{STATS_PREFIX}/parked_not_crawled", not_crawled)
            logger.warning(
                "Redis throttle: %d parked requests were not crawled (they were waiting for "
                "their domains' budgets when the spider closed)",
                not_crawled,
            )


async def unreserve_unused(
    unused: list[Unused], unreserve: Unreserve | None, stats: StatsCollector
) -> None:
    """Give the buckets back the moments reserved for requests that will not go at them
    (*unreserve*, see :meth:`.TokenBucket.unreserve`): a fleet that starts again does not wait
    for them."""
    if not unused or unreserve is None:
        return
    by_domain: dict[str, list[Reservation]] = {}
    for domain, reservation in unused:
        by_domain.setdefault(domain, []).append(reservation)
    taken = set_aside = 0
    for domain, reservations in by_domain.items():
        try:
            done = await unreserve(domain, reservations)
        except Exception:  # (a bug: the other domains' and the close's work must go on)
            logger.exception("Redis throttle: could not give back moments of %r", domain)
            continue
        if done is not None:
            taken, set_aside = taken + done.taken, set_aside + done.set_aside
    if taken:
        stats.inc_value(f"{STATS_PREFIX}/unreserved", taken)
    if set_aside:
        stats.inc_value(f"{STATS_PREFIX}/unreserved_set_aside", set_aside)
    logger.info(
        "Redis throttle: of %(unused)d moments reserved for requests that will not go at "
        "them, %(taken)d were given back to their buckets and %(set_aside)d set aside "
        "until the moments after them are given back too",
        {"unused": len(unused), "taken": taken, "set_aside": set_aside},
    )
