"""Leases on the requests a worker takes from scrapy-redis's Redis (its queue, and the parking
set beside it), so that a worker that dies loses none of them.

A request taken is not deleted: it moves to the worker's leases in Redis (``lua/lease_pop.lua``,
``lua/unpark.lua``), in the same call that takes it. The worker acknowledges it once the engine
is done with it (its response or failure handled by the spider, or the request that replaces
it, a retry or a redirect, queued), or once it is parked again; the acknowledgements go in
batches, with the renewal of the worker's leases (``lua/renew_leases.lua``), every
:data:`RENEW_INTERVAL`. A worker that stops renewing them for the lease TTL is taken for
dead (``REDIS_THROTTLE_LEASE_TTL``): any live worker gives its requests back
(``lua/give_back.lua``), exactly once. At a clean
close a worker gives back what it still holds itself.

At least once: after a crash, the requests the dead worker was downloading, or had finished
within the last :data:`RENEW_INTERVAL`, are fetched again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from scrapy_redis.queue import FifoQueue, LifoQueue, PriorityQueue

from .redis_schema import leases_key, lessees_key
from .scripts import load_script, lua_script
from .stats import STATS_PREFIX
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Callable

    from redis import Redis as SyncRedis
    from redis.asyncio import Redis
    from scrapy import Request
    from scrapy.statscollectors import StatsCollector

    from .clock import Clock

logger = logging.getLogger(__name__)

LEASE_META = "_redis_throttle_lease"
# Acknowledgements wait at most this long: after a crash, what finished within it is fetched
# again; one call per interval, whatever the requests per second.
RENEW_INTERVAL = 1.0
# A worker looks for the leases of dead workers this many times per lease TTL.
RECOVERY_LOOKS = 3
# The most acknowledgements in one call (renew_leases.lua's MAX_ACKS), and dead workers
# looked for at once.
ACK_BATCH = 1000
DEAD_BATCH = 8
QUEUE_KINDS = {FifoQueue: "fifo", LifoQueue: "lifo", PriorityQueue: "priority"}


def queue_kind(queue: object) -> str | None:
    """How give_back.lua puts an entry back into *queue* (None: not a queue class of scrapy-redis
    it knows: no leases)."""
    return next((kind for cls, kind in QUEUE_KINDS.items() if type(queue) is cls), None)


class Leases:
    """This worker's leases on the requests of scrapy-redis's *queue* and of *parking_key*."""

    def __init__(
        self,
        server: SyncRedis,
        redis: Redis,
        queue: Any,
        kind: str,
        parking_key: str,
        stats: StatsCollector,
        ttl: float,
        clock: Clock,
    ) -> None:
        self._clock = clock
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.key = leases_key(queue.key, self.worker)
        self.lessees = lessees_key(queue.key)
        self._queue = queue
        self._kind = kind
        self._parking_key = parking_key
        self._stats = stats
        self._ttl = ttl
        self._redis = redis
        self._server = server
        # scrapy-redis's next_request is synchronous: the leased pop is too, one call as before.
        self._pop = server.register_script(load_script("lease_pop.lua"))
        self._renew = lua_script(redis, "renew_leases.lua")
        self._expired = lua_script(redis, "expired_lessees.lua")
        self._give_back = lua_script(redis, "give_back.lua")
        self._acks: list[str] = []
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self.looked = False
        """Whether this worker has looked for the requests of dead workers once (until then,
        its spider does not idle: a fleet restarted after a crash would close on an empty
        queue while their requests wait to be given back)."""

    @property
    def ttl_us(self) -> int:
        return int(self._ttl * 1e6)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    def pop(
        self, original_pop: Callable[[int], Request | None], timeout: int = 0
    ) -> Request | None:
        """The queue's next request, leased (scrapy-redis's ``queue.pop``)."""
        lease = uuid.uuid4().hex
        entry = self._pop(
            keys=[self._queue.key, self.key, self.lessees],
            args=[self._kind, self.worker, lease, self.ttl_us],
        )
        if not entry:
            return self._blocking_pop(original_pop, timeout) if timeout > 0 else None
        request: Request = self._queue._decode_request(entry)
        request.meta[LEASE_META] = lease
        return request

    def _blocking_pop(
        self, original_pop: Callable[[int], Request | None], timeout: int
    ) -> Request | None:
        """An idle worker's wait for a request (SCHEDULER_IDLE_BEFORE_CLOSE): scrapy-redis's
        blocking pop, which no script can do; the request it takes is leased one call later."""
        request = original_pop(timeout)
        if request is not None:
            lease = uuid.uuid4().hex
            score = -request.priority if self._kind == "priority" else 0
            entry = self._queue._encode_request(request)
            self._server.hset(self.key, lease, b"q%d " % score + entry)
            request.meta[LEASE_META] = lease
        return request

    def unpark_keys(self) -> tuple[list[str], list[Any]]:
        """What ``lua/unpark.lua`` takes to lease what it takes out of the parking set."""
        return [self.key, self.lessees], [self.worker, self.ttl_us]

    def acknowledge(self, request: Request) -> None:
        """The engine is done with *request*: its lease goes."""
        self.release(request.meta.pop(LEASE_META, None))

    def release(self, lease: object) -> None:
        """The request leased as *lease* is done with, or safe in Redis again."""
        if isinstance(lease, str):
            self._acks.append(lease)

    async def _loop(self) -> None:
        recovery_interval = self._ttl / RECOVERY_LOOKS
        since_recovery = recovery_interval  # look at once: a fleet restarted after a crash
        while True:
            try:
                await self._flush()
                if since_recovery >= recovery_interval:
                    since_recovery = 0.0
                    try:
                        await self._recover()
                    finally:
                        self.looked = True
                if self._failing:
                    self._failing = False
                    logger.info("Redis throttle: leases renewed again")
            except RedisError as exc:
                self._stats.inc_value(f"{STATS_PREFIX}/leases/errors/{type(exc).__name__}")
                if not self._failing:
                    self._failing = True
                    logger.warning(
                        "Redis throttle: could not renew this worker's leases (%s: %s); "
                        "if this lasts %g s, other workers fetch its requests again",
                        type(exc).__name__,
                        exc,
                        self._ttl,
                    )
            await self._clock.sleep(RENEW_INTERVAL)
            since_recovery += RENEW_INTERVAL

    async def _flush(self, ttl_us: int | None = None) -> int:
        """Acknowledge what is done and renew the rest; the number of leases still held."""
        held = 0
        while True:
            batch, self._acks = self._acks[:ACK_BATCH], self._acks[ACK_BATCH:]
            try:
                held = int(
                    await self._renew(
                        keys=[self.key, self.lessees],
                        args=[self.worker, self.ttl_us if ttl_us is None else ttl_us, *batch],
                    )
                )
            except BaseException:
                self._acks[:0] = batch  # not lost: sent with the next call
                raise
            if not self._acks:
                return held

    async def _recover(self) -> None:
        dead = await self._expired(keys=[self.lessees], args=[DEAD_BATCH])
        for worker in dead:
            name = worker.decode() if isinstance(worker, bytes) else str(worker)
            given = await self._give_back_all(name, own=False)
            if given:
                self._stats.inc_value(f"{STATS_PREFIX}/leases/given_back", given)
                logger.warning(
                    "Redis throttle: gave back %d requests leased by worker %s, which stopped "
                    "renewing its leases %g s ago or more",
                    given,
                    name,
                    self._ttl,
                )

    async def _give_back_all(self, worker: str, own: bool) -> int:
        given = 0
        while True:
            done, left = await self._give_back(
                keys=[self.lessees, leases_key(self._queue.key, worker), self._queue.key,
                      self._parking_key],
                args=[worker, self._kind, "1" if own else "0"],
            )  # fmt: skip
            if int(done) < 0:
                return given  # alive after all: it renewed meanwhile
            given += int(done)
            if not int(left):
                return given

    async def close(self, keep: bool) -> None:
        """At the spider's close: acknowledge what is done and give back what is not (to be
        crawled by the next run when *keep*; else dropped with the queue)."""
        if self._task is not None:
            await cancel_and_wait(self._task, "the lease renewal")
        try:
            await self._flush()
            if keep:
                given = await self._give_back_all(self.worker, own=True)
                if given:
                    self._stats.inc_value(f"{STATS_PREFIX}/leases/given_back_at_close", given)
            else:
                await self._redis.delete(self.key)
            await self._flush(ttl_us=0)
        except RedisError:
            logger.exception(
                "Redis throttle: could not give back this worker's leases at its close; other "
                "workers give them back in %g s",
                self._ttl,
            )
        finally:
            for script in (self._renew, self._expired, self._give_back):
                await script.aclose()
