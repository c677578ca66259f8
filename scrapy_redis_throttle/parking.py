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

A voiding of a domain's reserved moments (see :class:`.penalties.Pauses`) reaches the
requests parked with them at once (:meth:`ParkingArea.voided`): they come back to ask again,
as held ones wake to, not at their old moments. Both stores index reserved moments by domain.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import json
import logging
import math
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast
from weakref import WeakKeyDictionary, WeakSet

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from scrapy_redis.scheduler import Scheduler as ScrapyRedisScheduler

from .bucket import Reservation, Unreserved
from .clock import sleep_or_wake
from .config import STATS_PREFIX
from .connection import connect_url
from .errors import ThrottleConfigError
from .leases import LEASE_META, Leases, queue_kind
from .penalties import CLOCK_MARGIN
from .redis_schema import (
    MAX_MOMENT_US,
    leases_key,
    lessees_key,
    moments_key,
    parking_key,
)
from .request_codec import Unparkable, decode_request, encode_request
from .scripts import lua_script
from .seals import Seals
from .server_clock import ServerClock

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from redis.asyncio import Redis
    from scrapy import Request, Spider
    from scrapy.core.scheduler import BaseScheduler
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred

    from .clock import Clock
    from .config import ThrottleConfig
    from .rejections import Rejections

    Unreserve = Callable[[str, list[Reservation]], Awaitable[Unreserved | None]]
    """Gives a domain's bucket back reservations (:meth:`.ResilientBucket.unreserve`):
    None when Redis could not be told."""

logger = logging.getLogger(__name__)

TICKET_META = "_redis_throttle_ticket"
# Give parked requests back this long before they are due: the middleware holds them for the
# rest, so that they leave exactly on time however busy the engine is.
RELEASE_AHEAD = 0.5
# A parked request's exact moment (Ticket.moment_us) is not after the due the parking area tells
# by more than this (the two clocks' bounds, ms): a moment further after it is not one Redis
# gave, as this process reads it (a clock that stepped), and the due counts. The due may be late
# by any amount: park.lua counts at most WAITED_AT_MOST (0.1 s) of the wait of a park call queued
# behind its connection's batch, which a busy worker reads late (up to 1.1 s measured); going at
# such a due instead of the moment squeezed the request against the next moment's.
MOMENT_AGREES = 0.25
RELEASE_BATCH = 32
# The least time between two looks for due requests: those due meanwhile are given back
# together, still at least RELEASE_AHEAD - LOOK_INTERVAL early (with one look per request due,
# the parking area cost ~1.6 Redis calls per request more at 35 requests/s: bench/binding.py).
LOOK_INTERVAL = 0.1
# How often a worker looks for requests that other workers parked in Redis.
REDIS_POLL_INTERVAL = 0.25
# The flags of park.lua's members: indexed by its reserved moment, not, or voided (it asks
# again, see void_parked.lua).
_INDEXED, _NOT_INDEXED, _ASKS_AGAIN = b"r", b"u", b"a"
_DOMAIN_DIGITS = 5
# Index entries that one call of void_parked.lua looks at, at most.
VOID_BATCH = 100
# For the plain commands (ZCARD and DEL at the close): the scripts have a connection each.
PARKING_CONNECTIONS = 1
# Tries to make sure a request whose parking failed is not parked after all.
FORGET_ATTEMPTS = 5
# How soon to look again when the engine could take no request.
BUSY_RETRY = 0.05
# At a close that drops what is parked (no SCHEDULER_PERSIST), the requests whose reservations
# are read to give back, at most (the rest expire with their moments, as after a crash), and how
# many are read at once.
DROPPED_READ = 10_000
DROPPED_BATCH = 500
# Names this process in the tickets it parks in Redis: its wall clock is theirs.
_PROCESS = uuid.uuid4().hex


