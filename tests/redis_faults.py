"""Real faults of the throttle's Redis, injected into real crawls.

Shared by ``tests/test_faults.py`` (which asserts) and ``bench/faults.py`` (which tabulates), so
it needs no pytest. The crawl reaches Redis through a :class:`TcpProxy`, so that network faults
can be injected as well as server faults.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from run_demo import busiest_window
from scrapy.crawler import CrawlerRunner
from scrapy.utils.defer import maybe_deferred_to_future
from spiders import BASE_SETTINGS, UrlListSpider

if TYPE_CHECKING:
    from collections.abc import Callable

    from demo_site import Arrival, DemoSite
    from local_redis import RedisServer
    from scrapy.crawler import Crawler
    from tcp_proxy import TcpProxy

RATE = 10.0
"""Requests per second allowed to the faulty domain (burst 1)."""
REQUESTS = 60
FAULT_AFTER = 8
"""Arrivals before the fault is injected."""
FAULT_SECONDS = 2.0
"""The fault lasts this long, or until the throttle noticed it if that takes longer."""
PROBE_INTERVAL = 1.0
MAX_RESERVE = 1.0
"""Short, so that most requests need Redis during the fault instead of holding old tokens."""
WAIT_TIMEOUT = 60.0


@dataclass
class Lab:
    """What faults act on: the throttle's Redis, the proxy in front of it, and a spare Redis
    (the primary that the first one is made a read-only replica of)."""

    server: RedisServer
    proxy: TcpProxy
    spare: RedisServer


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[Lab], object]
    recover: Callable[[Lab], object]
    noticed: bool | None = True
    """Whether the throttle must see errors (``None``: it may, by chance of timing)."""


def _command(*args: Any) -> Callable[[Lab], object]:
    def run(lab: Lab) -> object:
        with lab.server.client() as client:
            return client.execute_command(*args)

    return run


def _nothing(lab: Lab) -> None:
    return None


FAULTS = [
    Fault("killed, restarted", lambda lab: lab.server.stop(), lambda lab: lab.server.start()),
    Fault("stalled (SIGSTOP)", lambda lab: lab.server.pause(), lambda lab: lab.server.resume()),
    # A paused Redis also delays CLIENT UNPAUSE: the pause ends by itself.
    Fault("CLIENT PAUSE", _command("CLIENT", "PAUSE", int(FAULT_SECONDS * 1000), "ALL"), _nothing),
    Fault(
        "READONLY replica",
        lambda lab: _command("REPLICAOF", "127.0.0.1", lab.spare.port)(lab),
        _command("REPLICAOF", "NO", "ONE"),
    ),
    Fault(
        "OOM (maxmemory)",
        _command("CONFIG", "SET", "maxmemory", "1"),
        _command("CONFIG", "SET", "maxmemory", "0"),
    ),
    Fault("SCRIPT FLUSH", _command("SCRIPT", "FLUSH"), _nothing, noticed=False),
    Fault("connections reset", lambda lab: lab.proxy.drop_connections(), _nothing, noticed=None),
    Fault(
        "connections refused",
        lambda lab: lab.proxy.refuse(True),
        lambda lab: lab.proxy.refuse(False),
    ),
    Fault(
        "network black hole",
        lambda lab: lab.proxy.blackhole(True),
        lambda lab: lab.proxy.blackhole(False),
    ),
    Fault(
        "+200 ms latency each way",
        lambda lab: setattr(lab.proxy, "latency", 0.2),
        lambda lab: setattr(lab.proxy, "latency", 0.0),
        noticed=False,
    ),
]


@dataclass
class FaultRun:
    fault: Fault
    policy: str
    host: str
    expected: list[str]
    arrivals: list[Arrival]
    injected: float
    """Wall-clock time the fault began."""
    recovered: float
    back_at: float | None
    """Wall-clock time the throttle logged that Redis is back."""
    stats: dict[str, Any]

    @property
    def lost(self) -> list[str]:
        return sorted(set(self.expected) - {a.path for a in self.arrivals})

    @property
    def duplicated(self) -> list[str]:
        return sorted(path for path, n in Counter(a.path for a in self.arrivals).items() if n > 1)

    @property
    def during_fault(self) -> list[float]:
        return [a.wall_time for a in self.arrivals if self.injected <= a.wall_time < self.recovered]

    def busiest_second_during_fault(self) -> int:
        return busiest_window(self.during_fault, 1.0)

    @property
    def return_time(self) -> float | None:
        """Seconds from the end of the fault to shared limits again."""
        return None if self.back_at is None else max(0.0, self.back_at - self.recovered)

    @property
    def outages(self) -> int:
        return int(self.stats.get("redis_throttle/outages", 0))


def policy_bound(policy: str, workers: int = 1) -> float | None:
    """Most arrivals a policy lets into any 1 s window of a fault (``None``: no bound)."""
    if policy == "open":
        return None
    # One token of burst, and one more at each switch between shared and local pacing.
    return RATE * 1.0 + 1 + workers


class _BackRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.back_at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "is back after" in record.getMessage():
            self.back_at = record.created


async def wait_for(predicate: Callable[[], object], message: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_TIMEOUT
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {WAIT_TIMEOUT} s waiting for {message}")
        await asyncio.sleep(0.02)


def fault_settings(redis_url: str, policy: str, **overrides: Any) -> dict[str, Any]:
    return {
        **BASE_SETTINGS,
        "REDIS_URL": redis_url,
        "SCHEDULER": "scrapy_redis_throttle.ThrottleScheduler",
        "REDIS_THROTTLE_ON_REDIS_ERROR": policy,
        "REDIS_THROTTLE_PROBE_INTERVAL": PROBE_INTERVAL,
        "REDIS_THROTTLE_MAX_RESERVE": MAX_RESERVE,
        "LOG_LEVEL": "INFO",
        **overrides,
    }


async def run_fault(
    lab: Lab,
    site: DemoSite,
    host: str,
    fault: Fault,
    policy: str,
    seconds: float = FAULT_SECONDS,
) -> FaultRun:
    """Crawl REQUESTS pages of *host* at RATE through the proxy; inject *fault* after
    FAULT_AFTER arrivals, recover after *seconds* (or once noticed), finish the crawl."""
    recorder = _BackRecorder()
    logger = logging.getLogger("scrapy_redis_throttle")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(recorder)
    try:
        runner = CrawlerRunner(fault_settings(lab.proxy.url, policy))
        crawler: Crawler = runner.create_crawler(UrlListSpider)
        paths = [f"/page/{n}" for n in range(REQUESTS)]
        crawl = runner.crawl(
            crawler,
            requests=[{"url": site.url(host, path)} for path in paths],
            redis_throttle_rates={host: f"{RATE:g}/s"},
        )
        await wait_for(lambda: len(site.arrivals(host)) >= FAULT_AFTER, "the first arrivals")
        injected = time.time()
        # In a thread: the reactor must go on as in a real outage, not wait for the harness.
        await asyncio.to_thread(fault.inject, lab)

        def over() -> bool:
            noticed = crawler.stats.get_value("redis_throttle/outages", 0) > 0
            return time.time() >= injected + seconds and (noticed or not fault.noticed)

        await wait_for(over, f"the throttle to notice {fault.name}")
        recovered = time.time()
        await asyncio.to_thread(fault.recover, lab)
        await maybe_deferred_to_future(crawl)
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
    return FaultRun(
        fault=fault,
        policy=policy,
        host=host,
        expected=paths,
        arrivals=site.arrivals(host),
        injected=injected,
        recovered=recovered,
        back_at=recorder.back_at,
        stats=crawler.stats.get_stats(),
    )
