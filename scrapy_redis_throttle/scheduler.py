"""Schedulers with a parking area for requests whose domain has no budget for a while.

A request waiting inside a downloader middleware holds one of the ``CONCURRENT_REQUESTS`` units,
so a slow domain's waiting requests would stall every other domain. With one of these
schedulers, the middleware hands such a request back (with its tokens reserved for a moment in
the future); the scheduler keeps it aside, not in the downloader, and gives it back to the engine
shortly before that moment.

* :class:`ThrottleScheduler`: Scrapy's own scheduler; parked requests wait in this process.
* :class:`RedisThrottleScheduler`: scrapy-redis's scheduler; parked requests wait in a sorted set
  in scrapy-redis's Redis (beside its queue) scored by when they are due, shared by the fleet:
  whichever worker is free takes each (exactly one, atomically), and a parked request outlives
  the worker that parked it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import uuid
from collections import deque
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from scrapy.core.scheduler import Scheduler
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from scrapy.utils.request import request_from_dict
from scrapy_redis.scheduler import Scheduler as ScrapyRedisScheduler

from .config import queue_redis_connection
from .connection import connect_url
from .scripts import lua_script

if TYPE_CHECKING:
    from collections.abc import Callable

    from redis.asyncio import Redis
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred

logger = logging.getLogger(__name__)

# Set by the middleware on a request it hands back: {"delay": seconds, "reserved": bool,
# "reserved_at": wall time}.
PARK_META = "_redis_throttle_park"
# Set by the scheduler on a request it gives back: {"go_at": loop time, "reserved": bool,
# "reserved_at": wall time}.
RELEASE_META = "_redis_throttle_release"
# Give parked requests back this long before they are due: the middleware holds them for the
# rest, so that they leave exactly on time however busy the engine is.
RELEASE_AHEAD = 0.5
RELEASE_BATCH = 32
# The least time between two looks for due requests: those due meanwhile are given back
# together, still at least RELEASE_AHEAD - LOOK_INTERVAL early (with one look per request due,
# the parking area cost ~1.6 Redis calls per request more at 35 requests/s: bench/binding.py).
LOOK_INTERVAL = 0.1
# How often a worker looks for requests that other workers parked in Redis.
REDIS_POLL_INTERVAL = 0.25
_ID_BYTES = 16
# For the few plain commands (ZREM of a failed park, ZCARD and DEL at the close): the scripts
# have a connection each.
PARKING_CONNECTIONS = 2
# Tries to make sure a request whose parking failed is not parked after all.
FORGET_ATTEMPTS = 5
# How soon to look again when the engine could take no request.
BUSY_RETRY = 0.05


class ParkingStore(Protocol):
    @property
    def poll_interval(self) -> float | None:
        """How often to look for requests that other processes parked (``None``: never)."""

    @property
    def parked(self) -> int:
        """Requests parked, as last seen."""

    async def park(self, request: Request, delay: float) -> None: ...

    async def unpark(
        self, ahead: float, limit: int
    ) -> tuple[list[tuple[Request, float]], float | None]:
        """Take out up to *limit* requests due within *ahead* seconds; return them with the
        seconds until each is due, and the seconds until the next one left is due."""
        ...

    async def close(self, keep: bool) -> int:
        """Close the store; unless *keep*, drop what is parked. Return how many were parked."""
        ...


class MemoryParking:
    """Parked requests in this process, in a heap by due time. Those kept at the close go to
    *keep_into* (e.g. the scheduler's own queues, which JOBDIR saves)."""

    poll_interval: float | None = None

    def __init__(self, keep_into: Callable[[Request], object] | None = None) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()
        self._keep_into = keep_into

    @property
    def parked(self) -> int:
        return len(self._heap)

    async def park(self, request: Request, delay: float) -> None:
        due = asyncio.get_running_loop().time() + delay
        heapq.heappush(self._heap, (due, next(self._order), request))

    async def unpark(
        self, ahead: float, limit: int
    ) -> tuple[list[tuple[Request, float]], float | None]:
        now = asyncio.get_running_loop().time()
        due: list[tuple[Request, float]] = []
        while self._heap and len(due) < limit and self._heap[0][0] <= now + ahead:
            when, _, request = heapq.heappop(self._heap)
            due.append((request, when - now))
        return due, (self._heap[0][0] - now if self._heap else None)

    async def close(self, keep: bool) -> int:
        parked = [request for _, _, request in sorted(self._heap)]
        self._heap.clear()
        if keep and self._keep_into is not None:
            for request in parked:
                request.meta.pop(PARK_META, None)
                self._keep_into(request)
        return len(parked)


class RedisParking:
    """Parked requests in a Redis sorted set shared by every worker of the spider."""

    poll_interval: float | None = REDIS_POLL_INTERVAL

    def __init__(self, redis: Redis, key: str, spider: Spider, serializer: Any) -> None:
        self.key = key
        self.parked = 0
        self._redis = redis
        self._spider = spider
        self._serializer = serializer  # scrapy-redis's SCHEDULER_SERIALIZER (pickle by default)
        self._park_script = lua_script(redis, "park.lua")
        self._unpark_script = lua_script(redis, "unpark.lua")

    async def park(self, request: Request, delay: float) -> None:
        encoded = self._serializer.dumps(request.to_dict(spider=self._spider))
        # A unique prefix: two equal requests must stay two members.
        member = uuid.uuid4().bytes + (encoded.encode() if isinstance(encoded, str) else encoded)
        try:
            reply = await self._park_script(keys=[self.key], args=[repr(delay * 1e6), member])
        except (RedisConnectionError, RedisTimeoutError):
            # The reply is lost, not necessarily the park: make sure the request is not in the
            # set before the caller keeps it, or it would be crawled twice.
            await self._forget(member)
            raise
        self.parked = int(reply)

    async def _forget(self, member: bytes) -> None:
        delay = 0.1
        for _ in range(FORGET_ATTEMPTS):
            try:
                await self._redis.zrem(self.key, member)
                return
            except (RedisConnectionError, RedisTimeoutError):
                await asyncio.sleep(delay)
                delay *= 2
        logger.error(
            "Redis throttle: a request whose parking failed may also stay parked in %s and be "
            "crawled twice",
            self.key,
        )

    async def unpark(
        self, ahead: float, limit: int
    ) -> tuple[list[tuple[Request, float]], float | None]:
        reply = await self._unpark_script(keys=[self.key], args=[repr(ahead * 1e6), limit])
        self.parked = int(reply[0])
        next_due = float(reply[1])
        due = []
        for member, due_in_ms in zip(reply[2::2], reply[3::2], strict=True):
            try:
                encoded = member[_ID_BYTES:]
                request = request_from_dict(self._serializer.loads(encoded), spider=self._spider)
            except Exception:
                logger.exception("Redis throttle: dropped a parked request that cannot be read")
                continue
            due.append((request, float(due_in_ms) / 1000))
        return due, (next_due / 1000 if next_due >= 0 else None)

    async def close(self, keep: bool) -> int:
        try:
            parked = int(await self._redis.zcard(self.key))
            if not keep:
                await self._redis.delete(self.key)
            return parked
        finally:
            await self._park_script.aclose()
            await self._unpark_script.aclose()
            await self._redis.aclose(close_connection_pool=True)


class ParkingScheduler:
    """What both schedulers add to the scheduler they extend (a mixin: put it first)."""

    _store: ParkingStore
    _crawler: Crawler

    def _start_parking(self, crawler: Crawler, store: ParkingStore) -> None:
        self._crawler = crawler
        self._store = store
        self._ready: deque[Request] = deque()
        self._parking_tasks: set[asyncio.Task[None]] = set()
        self._wake_up = asyncio.Event()
        self._stopping = False
        self._parks_done = 0
        self._next_look = 0.0  # loop time of the release loop's next look, while it waits
        self._concurrency = crawler.settings.getint("CONCURRENT_REQUESTS")
        self._releaser = asyncio.ensure_future(self._release_loop())

    def enqueue_request(self, request: Request) -> bool:
        if RELEASE_META in request.meta:  # given back by _release_loop, through engine.crawl()
            self._ready.append(request)
            return True
        park = request.meta.get(PARK_META)
        if park is None:
            return super().enqueue_request(request)  # type: ignore[misc,no-any-return]
        task = asyncio.ensure_future(self._park(request, park["delay"]))
        self._parking_tasks.add(task)
        task.add_done_callback(self._parking_tasks.discard)
        return True

    async def _park(self, request: Request, delay: float) -> None:
        try:
            await self._store.park(request, delay)
        except Exception:
            # Not lost: the middleware holds it until its moment instead.
            logger.exception(
                "Redis throttle: could not park %s; it waits in the downloader", request
            )
            self._give_back(request, delay)
            return
        self._parks_done += 1
        self._crawler.stats.inc_value("redis_throttle/parked")
        if asyncio.get_running_loop().time() + delay - RELEASE_AHEAD < self._next_look:
            # Due before the release loop looks again (a park done while it looks is seen by
            # _release_due itself): one more unpark call, only then.
            self._wake_up.set()

    def next_request(self) -> Request | None:
        if self._ready:
            return self._ready.popleft()
        return super().next_request()  # type: ignore[misc,no-any-return]

    def has_pending_requests(self) -> bool:
        return (
            bool(self._ready or self._parking_tasks or self._store.parked)
            or self._wake_up.is_set()  # a park that the parked count may not show yet
            or super().has_pending_requests()  # type: ignore[misc]
        )

    def _give_back(self, request: Request, due_in: float) -> None:
        park = request.meta.pop(PARK_META)
        request.meta[RELEASE_META] = {
            "go_at": asyncio.get_running_loop().time() + due_in,
            "reserved": park["reserved"],
            "reserved_at": park.get("reserved_at", 0.0),
        }
        # engine.crawl() queues it (enqueue_request above) and wakes the engine up.
        self._crawler.engine.crawl(request)

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
        # Stopped by a flag, not by cancelling: a cancellation can get lost inside wait_for().
        while not self._stopping:
            self._wake_up.clear()
            timeout = await self._release_due()
            self._next_look = asyncio.get_running_loop().time() + timeout
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_up.wait(), timeout)

    async def _release_due(self) -> float:
        """Give back what is due and there is room for; return how long to wait until next."""
        room = self._room()
        if not room:
            return BUSY_RETRY
        parks_before = self._parks_done
        try:
            due, next_due = await self._store.unpark(RELEASE_AHEAD, room)
        except Exception:
            logger.exception("Redis throttle: could not look for parked requests")
            return self._store.poll_interval or 1.0
        if self._parks_done != parks_before:
            self._wake_up.set()  # a park crossed this look: look again, its count may be missing
        for request, due_in in due:
            if self._stopping:  # the engine is closing: park them again in _stop_parking()
                self._ready.append(request)
                continue
            try:
                self._give_back(request, due_in)
            except Exception:
                logger.exception("Redis throttle: could not give back %s", request)
        if len(due) == room:
            return 0.0
        timeout = self._store.poll_interval or 1.0
        if next_due is not None:
            timeout = min(timeout, max(LOOK_INTERVAL, next_due - RELEASE_AHEAD))
        return timeout

    async def _stop_parking(self, keep: bool) -> None:
        self._stopping = True
        self._wake_up.set()
        try:
            await self._releaser
        except Exception:
            logger.exception("Redis throttle: the parking area's release loop failed")
        if self._parking_tasks:
            await asyncio.gather(*self._parking_tasks, return_exceptions=True)
        try:
            # Given back but not yet taken by the engine: park them again, due at once.
            for request in self._ready:
                request.meta[PARK_META] = {"delay": 0.0, "reserved": False}
                request.meta.pop(RELEASE_META, None)
                await self._store.park(request, 0.0)
            self._ready.clear()
            parked = await self._store.close(keep)
        except Exception:
            logger.exception("Redis throttle: could not close the parking area")
            return
        if not parked:
            return
        if keep:
            logger.info("Redis throttle: %d parked requests are kept for the next run", parked)
        else:
            self._crawler.stats.set_value("redis_throttle/parked_not_crawled", parked)
            logger.warning(
                "Redis throttle: %d parked requests were not crawled (they were waiting for "
                "their domains' budgets when the spider closed)",
                parked,
            )