@dataclass(frozen=True)
class Ticket:
    """What the throttle and the parking area tell each other of a request: from the throttle,
    in its meta (:data:`TICKET_META`), "park it until *due*"; from the parking area, beside it
    (:meth:`ParkingArea.handed_out`), "back from the parking area, due at *due*"."""

    domain: str
    """The domain whose budget it waits for (a voiding of its moments reaches it)."""
    due: float
    """Loop time (``loop.time()``) of the request's moment."""
    reserved: bool
    """Its tokens are reserved for that moment (else it asks again then)..."""
    locally: bool
    """...in this process's own buckets (Redis was failing), not in Redis."""
    reserved_at: float
    """Wall time (:func:`time.time`) when its tokens were asked for: a pause heard of after
    it voids the reservation (see :class:`.penalties.Pauses`)."""
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
        """The loop time of its reserved moment: by *clock* (the throttle's Redis's) when it
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
                domain,
                due,
                reserved,
                locally,
                float(reserved_at),
                float(waiting_since),
                elsewhere,
                None if moment_us is None else float(moment_us),
                _reservation(value[6]) if reserved and len(value) == 8 else None,
            )
        return cls(domain, due, False, False, now, now, elsewhere=True)


def _unused(ticket: Ticket) -> Unused | None:
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


def _sealed_message(member_id: bytes, domain: str, wire: list[Any]) -> bytes:
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


class ParkUncertain(RedisConnectionError):
    """A park whose reply was lost and whose request is not in the set: it may have been
    parked and taken since."""


class Closed(NamedTuple):
    """What a parking store held at its close."""

    parked: int
    """Requests parked."""
    dropped: list[Unused]
    """The reservations of those dropped: to give back."""


Parked = tuple["Request", Ticket]
"""A request taken out of the parking area, with its ticket."""
_Entry = tuple[float, int, "Request", Ticket]
"""A request parked in this process: due (loop time), order of parking, request, ticket."""


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

    async def release_voided(self, domain: str, heard: float, until: float) -> int:
        """Make the requests of *domain* parked with a moment up to *until* (loop time) reserved
        before *heard* (wall time) due now, to ask again (see :meth:`.Pauses.pause`); return
        how many."""
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

    async def release_voided(self, domain: str, heard: float, until: float) -> int:
        void = {
            order
            for order, (due, _, _, ticket) in self._reserved.get(domain, {}).items()
            if due <= until and ticket.reserved_at < heard
        }
        if not void:
            return 0
        now = self._clock.monotonic()
        kept = []
        for entry in self._heap:
            _, order, request, ticket = entry
            if order in void:
                self._unindex(domain, order)
                entry = (now, order, request, replace(ticket, due=now, reserved=False))
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
            return Closed(len(entries), [])
        dropped = [unused for *_, ticket in entries if (unused := _unused(ticket)) is not None]
        return Closed(len(entries), dropped)


class RedisParking:
    """Parked requests in a Redis sorted set shared by every worker of the spider (*key*),
    with an index of their reserved moments by domain (*key*``:moments``), through
    which a voiding reaches them (``lua/void_parked.lua``)."""

    poll_interval: float | None = REDIS_POLL_INTERVAL

    def __init__(
        self,
        redis: Redis,
        key: str,
        spider: Spider,
        rejections: Rejections,
        clock: Clock,
        leases: Leases | None = None,
        seals: Seals | None = None,
    ) -> None:
        self._clock = clock
        self.key = key
        self.index_key = moments_key(key)
        self.parked = 0
        self.leases = leases
        self._redis = redis
        self._spider = spider
        self._rejections = rejections
        # None (no throttle's Redis to keep a secret): it seals nothing, and no ticket counts.
        self._seals = seals or Seals()
        self._park_script = lua_script(redis, "park.lua")
        self._unpark_script = lua_script(redis, "unpark.lua")
        self._void_script = lua_script(redis, "void_parked.lua")
        self._server_clock = ServerClock()  # scrapy-redis's Redis's, not the throttle's

    async def park(self, request: Request, ticket: Ticket) -> None:
        meta = {name: value for name, value in request.meta.items() if name != LEASE_META}
        member_id = uuid.uuid4().hex.encode()  # two equal requests must stay two members
        ticket_wire = ticket.to_wire()
        seal = self._seals.seal(_sealed_message(member_id, ticket.domain, ticket_wire))
        wire = request.replace(meta={**meta, TICKET_META: [*ticket_wire, seal]})
        encoded = encode_request(wire, self._spider)  # Unparkable: before anything is done
        # The call may wait for the connection: its delay counts from Redis's time now (see
        # park.lua's ARGV[3]), not from when Redis runs it.
        await self._server_clock.follow(self._redis.time)
        now = self._clock.monotonic()
        delay = max(0.0, ticket.due - now)
        asked = self._server_clock.server_us(now)
        domain, reserved_at = _indexed_domain(ticket.domain), ticket.reserved_at * 1e6
        member = b"".join(
            (
                # Indexed by its moment when it has one that a voiding may reach (see park.lua).
                _INDEXED if ticket.reserved and domain else _NOT_INDEXED,
                member_id,
                # (A reserved_at read back from Redis may be anything: 16 digits, whatever.)
                b"%05d%s%016d" % (len(domain), domain, min(max(int(reserved_at), 0), 10**16 - 1)),
                encoded,
            )
        )
        try:
            reply = await self._park_script(
                keys=[self.key, self.index_key],
                args=[repr(delay * 1e6), member, *([] if asked is None else [repr(asked)])],
            )
        except (RedisConnectionError, RedisTimeoutError) as error:
            # The reply is lost, not necessarily the park: make sure the request is not in the
            # set before the caller keeps it, or it would be crawled twice.
            if not await self._forget(member):
                # Not there: never parked, or parked and taken since (by another worker, to go
                # at its moment; by a close, its moment given back). Kept, it asks anew.
                raise ParkUncertain(str(error)) from error
            raise
        self.parked = int(reply)

    async def _forget(self, member: bytes) -> bool:
        """Take *member* out of the set if it is there; whether it was."""
        delay = 0.1
        for _ in range(FORGET_ATTEMPTS):
            try:
                reply = await self._unpark_script(
                    keys=[self.key, self.index_key], args=["0", 1, member]
                )
                return len(reply) > 3  # (with it, when it was taken out)
            except (RedisConnectionError, RedisTimeoutError):
                await self._clock.sleep(delay)
                delay *= 2
        logger.error(
            "Redis throttle: a request whose parking failed may also stay parked in %s and be "
            "crawled twice",
            self.key,
        )
        return False

    async def unpark(self, ahead: float, limit: int) -> tuple[list[Parked], float | None]:
        await self._server_clock.follow(self._redis.time)
        sent = self._clock.monotonic()
        keys, args = [self.key, self.index_key], [repr(ahead * 1e6), limit]
        if self.leases is not None:
            lease_keys, lease_args = self.leases.unpark_keys()
            keys, args = [*keys, *lease_keys], [*args, "", *lease_args]
        reply = await self._unpark_script(keys=keys, args=args)
        read = self._clock.monotonic()
        self.parked = int(reply[0])
        next_due = float(reply[1])
        # The dues count from when Redis answered, not from when its reply was read.
        now = self._server_clock.decided_at(sent, read, float(reply[2]))
        read_at = self._clock.wall()
        due = []
        for member, due_in_ms in zip(reply[3::2], reply[4::2], strict=True):
            # Leased under its member's id (see unpark.lua).
            lease = bytes(member[1:33]).decode("ascii", "replace")
            try:
                flag, domain, encoded = read_member(member)
                request = decode_request(encoded, self._spider)
            except Exception as error:  # (a ValueError, unless a bug: either way, the next)
                if self.leases is not None:
                    self.leases.release(lease)
                # Not written by a worker of this version: the set is in reach of whoever may
                # write into scrapy-redis's Redis. The batch is out of the set already: one
                # such member must not lose the others.
                self._rejections.reject(
                    "parked_request",
                    self.key,
                    f"an entry of the parking set ({error})",
                    "dropped it",
                )
                continue
            wire = request.meta.pop(TICKET_META, None)
            ticket = Ticket.from_wire(
                wire,
                domain,
                now + float(due_in_ms) / 1000,
                read_at,
                self._sealed(member, domain, wire),
            )
            if flag == _ASKS_AGAIN:
                ticket = replace(ticket, reserved=False)
            if self.leases is not None:
                request.meta[LEASE_META] = lease
            due.append((request, ticket))
        return due, (next_due / 1000 if next_due >= 0 else None)

    async def release_voided(self, domain: str, heard: float, until: float) -> int:
        domain_bytes = _indexed_domain(domain)
        if not domain_bytes:
            return 0  # never indexed (see park)
        # Parked by any worker of the fleet, whose clock may differ from this one's.
        reserved_before = b"%d" % max(0, int((heard + CLOCK_MARGIN) * 1e6))
        until_us = repr(max(0.0, until - self._clock.monotonic()) * 1e6)
        released, last = 0, b""
        while True:
            reply = await self._void_script(
                keys=[self.key, self.index_key],
                args=[domain_bytes, until_us, reserved_before, last, VOID_BATCH],
            )
            released += int(reply[0])
            last = reply[1]
            if not last:
                return released

    async def close(self, keep: bool) -> Closed:
        try:
            if self.leases is not None:
                await self.leases.close(keep)
            parked = int(await self._redis.zcard(self.key))
            if keep or not parked:
                return Closed(parked, [])
            return Closed(parked, await self._drop())
        finally:
            for script in (self._park_script, self._unpark_script, self._void_script):
                await script.aclose()
            await self._redis.aclose(close_connection_pool=True)

    async def _drop(self) -> list[Unused]:
        """Drop what is parked; return the reservations of the first :data:`DROPPED_READ`
        dropped requests. Those are taken out one batch at a time (ZPOPMIN), out of the others'
        reach: a request another worker takes meanwhile goes at its moment, and must not be
        given back."""
        unused = []
        for _ in range(0, DROPPED_READ, DROPPED_BATCH):
            popped = cast(
                "list[tuple[bytes, float]]", await self._redis.zpopmin(self.key, DROPPED_BATCH)
            )
            unused += [found for member, _ in popped if (found := self._reserved_in(member))]
            if len(popped) < DROPPED_BATCH:
                break
        await self._redis.delete(self.key, self.index_key)
        return unused

    def _reserved_in(self, member: bytes) -> Unused | None:
        """The reservation a member of the parking set holds (None: none, or not a member a
        worker of this fleet parked)."""
        try:
            flag, domain, encoded = read_member(member)
            if flag != _INDEXED:
                return None
            request = decode_request(encoded, self._spider)
        except Exception:  # (a ValueError, unless a bug: either way, none; dropped anyway)
            return None
        wire = request.meta.get(TICKET_META)
        ticket = Ticket.from_wire(wire, domain, 0.0, 0.0, self._sealed(member, domain, wire))
        return _unused(ticket)

    def _sealed(self, member: bytes, domain: str, wire: object) -> bool:
        """Whether a ticket read back from the set (*wire*, of *member*, for *domain*) bears the
        fleet's seal; a reserved one without it is counted and logged."""
        if not (isinstance(wire, list) and len(wire) == 8):
            return False
        try:
            message = _sealed_message(bytes(member[1:33]), domain, wire[:7])
        except (TypeError, ValueError):  # (what json.loads gave json.dumps takes: a bug)
            return False
        if self._seals.check(message, wire[7]):
            return True
        if wire[0] is True:
            self._rejections.reject(
                "parked_ticket",
                domain,
                "a parked request's reservation not sealed by this fleet",
                "it asks for a moment anew",
            )
        return False


