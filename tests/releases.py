"""A Scrapy extension for the tests: when each request left the throttle for the download, and
the moments the throttle missed, per domain; in a ``RELEASES_DIR``, also the moments it reserved
(a killed worker's are lost with the requests it had not parked yet). Every test crawl has it
(``spiders.BASE_SETTINGS`` and ``crawl_worker.py``); a fleet of ``scrapy crawl shop`` processes
takes it with ``-s EXTENSIONS=...`` and ``-s RELEASES_DIR=<path>``.

Tests judge pacing by these release times, not by when the site saw the requests: Scrapy's
``request_reached_downloader`` comes right after the downloader middlewares, while a request's
arrival at the site comes later by the time its connection takes, which is the machine's
latency, not the throttle's (a new connection took up to 95 ms in a busy process). The site's
arrivals are still checked: none may come before its release (``support.assert_released``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scrapy import Request, signals
from scrapy.utils.httpobj import urlparse_cached

from scrapy_redis_throttle import waiting

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

# Stats: {host: [wall times]} and {domain: count}; from read_dir, also {domain: [[wall time,
# URL]]} of the moments reserved and of the releases, and the process's PID.
RELEASED = "test/released"
MISSED = "test/missed"
RESERVED = "test/reserved"
RELEASED_URLS = "test/released_urls"
PID = "test/pid"
EXTENSION = {f"{__name__}.Releases": 0}
MISSED_MESSAGE = "Redis throttle: a request missed its moment"
# The debug records of a request given a moment (held, or parked: a moment is reserved for it
# unless it must wait over REDIS_THROTTLE_MAX_RESERVE), and their wait in "delay".
RESERVED_MESSAGES = ("Redis throttle: %(request)s waits ", "Redis throttle: %(request)s parked ")


class Releases(logging.Handler):
    """Keeps them in the crawl's stats, and with the setting ``RELEASES_DIR`` writes them
    there too as they come (a line each: a killed worker leaves what it did), for a crawl
    whose stats the test cannot read (``scrapy crawl``; see :func:`read_dir`)."""

    # Its methods' names are public: logging.Handler has private attributes (_closed...).
    def __init__(self, crawler: Crawler) -> None:
        super().__init__(logging.DEBUG)
        self._crawler = crawler
        self.released: defaultdict[str, list[float]] = defaultdict(list)
        self.missed: Counter[str] = Counter()
        directory = crawler.settings.get("RELEASES_DIR")
        self._log = (
            (Path(directory) / f"releases-{os.getpid()}.jsonl").open("a", buffering=1)
            if directory
            else None
        )
        crawler.signals.connect(self.request_reached, signal=signals.request_reached_downloader)
        crawler.signals.connect(self.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self.spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Releases:
        return cls(crawler)

    def request_reached(self, request: Request) -> None:
        url = urlparse_cached(request)
        if url.path != "/robots.txt":  # Scrapy's, not the crawl's (tests judge pages)
            self._add(RELEASED, url.hostname or "", time.time(), request.url)

    def emit(self, record: logging.LogRecord) -> None:
        message, args = str(record.msg), record.args
        if not isinstance(args, Mapping):
            return
        if message.startswith(MISSED_MESSAGE):
            self._add(MISSED, str(args["domain"]), time.time())
        elif message.startswith(RESERVED_MESSAGES):
            request, delay = args["request"], args["delay"]
            assert isinstance(request, Request)
            assert isinstance(delay, float)
            self._add(RESERVED, str(args["domain"]), record.created + delay, request.url)

    def _add(self, kind: str, domain: str, at: float, url: str | None = None) -> None:
        if kind == RELEASED:
            self.released[domain].append(at)
        elif kind == MISSED:
            self.missed[domain] += 1
        if self._log is not None:
            self._log.write(json.dumps([kind, domain, at, url]) + "\n")

    def spider_opened(self) -> None:
        logger = logging.getLogger(waiting.__name__)
        logger.setLevel(logging.DEBUG)  # the missed moments are debug records
        logger.addHandler(self)

    def spider_closed(self) -> None:
        logger = logging.getLogger(waiting.__name__)
        logger.removeHandler(self)
        if not any(isinstance(handler, Releases) for handler in logger.handlers):
            logger.setLevel(logging.NOTSET)
        stats = self._crawler.stats
        assert stats is not None
        stats.set_value(RELEASED, dict(self.released))
        stats.set_value(MISSED, dict(self.missed))
        if self._log is not None:
            self._log.close()


def read_dir(directory: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """What the crawls with ``RELEASES_DIR`` = *directory* wrote, as stats (one per process),
    from *since* (wall time) on."""
    every = []
    for path in sorted(directory.glob("releases-*.jsonl")):
        released: defaultdict[str, list[float]] = defaultdict(list)
        missed: Counter[str] = Counter()
        urls: dict[str, defaultdict[str, list[tuple[float, str]]]] = {
            RESERVED: defaultdict(list),
            RELEASED_URLS: defaultdict(list),
        }
        for line in path.read_text().splitlines():
            kind, domain, at, url = json.loads(line)
            if at < since:
                continue
            if kind == RELEASED:
                released[domain].append(at)
                urls[RELEASED_URLS][domain].append((at, url))
            elif kind == MISSED:
                missed[domain] += 1
            else:
                urls[RESERVED][domain].append((at, url))
        every.append(
            {
                RELEASED: dict(released),
                MISSED: dict(missed),
                **{kind: dict(each) for kind, each in urls.items()},
                PID: int(path.stem.removeprefix("releases-")),
            }
        )
    return every
