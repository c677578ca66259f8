"""What the throttle and the parking area tell each other of a request: its :class:`Ticket`
(its moment, and whether its tokens are reserved for it), and the ticket's wire format, which
travels through scrapy-redis's Redis with a parked request and is read back as hostile input."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .redis_schema import MAX_MOMENT_US
from .replies import Reservation

if TYPE_CHECKING:
    from .server_clock import ServerClock

TICKET_META = "_redis_throttle_ticket"
# The other budgets (see .scopes) a parked request's moment was reserved in.
OTHERS_META = "_redis_throttle_others"
# A parked request's exact moment (Ticket.moment_us) is not after the due the parking area tells
# by more than this (the two clocks' bounds): a moment further after it is not one Redis gave,
# as this process reads it (a clock stepped), and the due counts. A due later than the moment
# is a park that waited (park.lua counts at most WAITED_AT_MOST, 0.1 s, of the wait of a park
# call queued behind its connection's batch): the moment counts, so that the request does not
# go squeezed against the next moment's.
MOMENT_AGREES = 0.25
# Names this process in the tickets it parks in Redis: its wall clock is theirs.
_PROCESS = uuid.uuid4().hex


@dataclass(frozen=True, kw_only=True)
class Ticket:
    """What the throttle and the parking area tell each other of a request: from the throttle,
    in its meta (:data:`TICKET_META`), "park it until *due*"; from the parking area, beside it
    (:meth:`ParkingArea.handed_out`), "back from the parking area, due at *due*"."""

    domain: str
    """The domain whose budget it waits for (a voiding of its moments reaches it)."""
    due: float
    """Monotonic time (the clock's) of the request's moment."""
    reserved: bool
    """Its tokens are reserved for that moment (else it asks again then)..."""
    locally: bool
    """...in this process's own buckets (Redis was failing), not in Redis."""
    reserved_at: float
    """Wall time when its tokens were asked for: a pause heard of after
    it voids the reservation (see :class:`.pauses.Pauses`)."""
    waiting_since: float
    """Wall time when the throttle first saw the request: its wait counts from then
    (``redis_throttle/wait_time_*``), parked or not."""
    elsewhere: bool = False
    """Reserved in another process (parked in Redis by it): its wall clock counts."""
    moment_us: float | None = None
    """Its reserved moment by the throttle's Redis's clock (see
    :attr:`.AcquireResult.moment_us`; None: not reserved there). Exact where *due*, back
    from scrapy-redis's Redis, is only as exact as this process knows that Redis's clock
    (from a few replies, which a busy process reads late)."""

    reservation: Reservation | None = None
    """Reserved in Redis: what its bucket takes back when the request is dropped or asks anew
    instead (see :meth:`.TokenBucket.unreserve`)."""

    def moment(self, clock: ServerClock) -> float:
        """The monotonic time of its reserved moment: by *clock* (the throttle's Redis's) when it
        knows it, else the due the parking area told."""
        exact = None if self.moment_us is None else clock.loop_time(self.moment_us)
        # A due later than the moment is a park that waited (see MOMENT_AGREES): the moment
        # counts, and a request given back too late for it misses it (it asks anew).
        if exact is None or exact - self.due > MOMENT_AGREES:
            return self.due
        return exact

    def to_wire(self) -> list[Any]:
        """What travels through Redis with the request (in its meta, as JSON; the parking
        store seals it, see :mod:`.seals`)."""
        return [
            self.reserved,
            self.reserved_at,
            _PROCESS,
            self.locally,
            self.waiting_since,
            self.moment_us,
            None if self.reservation is None else list(self.reservation),
        ]

    @classmethod
    def from_wire(
        cls, value: object, domain: str, due: float, now: float, sealed: bool = False
    ) -> Ticket:
        """The ticket of a request of *domain* read back from Redis at *now* (wall time), due at
        *due*; reserved only if *sealed* (its seal is the fleet's); anything unexpected counts
        as no reservation (the request asks again, its wait counted from *now*)."""
        if (
            isinstance(value, list)
            # (6: parked by an earlier version, unsealed; 8: sealed, see RedisParking.park)
            and len(value) in (6, 8)
            and isinstance(value[0], bool)
            and isinstance(value[3], bool)
            and all(_is_time(value[n]) for n in (1, 4))
            and (value[5] is None or _is_time(value[5]))
        ):
            reserved, reserved_at, process, locally, waiting_since, moment_us = value[:6]
            elsewhere = process != _PROCESS
            # Moments reserved in another process's own buckets hold nothing here.
            reserved = reserved and sealed and not (locally and elsewhere)
            return cls(
                domain=domain,
                due=due,
                reserved=reserved,
                locally=locally,
                reserved_at=float(reserved_at),
                waiting_since=float(waiting_since),
                elsewhere=elsewhere,
                moment_us=None if moment_us is None else float(moment_us),
                reservation=_reservation(value[6]) if reserved and len(value) == 8 else None,
            )
        return cls(
            domain=domain,
            due=due,
            reserved=False,
            locally=False,
            reserved_at=now,
            waiting_since=now,
            elsewhere=True,
        )


def unused_reservation(ticket: Ticket) -> Unused | None:
    """The reservation of a request that will not go at its moment, to give back (None: it
    holds none in Redis)."""
    if ticket.reserved and ticket.reservation is not None:
        return ticket.domain, ticket.reservation
    return None


def _reservation(value: object) -> Reservation | None:
    """A reservation read back from Redis: three whole numbers that ``lua/unreserve.lua``
    takes (else it would refuse the close's call for the whole domain), else none."""
    if (
        isinstance(value, list)
        and len(value) == 3
        and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
        and 0 < value[1] <= value[0] < MAX_MOMENT_US
        and 0 <= value[2] < MAX_MOMENT_US
    ):
        return Reservation(value[0], value[1], value[2])
    return None


def sealed_message(member_id: bytes, domain: str, wire: list[Any]) -> bytes:
    """What a parked request's seal covers: its member's id (a copy under another id is no
    request this fleet parked), its domain and its ticket."""
    return b"\n".join(
        (member_id, domain.encode("utf-8", "surrogatepass"), json.dumps(wire).encode())
    )


def _is_time(value: object) -> bool:
    """A time as a float holds it (read back from Redis: anything may be there, such as an
    integer too large for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


Unused = tuple[str, Reservation]
"""A reservation a request will not use, with its domain."""
