"""Pauses of a domain after 429/503 responses, for the whole fleet.

The worker that gets such a response runs ``lua/penalty.lua``: the domain's bucket in Redis is
pushed past the pause (``Retry-After``, or an exponential backoff), so that no acquire succeeds
before it ends, and the pause is published. Every worker listens (:class:`Pauses`): a request
that reserved a moment within the pause, before it was known, wakes and asks Redis again instead
of going. Decreases of the adaptive rate and limits changed live are published the same way, for
the moments reserved before them, marked as no pause: their requests may ask again at once.

Redis delivers a message only to the workers subscribed when it is published: a worker that was
starting, or whose subscription was down, misses it. The scripts therefore also keep the last
voiding of each domain in Redis (``lua/voided.lua``), and a request whose moment was reserved
before this worker's subscription was up reads it before it goes (:meth:`Pauses.knows_voidings`),
once per domain and subscription: from then on, the channel tells the rest.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from itertools import islice
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .clock import sleep_or_wake
from .connection import pubsub
from .rejections import Once
from .stats import STATS_PREFIX
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy.statscollectors import StatsCollector

    from .clock import Clock
    from .connection import ThrottleRedis
    from .local_buckets import LocalBuckets
    from .replies import Voiding

logger = logging.getLogger(__name__)

# How long the listener waits for a message at a time (below the socket timeout), and before it
# subscribes again after losing its connection.
LISTEN_TIMEOUT = 0.5
RESUBSCRIBE_DELAY = 1.0
# After an unexpected error the listener starts again after RESUBSCRIBE_DELAY, doubled at each
# error in a row up to this (seconds): it never dies, nor spins.
MAX_RESUBSCRIBE_DELAY = 30.0
# Wall clocks of the fleet's machines may differ by this much: a moment reserved in another
# process this soon after this worker subscribed may have been voided before it did.
CLOCK_MARGIN = 1.0
# How long the start waits for the first subscription, so that the first requests need not
# read the pauses they might have missed from Redis.
FIRST_SUBSCRIPTION_WAIT = 1.0
# A pause in a message is at most this many digits of µs (~30 years): a longer one is not ours.
MAX_PAUSE_DIGITS = 15
# A Retry-After of more seconds (31 years) counts as this many: REDIS_THROTTLE_MAX_PAUSE caps
# every pause far below anyway.
MAX_RETRY_AFTER_DIGITS = 9
MAX_RETRY_AFTER = 1e9
# Each new pause looks at this many of the domains paused longest ago and forgets those whose
# pauses ended: the memory of a worker that meets 100,000 paused domains stays that of the
# pauses under way, at a bounded cost per pause.
SWEEP_STEP = 4
# A domain's pauses under way, at the most: more are merged into one that voids all they void
# (and more: the polite side), so that a channel flooded with pauses costs no more to check.
PAUSES_PER_DOMAIN = 8
# Domains whose voiding was read from Redis, at the most (see Pauses.read).
READS_KEPT = 10_000
# A pause heard and ending within this much of one already known is that one (read again from
# Redis, by another request): it is not kept twice.
SAME_PAUSE = 0.05


def _cancelling() -> bool:
    """Whether the running task is asked to cancel (Python 3.11+ tells; 3.10 does not)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling and cancelling())


def parse_retry_after(value: bytes | None, date: bytes | None, now: float) -> float | None:
    """Seconds from a ``Retry-After`` header: delta-seconds, or an HTTP-date taken relative to
    the response's ``Date`` (so that the site's clock, not ours, counts), else to *now* (wall
    time). None when missing; 0 for a moment already past; at most MAX_RETRY_AFTER.
    ValueError, saying why, for anything else."""
    if not value:
        return None
    text = value.decode("latin-1").strip()
    # ASCII digits only: "²" is a digit to str.isdigit(), and float() refuses it.
    if text.isascii() and text.isdigit():
        digits = text.lstrip("0") or "0"
        # 310 digits would be an infinite float: so many are capped before they are one.
        return float(digits) if len(digits) <= MAX_RETRY_AFTER_DIGITS else MAX_RETRY_AFTER
    retry_at = _http_date(text)
    if retry_at is None:
        raise ValueError(f"Retry-After {text[:100]!r}: neither seconds nor an HTTP-date")
    # Without a Date header it can read, our clock stands in for the site's.
    sent_at = _http_date(date.decode("latin-1")) if date else None
    seconds = (retry_at - (sent_at or datetime.fromtimestamp(now, timezone.utc))).total_seconds()
    return min(MAX_RETRY_AFTER, max(0.0, seconds))


def _http_date(text: str) -> datetime | None:
    try:
        moment = parsedate_to_datetime(text)
    except (TypeError, ValueError, OverflowError):
        return None
    # HTTP-dates are in GMT; "-0000" parses as a naive time.
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


