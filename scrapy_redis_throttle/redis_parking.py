"""Parked requests in scrapy-redis's Redis, beside its queue (see :mod:`.parking`): a sorted
set shared by every worker of the spider, scored by when each is due, whose members
``lua/park.lua`` writes and :func:`read_member` reads back (as hostile input: whoever may write
into that Redis may write there)."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .leases import LEASE_META
from .parking_stores import Closed, Parked
from .redis_schema import moments_key
from .request_codec import decode_request, encode_request
from .scripts import lua_script
from .seals import Seals
from .server_clock import ServerClock
from .stats import STATS_PREFIX
from .tickets import TICKET_META, Ticket, Unused, sealed_message, unused_reservation

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from scrapy import Request, Spider

    from .clock import Clock
    from .leases import Leases
    from .pauses import Pause
    from .rejections import Rejections

logger = logging.getLogger(__name__)

# How often a worker looks for requests that other workers parked in Redis.
REDIS_POLL_INTERVAL = 0.25
# The flags of park.lua's members: indexed by its reserved moment, not, or voided (it asks
# again, see void_parked.lua).
_INDEXED, _NOT_INDEXED, _ASKS_AGAIN = b"r", b"u", b"a"
_DOMAIN_DIGITS = 5
# Index entries that one call of void_parked.lua looks at, at most.
VOID_BATCH = 100
# Tries to make sure a request whose parking failed is not parked after all.
FORGET_ATTEMPTS = 5
# At a close that drops what is parked (no SCHEDULER_PERSIST), the requests whose reservations
# are read to give back, at most (the rest expire with their moments, as after a crash), and how
# many are read at once.
DROPPED_READ = 10_000
DROPPED_BATCH = 500


class ParkUncertain(RedisConnectionError):
    """A park whose reply was lost and whose request is not in the set: it may have been
    parked and taken since."""


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
        self._park_script = lua_script(redis, "park.lua", clock)
        self._unpark_script = lua_script(redis, "unpark.lua", clock)
        self._void_script = lua_script(redis, "void_parked.lua", clock)
        self._server_clock = ServerClock(clock)  # scrapy-redis's Redis's, not the throttle's

    async def park(self, request: Request, ticket: Ticket) -> None:
        meta = {name: value for name, value in request.meta.items() if name != LEASE_META}
        member_id = uuid.uuid4().hex.encode()  # two equal requests must stay two members
        ticket_wire = ticket.to_wire()
        seal = self._seals.seal(sealed_message(member_id, ticket.domain, ticket_wire))
        wire = request.replace(meta={**meta, TICKET_META: [*ticket_wire, seal]})
        encoded = encode_request(wire, self._spider)  # Unparkable: before anything is done
        # The call may wait for the connection: its delay counts from Redis's time now (see
        # park.lua's ARGV[3]), not from when Redis runs it.
        await self._server_clock.follow(self._redis.time)
        now = self._clock.monotonic()
        delay = max(0.0, ticket.due - now)
        asked = self._server_clock.server_us(now)
        domain, reservation = _indexed_domain(ticket.domain), ticket.reservation
        # When its moment was reserved in Redis, by Redis's clock, as voidings tell theirs.
        reserved_at = 0 if reservation is None else reservation.at
        member = b"".join(
            (
                # Indexed by its moment when it has one in Redis that a voiding may reach (see
                # park.lua); one reserved in a worker alone learns of a voiding at its moment.
                _INDEXED
                if ticket.reserved and reservation is not None and domain
                else _NOT_INDEXED,
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

    async def release_voided(self, domain: str, pause: Pause) -> int:
        domain_bytes = _indexed_domain(domain)
        if not domain_bytes or pause.at_us is None:
            # Never indexed (see park); or a pause Redis did not time (this worker's, while
            # Redis failed): the requests parked with its moments learn of it at them.
            return 0
        # By Redis's clock, as the index (each worker's wall clock may differ from the others').
        reserved_before = b"%d" % max(0, int(pause.at_us))
        until_us = repr(max(0.0, pause.until - self._clock.monotonic()) * 1e6)
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
                return Closed(parked, [], {})
            return Closed(parked, *await self._drop())
        finally:
            for script in (self._park_script, self._unpark_script, self._void_script):
                await script.aclose()
            await self._redis.aclose(close_connection_pool=True)

    async def _drop(self) -> tuple[list[Unused], dict[str, int]]:
        """Drop what is parked; return the reservations of the first :data:`DROPPED_READ`
        dropped requests, and their domains. Those are taken out one batch at a time
        (ZPOPMIN), out of the others' reach: a request another worker takes meanwhile goes at
        its moment, and must not be given back."""
        unused = []
        domains: Counter[str] = Counter()
        for _ in range(0, DROPPED_READ, DROPPED_BATCH):
            popped = cast(
                "list[tuple[bytes, float]]", await self._redis.zpopmin(self.key, DROPPED_BATCH)
            )
            unused += [found for member, _ in popped if (found := self._reserved_in(member))]
            domains.update(_member_domain(member) for member, _ in popped)
            if len(popped) < DROPPED_BATCH:
                break
        await self._redis.delete(self.key, self.index_key)
        domains.pop("", None)  # members of another form, or of a domain too long to index
        return unused, dict(domains)

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
        return unused_reservation(ticket)

    def _sealed(self, member: bytes, domain: str, wire: object) -> bool:
        """Whether a ticket read back from the set (*wire*, of *member*, for *domain*) bears the
        fleet's seal; a reserved one without it is counted and logged."""
        if not (isinstance(wire, list) and len(wire) == 8):
            return False
        try:
            message = sealed_message(bytes(member[1:33]), domain, wire[:7])
        except (TypeError, ValueError):  # (what json.loads gave json.dumps takes: a bug)
            return False
        if self._seals.check(message, wire[7]):
            return True
        if wire[0] is True and self._seals.sealed_before(message, wire[7]):
            # Sealed before Redis lost the throttle's state: its moment was lost with it.
            self._rejections.stats.inc_value(f"{STATS_PREFIX}/lost_reservations")
        elif wire[0] is True:
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


def _member_domain(member: bytes) -> str:
    """The domain of a member of the parking set ("": unknown)."""
    try:
        return read_member(member)[1]
    except ValueError:
        return ""


def _is_hex(data: bytes) -> bool:
    return len(data) == 32 and all(byte in b"0123456789abcdef" for byte in data)
