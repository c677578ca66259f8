"""The scheduler's side of parking: a scheduler composed of the project's own and, once the
throttle attaches one, a parking area (see :mod:`.parking`).

The add-on makes it ``SCHEDULER``, with the project's scheduler as
``REDIS_THROTTLE_SCHEDULER``: Scrapy builds it, and it builds and delegates to the project's.
With the middleware line alone the engine has already built the project's scheduler, and no
public hook comes before it does: :func:`.engine_hooks.attach` then binds a
:class:`ParkingScheduler`'s methods onto that scheduler instead. Either way the same code
decides.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from scrapy.core.scheduler import BaseScheduler
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from scrapy.utils.misc import build_from_crawler

from .config import inner_scheduler
from .leases import LEASE_META
from .redis_settings import queue_redis_location
from .scrapy_internals import waits_when_idle, without_idle_wait

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

    from .parking import ParkingArea

logger = logging.getLogger(__name__)

# The methods of the project's scheduler that parking takes part in.
PARKING_METHODS = ("enqueue_request", "next_request", "has_pending_requests", "close")


def composes_parking(scheduler: object) -> bool:
    """Whether *scheduler* (a class or an instance) is a :class:`ParkingScheduler`: by its
    classes, not ``issubclass``, which Scrapy's BaseScheduler answers for any class that has a
    scheduler's methods."""
    cls = scheduler if isinstance(scheduler, type) else type(scheduler)
    return ParkingScheduler in cls.__mro__


class ParkingScheduler(BaseScheduler):
    """The scheduler *inner*, with a parking area once :meth:`park_with` gives it one: requests
    with a ticket to park go to the parking area before *inner* sees them, those due come back
    ahead of its own, the spider stays open while any are parked, and at the close what is
    parked is kept or dropped before *inner* closes (JOBDIR's queues must still be open to keep
    them). Anything else is *inner*'s."""

    def __init__(self, inner: BaseScheduler) -> None:
        self.inner = inner
        # Its own methods, taken now: bound onto *inner* (see engine_hooks.attach), these are
        # still its own.
        self._enqueue = inner.enqueue_request
        self._next = inner.next_request
        self._pending = inner.has_pending_requests
        self._close = getattr(inner, "close", None)
        self._area: ParkingArea | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        """The scheduler ``REDIS_THROTTLE_SCHEDULER`` names, built as Scrapy builds its
        ``SCHEDULER``, composed with parking. scrapy-redis's reaches its Redis there: if that
        fails, the worker cannot crawl (its queue is in that Redis), and stops; one ERROR line
        says why before Scrapy's own traceback, which ends in a secondary error."""
        inner = inner_scheduler(crawler.settings, ParkingScheduler)
        try:
            return cls(build_from_crawler(inner, crawler))
        except RedisError as exc:
            logger.error(
                "Redis throttle: the worker stops: %(scheduler)s cannot reach its Redis at "
                "%(url)s (REDIS_URL): %(error)s",
                {
                    "scheduler": f"{inner.__module__}.{inner.__qualname__}",
                    "url": queue_redis_location(crawler.settings),
                    "error": f"{type(exc).__name__}: {exc}",
                },
            )
            raise

    def park_with(self, area: ParkingArea) -> None:
        self._area = area

    def __getattr__(self, name: str) -> Any:
        # What the engine, extensions and the project read of their scheduler (scrapy-redis's
        # queue and server, Scrapy's dqs and mqs, ...) is the inner scheduler's.
        if name == "inner":  # (not set yet: during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def open(self, spider: Spider) -> Deferred[None] | None:
        open_inner = getattr(self.inner, "open", None)
        return None if open_inner is None else open_inner(spider)

    def enqueue_request(self, request: Request) -> bool:
        area = self._area
        if area is not None and (taken := area.enqueue_request(request)) is not None:
            return taken
        # A retry, a redirect or a request given back: once in the queue, the lease it carries
        # (its original's) goes; popped again, it is leased again.
        lease = request.meta.pop(LEASE_META, None)
        queued = self._enqueue(request)
        if area is not None and area.leases is not None:
            area.leases.release(lease)
        return queued

    def next_request(self) -> Request | None:
        area = self._area
        if area is None:
            return self._next()
        # scrapy-redis's SCHEDULER_IDLE_BEFORE_CLOSE: with an empty FIFO or LIFO queue, its
        # next_request blocks the reactor that long (BRPOP) waiting for more, before the spider
        # may idle. While requests download, wait in the throttle or are parked, the spider
        # cannot idle anyway, and the block would only delay them (held requests wake late,
        # parked ones come back late: their moments are missed).
        if not (
            waits_when_idle(self.inner) and (area.handoff.busy() or area.has_pending_requests())
        ):
            return area.handoff.next_request(self._next)
        with without_idle_wait(self.inner):
            return area.handoff.next_request(self._next)

    def has_pending_requests(self) -> bool:
        area = self._area
        return (area is not None and area.has_pending_requests()) or self._pending()

    def close(self, reason: str) -> Deferred[None] | None:
        if self._area is None:  # (its close, as it is: some are expected to act at once)
            return None if self._close is None else self._close(reason)
        return deferred_from_coro(self._close_both(self._area, reason))

    async def _close_both(self, area: ParkingArea, reason: str) -> None:
        try:
            await area.stop()  # first: the inner close may flush or save its queue
        finally:
            if self._close is not None and (result := self._close(reason)) is not None:
                await maybe_deferred_to_future(result)
