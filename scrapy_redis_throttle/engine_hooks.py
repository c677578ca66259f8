"""Where the throttle hooks into Scrapy's engine and scheduler: the parking area and the leases
are attached to the scheduler the engine runs, whatever its class. With the add-on, that is a
:class:`.ParkingScheduler` (through the public ``SCHEDULER`` setting), which parks with it.
With the middleware line alone, the engine built the project's scheduler before any public hook
runs, and a ParkingScheduler's methods are bound on that instance.

What it changes on live objects, checked against Scrapy 2.14 to 2.19 and scrapy-redis 0.9.1
(``tox -e min``, ``py``, ``peers``, ``peers-min``):

* with the middleware line alone, the scheduler's ``enqueue_request``, ``next_request``,
  ``has_pending_requests`` and ``close``, bound on its instance;
* scrapy-redis's ``queue.pop``, wrapped on its instance for the leases;
* the engine's end of a request (see :func:`.on_request_done`): a lease is acknowledged there.

What Scrapy and scrapy-redis do not make public is read through :mod:`.scrapy_internals`.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, cast

from scrapy_redis.scheduler import Scheduler as ScrapyRedisScheduler

from .connection import connect_url
from .errors import ThrottleConfigError
from .leases import Leases, queue_kind
from .parking import ParkingArea
from .parking_scheduler import PARKING_METHODS, ParkingScheduler, composes_parking
from .parking_stores import MemoryParking
from .redis_parking import RedisParking
from .redis_schema import leases_key, lessees_key, moments_key, parking_key
from .scrapy_internals import engine_scheduler, on_request_done

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from scrapy import Request
    from scrapy.core.scheduler import BaseScheduler
    from scrapy.crawler import Crawler

    from .clock import Clock
    from .config import ThrottleConfig
    from .metrics import ThrottleMetrics
    from .parking import Unreserve
    from .rejections import Rejections
    from .resilience import ResilientBucket
    from .seals import Seals

logger = logging.getLogger(__name__)

# For the plain commands (ZCARD and DEL at the close): the scripts have a connection each.
PARKING_CONNECTIONS = 1


def attach_parking(
    crawler: Crawler,
    config: ThrottleConfig,
    rejections: Rejections,
    clock: Clock,
    bucket: ResilientBucket,
    metrics: ThrottleMetrics,
) -> ParkingArea | None:
    """A parking area attached to the scheduler the engine runs (None: there is none, or it
    could not be attached; waiting requests are then held in the downloader, and a WARNING
    says so)."""
    scheduler = engine_scheduler(crawler)
    extra = {"spider": crawler.spider}
    if scheduler is None:  # not Scrapy's engine: requests wait in the downloader
        logger.warning(
            "Redis throttle: found no scheduler to park waiting requests beside; they wait "
            "in the downloader, holding its slots",
            extra=extra,
        )
        return None
    try:
        return attach(
            crawler,
            config,
            scheduler,
            rejections,
            clock,
            bucket.unreserve,
            bucket.lost_state.seals,
            metrics,
        )
    except Exception:
        # Without parking the throttle still works: the rest of the start must happen.
        logger.exception(
            "Redis throttle: could not attach the parking area to %s; waiting requests "
            "wait in the downloader, holding its slots",
            type(scheduler).__name__,
            extra=extra,
        )
        return None


def attach(
    crawler: Crawler,
    config: ThrottleConfig,
    scheduler: BaseScheduler,
    rejections: Rejections,
    clock: Clock,
    unreserve: Unreserve | None = None,
    seals: Seals | None = None,
    metrics: ThrottleMetrics | None = None,
) -> ParkingArea:
    """Attach a parking area to the engine's *scheduler*, whatever its class: a
    :class:`.ParkingScheduler` (the add-on's) parks with it; any other is made to decide as one
    (its methods that parking takes part in are bound on this instance, where the engine calls
    them), so that parked requests are taken before the scheduler sees them, come back ahead of
    its own, keep the spider open, and are kept or dropped at its close as its own queue is."""
    composed = cast("ParkingScheduler", scheduler) if composes_parking(scheduler) else None
    if composed is not None:
        scheduler = composed.inner
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
            metrics=metrics,
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
            metrics=metrics,
        )
    if composed is None:
        composed = bind_parking(scheduler)
    composed.park_with(area)
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
    leases = (
        None
        if kind is None
        else Leases(scheduler.server, redis, queue, kind, parking, crawler.stats, ttl, clock)
    )
    if leases is None or not on_request_done(crawler, leases.acknowledge):
        logger.warning(
            "Redis throttle: no leases on the requests of %s (a queue class of scrapy-redis, "
            "and Scrapy's engine, are needed): a worker that dies loses those it took",
            type(queue).__name__,
        )
        return None
    queue.pop = functools.partial(leases.pop, queue.pop)
    leases.start()
    return leases


def bind_parking(scheduler: BaseScheduler) -> ParkingScheduler:
    """Make *scheduler*, which the engine already runs, decide as a :class:`.ParkingScheduler`
    composed of itself: its methods that parking takes part in become that one's, on this
    instance. Until the ParkingScheduler parks with an area, they are the scheduler's own."""
    composed = ParkingScheduler(scheduler)
    for name in PARKING_METHODS:
        setattr(scheduler, name, getattr(composed, name))
    return composed
