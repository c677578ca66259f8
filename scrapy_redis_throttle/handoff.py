"""Requests between the parking area and the engine: a request whose turn comes is given back
through the engine's public ``crawl()``, taken out of the way to the scheduler, and handed to
the engine ahead of the scheduler's own requests, with its ticket kept beside it for the
middleware (:meth:`Handoff.handed_out`), not in its meta."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary, WeakSet

from .stats import STATS_PREFIX
from .tickets import OTHERS_META

# Requests given back at one look, at most.
RELEASE_BATCH = 32

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request
    from scrapy.crawler import Crawler

    from .parking_stores import Parked
    from .tickets import Ticket

logger = logging.getLogger(__name__)


class Handoff:
    """What the engine is given back by the parking area of *crawler*'s crawl."""

    def __init__(self, crawler: Crawler) -> None:
        self._crawler = crawler
        # Given back and through the scheduler's enqueue_request, not yet taken by the engine.
        self._ready: deque[Parked] = deque()
        # Requests given back through engine.crawl(), until they reach enqueue_request...
        self._giving_back: WeakKeyDictionary[Request, Ticket] = WeakKeyDictionary()
        # ...and those the engine took, until the middleware sees them (see handed_out).
        self._handed: WeakKeyDictionary[Request, Ticket | None] = WeakKeyDictionary()
        # Given back because their parking failed: not parked again (it would fail again).
        self._unparkable: WeakSet[Request] = WeakSet()

    def __len__(self) -> int:
        """Requests given back that the engine has not taken yet."""
        return len(self._ready)

    def give_back(self, request: Request, ticket: Ticket, unparkable: bool = False) -> None:
        """Give *request* back to the engine with its *ticket* (*unparkable*: its parking
        failed, and it may not be parked again)."""
        if unparkable:
            self._unparkable.add(request)
        # engine.crawl() queues it (see take()) and wakes the engine up.
        self._giving_back[request] = ticket
        try:
            self._crawler.engine.crawl(request)
        except Exception:
            logger.exception("Redis throttle: could not give back %s", request)
            # Not lost: the engine takes it from there when it next asks for a request.
            self._giving_back.pop(request, None)
            self._ready.append((request, ticket))
            return
        if self._giving_back.pop(request, None) is not None:
            # A request_scheduled handler dropped it (IgnoreRequest) before the scheduler saw it.
            self._crawler.stats.inc_value(f"{STATS_PREFIX}/parked_dropped")
            logger.warning(
                "Redis throttle: %s, back from the parking area, was dropped by a "
                "request_scheduled handler",
                request,
            )

    def busy(self) -> bool:
        """Whether requests are in the downloader (downloading, or waiting in the throttle)."""
        engine = self._crawler.engine
        return bool(engine and engine.downloader.active)

    def room(self, concurrency: int) -> int:
        """How many more requests the engine could start now, with *concurrency* units: take no
        more than that out of the parking area, or they would miss their moment here while
        another worker has room."""
        engine = self._crawler.engine
        try:
            if engine.needs_backout():
                return 0
        except (AssertionError, AttributeError):  # the engine is still opening the spider
            return 0
        free = concurrency - len(engine.downloader.active) - len(self._ready)
        return min(max(free, 0), RELEASE_BATCH)

    def hold(self, request: Request, ticket: Ticket) -> None:
        """Keep *request* to hand out, without going through the engine (at a close)."""
        self._ready.append((request, ticket))

    def take(self, request: Request) -> bool:
        """Whether *request*, on its way to the scheduler, is one given back (now kept to be
        handed out first)."""
        ticket = self._giving_back.pop(request, None)
        if ticket is None:
            return False
        self._ready.append((request, ticket))
        return True

    def next_request(self, scheduler_next: Callable[[], Request | None]) -> Request | None:
        """A request given back, else the scheduler's next (*scheduler_next*), marked as
        handed out (see :meth:`handed_out`)."""
        if self._ready:
            request, ticket = self._ready.popleft()
            self._handed[request] = ticket
            return request
        scheduled = scheduler_next()
        if scheduled is not None:
            self._handed[scheduled] = None
        return scheduled

    def handed_out(self, request: Request) -> tuple[bool, Ticket | None]:
        """Whether the engine took *request* from the scheduler or the parking area (only
        such a request may be parked), and its ticket if it is back from the parking area.
        Asked once per request, by the middleware."""
        if request not in self._handed:
            return False, None
        ticket = self._handed.pop(request)
        if request in self._unparkable:
            self._unparkable.discard(request)
            return False, ticket
        return True, ticket

    def lend(self, domain: str) -> Ticket | None:
        """The moment reserved for *domain* soonest by a request handed out with it that the
        middleware has not seen yet, for a robots.txt request of that domain to go at: such a
        request waits for its worker's robots.txt (RobotsTxtMiddleware) before the throttle,
        and would miss its moment while the robots.txt waits for one of its own. It asks for a
        new moment when it comes. None: there is none (a request whose moment is reserved in
        other budgets too keeps it)."""
        lent: tuple[Request, Ticket] | None = None
        for request, ticket in self._handed.items():
            if (
                ticket is not None
                and ticket.reserved
                and ticket.domain == domain
                and OTHERS_META not in request.meta
                and (lent is None or ticket.due < lent[1].due)
            ):
                lent = request, ticket
        if lent is None:
            return None
        request, ticket = lent
        self._handed[request] = replace(ticket, reserved=False)
        return ticket

    def take_all(self) -> list[Parked]:
        """The requests given back that the engine has not taken, no longer to hand out."""
        ready = list(self._ready)
        self._ready.clear()
        return ready
