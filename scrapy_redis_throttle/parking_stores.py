"""Where parked requests wait (see :mod:`.parking`): what every store does
(:class:`ParkingStore`), and the store in this process (:class:`MemoryParking`), for any
scheduler but scrapy-redis's (whose is :class:`.RedisParking`)."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .tickets import Ticket, Unused, unused_reservation

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request

    from .clock import Clock
    from .pauses import Pause


class Closed(NamedTuple):
    """What a parking store held at its close."""

    parked: int
    """Requests parked."""
    dropped: list[Unused]
    """The reservations of those dropped: to give back."""
    dropped_from: dict[str, int]
    """The requests dropped, by domain (where the store could read it)."""


Parked = tuple["Request", Ticket]
"""A request taken out of the parking area, with its ticket."""
_Entry = tuple[float, int, "Request", Ticket]
"""A request parked in this process: due (monotonic time), order of parking, request, ticket."""


class ParkingStore(Protocol):
    @property
    def poll_interval(self) -> float | None:
        """How often to look for requests that other processes parked (``None``: never)."""

    @property
    def parked(self) -> int:
        """Requests parked, as last seen."""

    async def park(self, request: Request, ticket: Ticket) -> None: ...

    async def unpark(self, ahead: float, limit: int) -> tuple[list[Parked], float | None]:
        """Take out up to *limit* requests due within *ahead* seconds; return them, each with
        its ticket, and the seconds until the next one left is due."""
        ...

    async def release_voided(self, domain: str, pause: Pause) -> int:
        """Make the requests of *domain* parked with a moment that *pause* voids due now, in
        the order of their moments, to ask again (see :meth:`.Pauses.pause`); return how
        many."""
        ...

    async def close(self, keep: bool) -> Closed:
        """Close the store; unless *keep*, drop what is parked."""
        ...


class MemoryParking:
    """Parked requests in this process, in a heap by due time. Those kept at the close go to
    *keep_into* (the scheduler's own queues, which JOBDIR saves)."""

    poll_interval: float | None = None

    def __init__(self, keep_into: Callable[[Request], object] | None, clock: Clock) -> None:
        self._clock = clock
        self._heap: list[_Entry] = []
        self._order = itertools.count()
        # The entries whose moments are reserved, by domain: what a voiding may reach.
        self._reserved: dict[str, dict[int, _Entry]] = {}
        self._keep_into = keep_into

    @property
    def parked(self) -> int:
        return len(self._heap)

    async def park(self, request: Request, ticket: Ticket) -> None:
        entry = (ticket.due, next(self._order), request, ticket)
        heapq.heappush(self._heap, entry)
        if ticket.reserved:
            self._reserved.setdefault(ticket.domain, {})[entry[1]] = entry

    async def unpark(self, ahead: float, limit: int) -> tuple[list[Parked], float | None]:
        now = self._clock.monotonic()
        due: list[Parked] = []
        while self._heap and len(due) < limit and self._heap[0][0] <= now + ahead:
            _, order, request, ticket = heapq.heappop(self._heap)
            self._unindex(ticket.domain, order)
            due.append((request, ticket))
        return due, (self._heap[0][0] - now if self._heap else None)

    async def release_voided(self, domain: str, pause: Pause) -> int:
        void = {
            order
            for order, (due, _, _, ticket) in self._reserved.get(domain, {}).items()
            if pause.voids(
                ticket.reserved_at,
                due,
                ticket.elsewhere,
                None if ticket.reservation is None else ticket.reservation.at,
            )
        }
        if not void:
            return 0
        now = self._clock.monotonic()
        # Due now or before, in the order of their moments: each as early as the pause is long.
        early = pause.until - now
        kept = []
        for entry in self._heap:
            due, order, request, ticket = entry
            if order in void:
                self._unindex(domain, order)
                entry = (due - early, order, request, replace(ticket, due=now, reserved=False))
            kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept
        return len(void)

    def _unindex(self, domain: str, order: int) -> None:
        reserved = self._reserved.get(domain)
        if reserved is not None and reserved.pop(order, None) is not None and not reserved:
            del self._reserved[domain]

    async def close(self, keep: bool) -> Closed:
        entries = sorted(self._heap)
        self._heap.clear()
        self._reserved.clear()
        if keep and self._keep_into is not None:
            for _, _, request, _ in entries:
                self._keep_into(request)
            return Closed(len(entries), [], {})
        dropped = [
            unused for *_, ticket in entries if (unused := unused_reservation(ticket)) is not None
        ]
        return Closed(len(entries), dropped, dict(Counter(ticket.domain for *_, ticket in entries)))
