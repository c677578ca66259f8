"""What the throttle reads or changes of Scrapy and scrapy-redis that they do not make public:
this module alone reaches for it, each read guarded, with what the throttle does where a version
lacks it. Checked against Scrapy 2.14 to 2.19 and scrapy-redis 0.9.1 (``tox -e min``, ``py``,
``peers``, ``peers-min``):

* ``engine._slot.scheduler``, before Scrapy 2.15 made ``engine.scheduler`` public;
* ``engine._slot.closing``: whether the engine closes the spider (Scrapy sends no signal);
* ``engine._slot.remove_request``, the engine's end of a request, wrapped for the leases;
* ``RobotsTxtMiddleware._parsers``, its robots.txt per netloc, from which a host whose
  Crawl-delay is forgotten is dropped;
* scrapy-redis's ``Scheduler.idle_before_close`` (``SCHEDULER_IDLE_BEFORE_CLOSE``), set to 0
  while requests wait in the throttle.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from scrapy.downloadermiddlewares.robotstxt import RobotsTxtMiddleware

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from scrapy import Request
    from scrapy.core.scheduler import BaseScheduler
    from scrapy.crawler import Crawler


def engine_scheduler(crawler: Crawler) -> BaseScheduler | None:
    """The scheduler the engine runs: ``engine.scheduler`` (Scrapy 2.15+), else its slot's
    (None: neither, not Scrapy's engine)."""
    engine = crawler.engine
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None:
        scheduler = getattr(_slot(crawler), "scheduler", None)
    return scheduler


def engine_closing(crawler: Crawler) -> bool:
    """Whether the engine closes the spider (``spider_closed`` comes once the requests in the
    downloader are done): its slot's ``closing`` (False without it)."""
    return getattr(_slot(crawler), "closing", None) is not None


def on_request_done(crawler: Crawler, done: Callable[[Request], None]) -> bool:
    """Call *done* with each request the engine is done with, before the engine's own end of
    it (False: the engine has no such end, and *done* is never called)."""
    slot = _slot(crawler)
    remove_request = getattr(slot, "remove_request", None)
    if not callable(remove_request):
        return False

    def removed(request: Request) -> None:
        done(request)
        remove_request(request)

    slot.remove_request = removed
    return True


def robots_parsers(crawler: Crawler) -> dict[str, object] | None:
    """RobotsTxtMiddleware's robots.txt per netloc (None: the robots.txt middleware is another's,
    or keeps them otherwise)."""
    engine = crawler.engine
    middlewares = [] if engine is None else engine.downloader.middleware.middlewares
    for middleware in middlewares:
        parsers = getattr(middleware, "_parsers", None)
        if isinstance(middleware, RobotsTxtMiddleware) and isinstance(parsers, dict):
            return parsers
    return None


def waits_when_idle(scheduler: BaseScheduler) -> bool:
    """Whether *scheduler*'s ``next_request`` blocks, with an empty queue, for scrapy-redis's
    ``SCHEDULER_IDLE_BEFORE_CLOSE`` (False: it has none, or it is 0)."""
    return bool(getattr(scheduler, "idle_before_close", None))


@contextmanager
def without_idle_wait(scheduler: BaseScheduler) -> Iterator[None]:
    """Within it, *scheduler* (one that :func:`waits_when_idle`) does not block."""
    inner: Any = scheduler
    idle_before_close = inner.idle_before_close
    inner.idle_before_close = 0
    try:
        yield
    finally:
        inner.idle_before_close = idle_before_close


def _slot(crawler: Crawler) -> Any:
    return getattr(crawler.engine, "_slot", None)