def _indexed_domain(domain: str) -> bytes:
    """*domain* as the index of moments has it (see park.lua): b"" for a domain (from meta) too long
    to index, whose requests wait for their moments to learn of a voiding."""
    # Any str, even one with lone surrogates, and always the same bytes.
    encoded = domain.encode("utf-8", "surrogatepass")
    return encoded if len(encoded) < 10**_DOMAIN_DIGITS else b""


def read_member(member: bytes) -> tuple[bytes, str, bytes]:
    """The flag, domain and serialized request of a member of the parking set (see
    park.lua); ValueError for a member of another form."""
    flag, length = member[:1], member[33:38]
    if flag not in (_INDEXED, _NOT_INDEXED, _ASKS_AGAIN) or not (
        _is_hex(member[1:33]) and length.isdigit()
    ):
        raise ValueError("not of the form park.lua writes")
    end = 38 + int(length)
    return flag, member[38:end].decode("utf-8", "surrogatepass"), member[end + 16 :]


def _is_hex(data: bytes) -> bool:
    return len(data) == 32 and all(byte in b"0123456789abcdef" for byte in data)


class ParkingArea:
    """Parked requests of one crawl, attached to its scheduler (see :func:`attach`): requests
    with a ticket to park go to *store*, those due come back to the engine ahead of the
    scheduler's own; the spider stays open while any are parked. At the close, what is parked
    is kept when *keep* (else dropped and counted)."""

    def __init__(
        self,
        crawler: Crawler,
        store: ParkingStore,
        keep: bool,
        concurrency: int,
        clock: Clock,
        unreserve: Unreserve | None = None,
    ) -> None:
        self._clock = clock
        self.store = store
        # With scrapy-redis's queue: what this worker takes from Redis is leased.
        self.leases: Leases | None = getattr(store, "leases", None)
        self._crawler = crawler
        self._keep = keep
        self._ready: deque[Parked] = deque()
        # Requests given back through engine.crawl(), until they reach enqueue_request...
        self._giving_back: WeakKeyDictionary[Request, Ticket] = WeakKeyDictionary()
        # ...and those the engine took, until the middleware sees them (see handed_out).
        self._handed: WeakKeyDictionary[Request, Ticket | None] = WeakKeyDictionary()
        # Given back because their parking failed: not parked again (it would fail again).
        self._unparkable: WeakSet[Request] = WeakSet()
        self._parking_tasks: set[asyncio.Task[None]] = set()
        self._wake_up = asyncio.Event()
        self._stopping = False
        self._parks_done = 0
        self._unparkable_logged = False
        self._next_look = 0.0  # monotonic time of the release loop's next look, while it waits
        self._unpark_failing = False
        self._void_failing = False
        # Voidings not yet passed on to the store: domain -> (heard, until).
        self._voidings: dict[str, tuple[float, float]] = {}
        self._concurrency = concurrency
        self._unreserve = unreserve
        self._releaser = asyncio.ensure_future(self._release_loop())

    def voided(self, domain: str, heard: float, until: float) -> None:
        """The moments of *domain* up to *until* (loop time) reserved before *heard* (wall time)
        are void (see :meth:`.Pauses.pause`): the requests parked with one come back at once,
        to ask again, as held ones do, not at their old moments."""
        if (known := self._voidings.get(domain)) is not None:
            # Two voidings passed on as one that covers both (and errs on the polite side: a
            # moment reserved between them, after the first one's end, asks again too).
            heard, until = max(heard, known[0]), max(until, known[1])
        self._voidings[domain] = (heard, until)
        self._wake_up.set()

    def enqueue_request(self, request: Request) -> bool | None:
        """Take *request* if it comes from the throttle or the parking area (True); None: it
        is the scheduler's."""
        released = self._giving_back.pop(request, None)
        if released is not None:  # given back by _release_loop, through engine.crawl()
            self._ready.append((request, released))
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

    def busy(self) -> bool:
        """Whether requests are in the downloader (downloading, or waiting in the throttle)."""
        engine = self._crawler.engine
        return bool(engine and engine.downloader.active)

    def has_pending_requests(self) -> bool:
        return (
            bool(self._ready or self._parking_tasks or self.store.parked)
            or self._wake_up.is_set()  # a park that the parked count may not show yet
            or (self.leases is not None and not self.leases.looked)
        )

    async def _park(self, request: Request, ticket: Ticket, lease: object = None) -> None:
        try:
            await self._park_leased(request, ticket, lease)
        except Unparkable as error:
            self._crawler.stats.inc_value(f"{STATS_PREFIX}/unparkable")
            if not self._unparkable_logged:
                self._unparkable_logged = True
                logger.warning(
                    "Redis throttle: %s cannot be parked (%s); it waits in the downloader, "
                    "as will others that cannot (counted in %s/unparkable, logged once)",
                    request,
                    error,
                    STATS_PREFIX,
                )
            self._unparkable.add(request)
            self._give_back(request, ticket)
            return
        except Exception as error:
            # Not lost: the middleware holds it until its moment instead; or, when the park may
            # have happened, it asks anew (its moment may be another's, or given back).
            logger.exception(
                "Redis throttle: could not park %s; it waits in the downloader", request
            )
            self._unparkable.add(request)
            if isinstance(error, ParkUncertain):
                ticket = replace(ticket, reserved=False, reservation=None)
            self._give_back(request, ticket)
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

    def _give_back(self, request: Request, ticket: Ticket) -> None:
        # engine.crawl() queues it (enqueue_request above) and wakes the engine up.
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

    def _room(self) -> int:
        """How many requests the engine could start now: take no more than that out of the
        parking area, or they would miss their moment here while another worker has room."""
        engine = self._crawler.engine
        try:
            if engine.needs_backout():
                return 0
        except (AssertionError, AttributeError):  # the engine is still opening the spider
            return 0
        free = self._concurrency - len(engine.downloader.active) - len(self._ready)
        return min(max(free, 0), RELEASE_BATCH)

    async def _release_loop(self) -> None:
        # Stopped by a flag, not by cancelling: a cancellation can get lost.
        while not self._stopping:
            self._wake_up.clear()
            await self._release_voided()
            timeout = await self._release_due()
            self._next_look = self._clock.monotonic() + timeout
            await sleep_or_wake(self._clock, timeout, self._wake_up.wait())

    async def _release_voided(self) -> None:
        # Those heard so far: the ones heard meanwhile wait for the next pass, after the due
        # requests are given back (a flood of voidings must not hold those up).
        voidings, self._voidings = self._voidings, {}
        for domain, (heard, until) in voidings.items():
            try:
                released = await self.store.release_voided(domain, heard, until)
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
        room = self._room()
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
                self._ready.append((request, ticket))
            else:
                self._give_back(request, ticket)
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
        lost = 0
        unused: list[Unused] = []
        # Given back but not yet taken by the engine: park them again, due at once, to ask
        # anew (their moments are too close to wait parked for).
        while self._ready:
            request, ticket = self._ready.popleft()
            if (reservation := _unused(ticket)) is not None:
                unused.append(reservation)
            now = self._clock.monotonic()
            again = replace(ticket, due=now, reserved=False, locally=False, reservation=None)
            try:
                await self._park_leased(request, again, request.meta.pop(LEASE_META, None))
            except Unparkable:  # (waiting in the downloader, it was counted and logged)
                lost += 1
            except Exception:
                logger.exception("Redis throttle: could not park %s again at the close", request)
                lost += 1
        try:
            parked, dropped = await self.store.close(self._keep)
        except Exception:
            logger.exception("Redis throttle: could not close the parking area")
            parked, dropped = 0, []
        await self._give_back_reservations([*unused, *dropped])
        if self._keep and parked:
            logger.info("Redis throttle: %d parked requests are kept for the next run", parked)
        not_crawled = lost + (0 if self._keep else parked)
        if not_crawled:
            self._crawler.stats.set_value(f"{STATS_PREFIX}/parked_not_crawled", not_crawled)
            logger.warning(
                "Redis throttle: %d parked requests were not crawled (they were waiting for "
                "their domains' budgets when the spider closed)",
                not_crawled,
            )

    async def _give_back_reservations(self, unused: list[Unused]) -> None:
        """Give the buckets back the moments reserved for requests that will not go at them
        (see :meth:`.TokenBucket.unreserve`): a fleet that starts again does not wait for
        them."""
        if not unused or self._unreserve is None:
            return
        by_domain: dict[str, list[Reservation]] = {}
        for domain, reservation in unused:
            by_domain.setdefault(domain, []).append(reservation)
        taken = set_aside = 0
        for domain, reservations in by_domain.items():
            try:
                done = await self._unreserve(domain, reservations)
            except Exception:  # (a bug: the other domains' and the close's work must go on)
                logger.exception("Redis throttle: could not give back moments of %r", domain)
                continue
            if done is not None:
                taken, set_aside = taken + done.taken, set_aside + done.set_aside
        stats = self._crawler.stats
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