class ThrottleScheduler(ParkingScheduler, Scheduler):
    """Scrapy's scheduler, with parked requests kept in this process. With ``JOBDIR`` they are
    saved with the rest of the queue when the spider closes.

    ``SCHEDULER = "scrapy_redis_throttle.ThrottleScheduler"``
    """

    def open(self, spider: Spider) -> Deferred[None] | None:
        result = super().open(spider)
        self._start_parking(spider.crawler, MemoryParking(keep_into=self._keep_in_jobdir))
        return result

    def _keep_in_jobdir(self, request: Request) -> None:
        # Its URL is already in the dupefilter's requests.seen: let it through once more.
        self.enqueue_request(request.replace(dont_filter=True))

    def close(self, reason: str) -> Deferred[None] | None:
        return deferred_from_coro(self._close(reason))

    async def _close(self, reason: str) -> None:
        # Parking first: the disk queues must still be open to keep the parked requests.
        await self._stop_parking(keep=self.dqs is not None)
        parent = super().close(reason)
        if parent is not None:
            await maybe_deferred_to_future(parent)


class RedisThrottleScheduler(ParkingScheduler, ScrapyRedisScheduler):  # type: ignore[misc]
    """scrapy-redis's scheduler, with parked requests kept in Redis (key ``<queue key>:parked``)
    for the whole fleet. With ``SCHEDULER_PERSIST = True`` they stay there when the spider closes.

    ``SCHEDULER = "scrapy_redis_throttle.RedisThrottleScheduler"``
    """

    def open(self, spider: Spider) -> None:
        super().open(spider)
        crawler = spider.crawler
        if not crawler.settings.getbool("REDIS_THROTTLE_ENABLED", True):
            self._start_parking(crawler, MemoryParking())  # nothing will be parked
            return
        # In scrapy-redis's Redis, with the queue (not in the throttle's, which may be another):
        # parked requests are part of the queue and share its fate.
        url, params = queue_redis_connection(crawler.settings)
        key = self._parked_key(spider)
        # The queue's serializer: SCHEDULER_SERIALIZER, or scrapy-redis's default (pickle).
        store = RedisParking(connect_url(url, params, PARKING_CONNECTIONS), key, spider,
                             self.queue.serializer)  # fmt: skip
        # Known from the start, so that the spider neither closes nor idles on a guess (read
        # synchronously, as scrapy-redis itself reads its queue's length at start).
        store.parked = int(self.server.zcard(key))
        self._start_parking(crawler, store)

    def _parked_key(self, spider: Spider) -> str:
        return f"{self.queue_key % {'spider': spider.name}}:parked"

    def flush(self) -> None:
        """Also empty the parking area (``SCHEDULER_FLUSH_ON_START``, and closes without
        ``SCHEDULER_PERSIST``)."""
        super().flush()
        self.server.delete(self._parked_key(self.spider))

    def close(self, reason: str) -> Deferred[None]:
        return deferred_from_coro(self._close(reason))

    async def _close(self, reason: str) -> None:
        # Parking first: without SCHEDULER_PERSIST, scrapy-redis's close flushes the parked set.
        await self._stop_parking(keep=self.persist)
        super().close(reason)
