"""What the scripts answer, as typed values: a request's acquire, a reservation and what giving
it back did, a voiding of reserved moments, a pause and a decrease of the adaptive rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .live_limits import LiveLimit


class Reservation(NamedTuple):
    """A moment reserved in a domain's bucket, as ``lua/unreserve.lua`` gives it back: the
    bucket's time right *after* it (µs since the scripts' epoch), the *step* it added, and when
    Redis reserved it (*at*, µs since the epoch)."""

    after: int
    step: int
    at: int


class Unreserved(NamedTuple):
    """What :meth:`TokenBucket.unreserve` did with the reservations given back."""

    taken: int
    """Taken out of the bucket (with those set aside before that they freed)."""
    set_aside: int
    """Set aside until the reservations after them are given back too."""


@dataclass(frozen=True, kw_only=True)
class AcquireResult:
    """A bucket's answer to a request's acquire (Redis's, or this worker's own buckets')."""

    allowed: bool
    """The request may go now."""
    reserved: bool
    """The request's tokens are taken for later: it must go in ``retry_after`` seconds."""
    tokens_left: float
    """At the configured rate (the adaptive rate may be lower)."""
    retry_after: float
    """Seconds until this request may go (0 when allowed)."""
    reset_after: float
    """Seconds until the bucket is full again."""
    paused: bool = False
    """The domain is paused live (``scrapy-redis-throttle pause``): the request asks again in
    ``retry_after`` seconds."""
    decided_at: float | None = None
    """When Redis decided (loop time, see :class:`.ServerClock`): ``retry_after`` and
    ``reset_after`` count from then. None: decided in this process, as it was returned."""
    moment_us: float | None = None
    """When the request may go by Redis's clock (µs since the scripts' epoch): the moment
    Redis gave it, exact in any process that knows Redis's clock. None: not given by Redis."""
    reservation: Reservation | None = None
    """Reserved in Redis: what to give back if the request does not go (see
    :meth:`TokenBucket.unreserve`)."""
    live_invalid: bool = False
    """The domain's limit set live has a field that is no limit: the workers' own applies for
    it."""
    live: LiveLimit | None = None
    """The domain's limit set live, as Redis told it with this answer (:data:`.NOTHING_LIVE`:
    none). None: not told (decided in this process, or in another scope's bucket)."""

    def decided(self, now: float) -> float:
        """When it was decided, by the loop's clock at *now*."""
        return now if self.decided_at is None else self.decided_at


@dataclass(frozen=True)
class Voiding:
    """The last voiding of a domain's reserved moments, as Redis keeps it for the workers that
    missed its message (see ``lua/voided.lua``)."""

    age: float
    """Seconds since it happened: moments reserved before are void..."""
    left: float
    """...if they come within this many seconds from now."""
    at_us: float | None = None
    """When it happened, by Redis's clock (µs since the scripts' epoch, as
    :attr:`Reservation.at`): the moments reserved there before it are void (None: not told)."""


@dataclass(frozen=True)
class Penalty:
    changed: bool
    """This call started or extended the pause (else one as long was under way)."""
    pause: float
    """Seconds until the pause ends."""
    strikes: int
    """Penalties in a row (each one after the previous pause ended)."""
    at_us: float
    """When Redis decided (as :attr:`Voiding.at_us`): the moments reserved before it within
    the pause are void."""


@dataclass(frozen=True)
class SlowDown:
    lowered: bool
    """This call lowered the rate (else the failed request was sent before the last decrease,
    or the rate cannot go lower)."""
    rate: float
    """The domain's rate now, requests per second."""
    back_in: float
    """When lowered: seconds until the rate is back at the configured one, if no failure
    comes."""
    void: float
    """When lowered: seconds the moments reserved before lasted; the requests holding them
    must ask again (the decrease is published like a pause this long)."""
    at_us: float
    """When Redis decided (as :attr:`Voiding.at_us`): the moments reserved before it are the
    voided ones."""