class Message(NamedTuple):
    """A voiding of a domain's moments, as a script published it."""

    domain: str
    void_us: int
    """How long the voided moments last (a pause: until it ends)."""
    at_us: int
    """Redis's time when it happened."""
    holds: bool
    """A pause (``lua/penalty.lua``): no request goes before it ends. Else a change of rate
    (``lua/set_limit.lua``, ``lua/slow_down.lua``), after which requests may go at once."""


def parse_message(data: bytes) -> Message | None:
    """A voiding as the scripts publish it: ``<µs> <Redis's time µs> <domain>`` for a pause,
    the first number after a ``v`` for a change of rate; None for anything else (anyone who
    may publish on the channel can send anything: a bad message voids nothing)."""
    void_us, _, rest = data.decode("utf-8", "surrogateescape").partition(" ")
    at_us, _, domain = rest.partition(" ")
    holds = not void_us.startswith("v")
    void_us = void_us if holds else void_us[1:]
    if domain and all(
        number.isascii() and number.isdigit() and len(number) <= MAX_PAUSE_DIGITS
        for number in (void_us, at_us)
    ):
        return Message(domain, int(void_us), int(at_us), holds)
    return None


@dataclass(frozen=True)
class Pause:
    """A voiding of a domain's reserved moments, as a worker knows it."""

    heard: float
    """Wall time it happened (as far as this worker can tell): moments reserved before..."""
    until: float
    """...for a moment up to this loop time, are void."""
    at_us: float | None = None
    """When it happened by Redis's clock (µs since the scripts' epoch), when Redis told it:
    a moment whose reservation there tells its time is void if reserved before it, exactly.
    (A limit set live, or a decrease of the adaptive rate, starts the bucket again at once: the
    moments it gives next fall within the voided ones, and a wall clock allowing for other
    machines took those reserved in the next second as void too.)"""
    holds: bool = True
    """A pause: no request goes before it ends (else a change of rate: only the moments
    reserved before are void)."""

    def voids(
        self, reserved_at: float, moment: float, elsewhere: bool, reserved_us: float | None
    ) -> bool:
        """Whether it voids a *moment* reserved at *reserved_at* (wall time; *elsewhere*: by
        another process, whose wall clock may differ by up to CLOCK_MARGIN; *reserved_us*: by
        Redis's clock)."""
        if moment > self.until:
            return False
        if self.at_us is not None and reserved_us is not None:
            return reserved_us < self.at_us
        return self.heard + (CLOCK_MARGIN if elsewhere else 0.0) > reserved_at

    def covers(self, other: Pause, slack: float = 0.0) -> bool:
        """Whether it voids whatever *other* voids (within *slack* seconds: SAME_PAUSE for one
        read again)."""
        return (
            self.heard >= other.heard - slack
            and self.until >= other.until - slack
            and (other.at_us is None or (self.at_us is not None and self.at_us >= other.at_us))
            and (self.holds or not other.holds)
        )

    @classmethod
    def merged(cls, pauses: list[Pause]) -> Pause:
        """One pause that voids all *pauses* void (and more: the polite side)."""
        at = [each.at_us for each in pauses]
        return cls(
            max(each.heard for each in pauses),
            max(each.until for each in pauses),
            None if None in at else max(each for each in at if each is not None),
            any(each.holds for each in pauses),
        )


class ParkedRequests(Protocol):
    """Where the requests parked with reserved moments are (:class:`.ParkingArea`)."""

    def void(self, domain: str, pause: Pause) -> None: ...


class StateReader(Protocol):
    """What reads whether Redis lost the throttle's state (:class:`.ResilientBucket`)."""

    async def read_state(self) -> None: ...