def engine_scheduler(crawler: Crawler) -> BaseScheduler | None:
    """The scheduler the engine runs (``engine.scheduler`` is public from Scrapy 2.15 on)."""
    engine = crawler.engine
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None:
        slot = getattr(engine, "_slot", None)
        scheduler = getattr(slot, "scheduler", None)
    return scheduler


def attach(
    crawler: Crawler,
    config: ThrottleConfig,
    scheduler: BaseScheduler,
    rejections: Rejections,
    clock: Clock,
    unreserve: Unreserve | None = None,
    seals: Seals | None = None,
) -> ParkingArea:
    """Attach a parking area to the engine's *scheduler*, whatever its class: its
    ``enqueue_request``, ``next_request``, ``has_pending_requests`` and ``close`` are wrapped
    on this instance (the engine calls them there), so that parked requests are taken before
    the scheduler sees them, come back ahead of its own, keep the spider open, and are kept or
    dropped at its close as its own queue is."""
    spider = crawler.spider
    assert spider is not None
    crawl = config.crawl
    if isinstance(scheduler, ScrapyRedisScheduler):
        # In scrapy-redis's Redis, with the queue (not in the throttle's, which may be another):
        # parked requests are part of the queue and share its fate.
        queue_key = scheduler.queue_key % {"spider": spider.name}
        key = parking_key(queue_key)
        if scheduler.flush_on_start:
            leased = scheduler.server.scan_iter(leases_key(queue_key, "*"))
            scheduler.server.delete(key, moments_key(key), lessees_key(queue_key), *leased)
        if isinstance(crawl.queue_redis, ThrottleConfigError):
            raise crawl.queue_redis
        url, params = crawl.queue_redis
        redis = connect_url(url, params, PARKING_CONNECTIONS)
        leases = _leases(crawler, scheduler, redis, key, config.lease_ttl, clock)
        store = RedisParking(redis, key, spider, rejections, clock, leases, seals)
        # Known from the start, so that the spider neither closes nor idles on a guess (read
        # synchronously, as scrapy-redis itself reads its queue's length at start).
        store.parked = int(scheduler.server.zcard(key))
        area = ParkingArea(
            crawler,
            store,
            keep=bool(scheduler.persist),
            concurrency=crawl.concurrent_requests,
            clock=clock,
            unreserve=unreserve,
        )
    else:
        enqueue = scheduler.enqueue_request
        # Scrapy's scheduler with JOBDIR keeps its queue on disk: parked requests join it.
        on_disk = getattr(scheduler, "dqs", None) is not None

        def keep_into(request: Request) -> None:
            # Its URL is already in the dupefilter's requests.seen: let it through once more.
            enqueue(request.replace(dont_filter=True))

        area = ParkingArea(
            crawler,
            MemoryParking(keep_into, clock),
            keep=on_disk,
            concurrency=crawl.concurrent_requests,
            clock=clock,
            unreserve=unreserve,
        )
    _wrap(scheduler, area)
    return area


def _leases(
    crawler: Crawler,
    scheduler: ScrapyRedisScheduler,
    redis: Redis,
    parking: str,
    ttl: float,
    clock: Clock,
) -> Leases | None:
    """Leases on what this worker takes from scrapy-redis's queue and the parking set: its
    queue's ``pop`` and the engine's end of a request are wrapped on their instances."""
    queue = scheduler.queue
    kind = queue_kind(queue)
    slot: Any = getattr(crawler.engine, "_slot", None)
    if kind is None or not callable(getattr(slot, "remove_request", None)):
        logger.warning(
            "Redis throttle: no leases on the requests of %s (a queue class of scrapy-redis, "
            "and Scrapy's engine, are needed): a worker that dies loses those it took",
            type(queue).__name__,
        )
        return None
    leases = Leases(scheduler.server, redis, queue, kind, parking, crawler.stats, ttl, clock)
    queue.pop = functools.partial(leases.pop, queue.pop)
    remove_request = slot.remove_request

    def done(request: Request) -> None:
        leases.acknowledge(request)
        remove_request(request)

    slot.remove_request = done
    leases.start()
    return leases


def _wrap(scheduler: BaseScheduler, area: ParkingArea) -> None:
    enqueue_request = scheduler.enqueue_request
    next_request = scheduler.next_request
    has_pending_requests = scheduler.has_pending_requests
    close: Callable[[str], Deferred[None] | None] | None = getattr(scheduler, "close", None)

    leases = getattr(area.store, "leases", None)

    def enqueue(request: Request) -> bool:
        taken = area.enqueue_request(request)
        if taken is not None:
            return taken
        # A retry, a redirect or a request given back: once in the queue, the lease it carries
        # (its original's) goes; popped again, it is leased again.
        lease = request.meta.pop(LEASE_META, None)
        queued = enqueue_request(request)
        if leases is not None:
            leases.release(lease)
        return queued

    # scrapy-redis's SCHEDULER_IDLE_BEFORE_CLOSE: with an empty FIFO or LIFO queue, its
    # next_request blocks the reactor that long (BRPOP) waiting for more, before the spider may
    # idle. While requests download, wait in the throttle or are parked, the spider cannot idle
    # anyway, and the block would only delay them (held requests wake late, parked ones come
    # back late: their moments are missed).
    idle_before_close = getattr(scheduler, "idle_before_close", None)

    def next_one() -> Request | None:
        if not (idle_before_close and (area.busy() or area.has_pending_requests())):
            return area.next_request(next_request)
        scheduler.idle_before_close = 0  # type: ignore[attr-defined]
        try:
            return area.next_request(next_request)
        finally:
            scheduler.idle_before_close = idle_before_close  # type: ignore[attr-defined]

    def pending() -> bool:
        return area.has_pending_requests() or has_pending_requests()

    async def close_both(reason: str) -> None:
        try:
            await area.stop()  # first: the scheduler's close may flush or save its queue
        finally:
            if close is not None and (result := close(reason)) is not None:
                await maybe_deferred_to_future(result)

    def closing(reason: str) -> Deferred[None]:
        return deferred_from_coro(close_both(reason))

    for name, method in (
        ("enqueue_request", enqueue),
        ("next_request", next_one),
        ("has_pending_requests", pending),
        ("close", closing),
    ):
        setattr(scheduler, name, method)