class Pauses:
    """The pauses this worker knows of: its own, and those other workers published. Each one
    makes *local* forget what this worker saw of the domain's bucket (Redis changed it), and
    voids the moments of the requests parked in :attr:`parking`; *state* is read at each
    subscription."""

    def __init__(
        self,
        redis: ThrottleRedis,
        channel: str,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
        local: LocalBuckets,
        *,
        longest: float,
        clock: Clock,
        state: StateReader | None = None,
    ) -> None:
        self._redis = redis
        self._state = state
        self._clock = clock
        self._longest = longest
        self._local = local
        self.parking: ParkedRequests | None = None
        """The parking area, once it is attached at the spider's open (None: none)."""
        self._channel = channel
        self._stats = stats
        self._log_extra = log_extra
        # domain -> the pauses under way: a reservation made before one of them, for a moment
        # within it, is void.
        self._pauses: dict[str, list[Pause]] = {}
        # domain -> the sleeps of requests whose moment is reserved, and the monotonic time
        # each one ends at; those a pause cancelled, to wake them early.
        self._sleepers: dict[str, dict[asyncio.Future[None], float]] = {}
        self._woken: set[asyncio.Future[None]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._failing = False
        # Wall time since when this worker hears every message (None: it does not now).
        self._listening_since: float | None = None
        # Wall time of the last read of each domain's voiding from Redis, while listening.
        self._read_at: dict[str, float] = {}
        self._subscribed = asyncio.Event()
        # Kinds of counted trouble already logged once (see _count_once).
        self._once = Once()

    async def start(self) -> None:
        """Listen, and wait a little for the subscription to be in force."""
        self._subscribed = asyncio.Event()
        self._listener = asyncio.ensure_future(self._listen())
        await sleep_or_wake(self._clock, FIRST_SUBSCRIPTION_WAIT, self._subscribed)

    async def stop(self) -> None:
        if self._listener is not None:
            await cancel_and_wait(self._listener, "the pauses' listener")

    def pause(
        self,
        domain: str,
        seconds: float,
        age: float = 0.0,
        at_us: float | None = None,
        holds: bool = True,
    ) -> None:
        """Moments of *domain* within the next *seconds* that were reserved before now (or
        *age* seconds ago; *at_us*: by Redis's clock, when Redis tells it) are void (a pause
        that *holds* the domain that long, or else moments chosen under a rate that changed):
        the requests that hold them wake at once (see :meth:`sleep`), those parked with them
        come back at once, and all must ask again. At most *longest* seconds: what another
        worker publishes, or Redis holds, is not trusted further."""
        seconds = min(seconds, self._longest)
        new = Pause(self._clock.wall() - age, self._clock.monotonic() + seconds, at_us, holds)
        pauses = self._under_way(domain)
        if any(each.covers(new, SAME_PAUSE) for each in pauses):
            return
        # One that voids nothing this one does not is dropped (exactly: no slack).
        pauses = [each for each in pauses if not new.covers(each)]
        pauses.append(new)
        if len(pauses) > PAUSES_PER_DOMAIN:
            pauses = [Pause.merged(pauses)]
        self._pauses[domain] = pauses
        for each in list(islice(self._pauses, SWEEP_STEP)):
            self._under_way(each)  # forgotten if ended, else to the back of the line
        self._local.forget(domain)
        for sleep, wake_at in self._sleepers.get(domain, {}).items():
            if wake_at <= new.until and not sleep.done():
                self._woken.add(sleep)
                sleep.cancel()
        if self.parking is not None:
            self.parking.void(domain, new)

    @property
    def listening(self) -> bool:
        """Whether this worker hears every pause published now: its subscription is in force,
        and the fleet's secret was read when it began (a restart of Redis ends it)."""
        return self._listening_since is not None

    def knows_voidings(self, domain: str, reserved_at: float, elsewhere: bool) -> bool:
        """Whether this worker knows every voiding of *domain*'s moments since *reserved_at*
        (wall time; *elsewhere*: in another process, whose clock may
        differ by up to :data:`CLOCK_MARGIN`): it heard every one published since, or it read
        the last one from Redis (:meth:`read`) while listening, and heard those after. Else a
        request that reserved its moment then must read it before it goes."""
        since = self._listening_since
        if since is None:
            return False
        if reserved_at >= since + (CLOCK_MARGIN if elsewhere else 0):
            return True
        read_at = self._read_at.get(domain)
        return read_at is not None and read_at >= since

    def read(self, domain: str, voiding: Voiding | None, read_at: float) -> None:
        """The last voiding of *domain* read from Redis (:meth:`.TokenBucket.last_voiding`),
        asked for at *read_at* (wall time): moments it voids are void (see :meth:`pause`)."""
        if voiding is not None:
            # Redis keeps pauses and changes of rate alike: taken as a pause, the polite side
            # for a worker that paces alone.
            self.pause(domain, voiding.left, age=voiding.age, at_us=voiding.at_us)
        since = self._listening_since
        if since is not None and read_at >= since:
            if len(self._read_at) >= READS_KEPT:
                self._read_at.clear()  # bounded: a domain forgotten is only read once more
            self._read_at[domain] = read_at

    def is_void(
        self,
        domain: str,
        reserved_at: float,
        moment: float,
        elsewhere: bool = False,
        reserved_us: float | None = None,
    ) -> bool:
        """Whether a moment (monotonic time) reserved for *domain* at *reserved_at* (wall
        time; *elsewhere*: in another process, a parked request, whose clock may differ from
        this one's by up to :data:`CLOCK_MARGIN`; *reserved_us*: by Redis's clock, when it was
        reserved there) is void."""
        return any(
            each.voids(reserved_at, moment, elsewhere, reserved_us)
            for each in self._under_way(domain)
        )

    def paused_for(self, domain: str) -> float:
        """Seconds until *domain*'s pauses end (0: none), for a worker that paces alone."""
        ends = [each.until for each in self._under_way(domain) if each.holds]
        return max(ends) - self._clock.monotonic() if ends else 0.0

    def _under_way(self, domain: str) -> list[Pause]:
        """*domain*'s pauses that have not ended (the others are forgotten)."""
        now = self._clock.monotonic()
        pauses = [pause for pause in self._pauses.pop(domain, ()) if pause.until > now]
        if pauses:
            self._pauses[domain] = pauses
        return pauses

    async def sleep(self, domain: str, seconds: float) -> None:
        """Wait *seconds* (the clock's sleep) for a moment reserved for *domain*; a pause of
        *domain* that covers the moment ends the wait early."""
        sleep = self._clock.sleep(seconds)
        sleepers = self._sleepers.setdefault(domain, {})
        sleepers[sleep] = self._clock.monotonic() + seconds
        try:
            await sleep
        except asyncio.CancelledError:
            if sleep not in self._woken or _cancelling():
                raise  # the waiting request itself is cancelled
        finally:
            self._woken.discard(sleep)
            del sleepers[sleep]
            if not sleepers:
                del self._sleepers[domain]

    async def _listen(self) -> None:
        delay = RESUBSCRIBE_DELAY
        while True:
            subscribed_at = None
            try:
                async with pubsub(self._redis) as subscriber:
                    await subscriber.subscribe(self._channel)
                    while True:
                        message = await subscriber.get_message(timeout=LISTEN_TIMEOUT)
                        if message is None:
                            continue
                        if message["type"] == "subscribe":
                            # Every message published from now on reaches this worker: Redis
                            # confirms a subscription once it is in force.
                            subscribed_at = self._clock.wall()
                            if self._state is not None:
                                # Whether Redis lost the throttle's state since the last
                                # subscription (a restart dropped it): if so, the moments
                                # reserved before are lost, and nothing here says it.
                                await self._state.read_state()
                            self._listening_since = subscribed_at
                            self._read_at.clear()  # read before: not valid any more
                            self._subscribed.set()
                            self._failing = False
                        elif message["type"] == "message":
                            self._received(message["data"])
            except Exception as exc:  # whatever it was: the listener goes on
                self._listening_since = None
                self._listen_failed(exc)
                # Doubled while it fails again soon after subscribing: a failure that comes
                # back at once costs a subscription (and a WARNING) at most every 30 s.
                if subscribed_at is not None and self._clock.wall() - subscribed_at > delay:
                    delay = RESUBSCRIBE_DELAY
                await self._clock.sleep(delay)
                if not isinstance(exc, (RedisError, OSError)):
                    delay = min(2 * delay, MAX_RESUBSCRIBE_DELAY)

    def _listen_failed(self, exc: Exception) -> None:
        self._stats.inc_value(f"{STATS_PREFIX}/listener_errors/{type(exc).__name__}")
        # Once per failure, not once a second; an unreachable Redis is reported by the breaker.
        if self._failing or isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
            return
        self._failing = True
        logger.warning(
            "Redis throttle: cannot listen for the pauses of other workers (%s: %s); until "
            "this works, requests that reserved a moment within such a pause go at it",
            type(exc).__name__,
            exc,
            # Not Redis's: a bug, whose traceback tells where.
            exc_info=not isinstance(exc, RedisError),
            extra=self._log_extra(),
        )

    def _received(self, data: bytes) -> None:
        message = parse_message(data)
        if message is not None:
            domain = message.domain
            try:
                self.pause(domain, message.void_us / 1e6, at_us=message.at_us, holds=message.holds)
            except Exception as exc:  # a bug passing it on: the subscription and the next go on
                self._count_once(
                    f"listener_errors/{type(exc).__name__}",
                    "a pause heard for %r could not be passed on to all the requests it voids "
                    "(logged once; counted in %s/listener_errors)",
                    domain,
                    STATS_PREFIX,
                    error=True,
                )
            return
        self._count_once(
            "bad_messages",
            "ignored a message on %s that is not a pause: %r (logged once; counted in "
            "%s/bad_messages)",
            self._channel,
            data[:200],
            STATS_PREFIX,
        )

    def _count_once(self, stat: str, message: str, *args: object, error: bool = False) -> None:
        """Count *stat*; log the first of its kind (*error*: at ERROR, with the traceback)."""
        self._stats.inc_value(f"{STATS_PREFIX}/{stat}")
        if not self._once.first(stat.partition("/")[0]):
            return
        log = logger.exception if error else logger.warning
        log(f"Redis throttle: {message}", *args, extra=self._log_extra())
