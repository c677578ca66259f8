"""What the unit tests drive the throttle's decisions with: a clock whose time moves only when a
test says, a bucket in memory (the scripts' algorithm, see :class:`.LocalBuckets`) and a fake
engine. Nothing here sleeps, starts a server or opens a socket."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from scrapy import Request, Spider
from scrapy.addons import AddonManager
from scrapy.core.scheduler import BaseScheduler
from scrapy.crawler import Crawler
from scrapy.settings import Settings
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.test import get_crawler

from scrapy_redis_throttle.addon import Addon
from scrapy_redis_throttle.budgets import Budget, RequestBudget
from scrapy_redis_throttle.clock import Clock
from scrapy_redis_throttle.config import ThrottleConfig
from scrapy_redis_throttle.live_limits import NOTHING_LIVE, LiveLimit
from scrapy_redis_throttle.local_buckets import LocalBuckets
from scrapy_redis_throttle.metrics import ThrottleMetrics
from scrapy_redis_throttle.parking import ParkingArea
from scrapy_redis_throttle.parking_stores import MemoryParking
from scrapy_redis_throttle.pauses import Pause
from scrapy_redis_throttle.rates import Limit, parse_limit
from scrapy_redis_throttle.replies import AcquireResult, Reservation, Unreserved, Voiding
from scrapy_redis_throttle.resilience import ResilientBucket
from scrapy_redis_throttle.server_clock import ServerClock
from scrapy_redis_throttle.throttle import Throttle as RealThrottle
from scrapy_redis_throttle.tickets import TICKET_META, Ticket

_T = TypeVar("_T")

# Loop turns given to the tasks woken at one moment, to run until they wait again: each await of
# a fake sleep, a future or an event is a few turns; the decisions here take fewer than 20.
SETTLE_TURNS = 50
START_WALL = 1_800_000_000.0
START_MONOTONIC = 1_000.0
# No Redis answers there: a client the unit tests build is never called (its scripts stand in).
NO_REDIS = "redis://127.0.0.1:1/0"


async def settle() -> None:
    """Let every task that can run, run until it waits (on the fake clock, or for good)."""
    for _ in range(SETTLE_TURNS):
        await asyncio.sleep(0)


class FakeClock(Clock):
    """Time that stands still until :meth:`advance` or :meth:`run` moves it; wall time moves
    with monotonic time, from :data:`START_WALL`."""

    def __init__(self) -> None:
        self.now = START_MONOTONIC
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def wall(self) -> float:
        return self.now - START_MONOTONIC + START_WALL

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> asyncio.Future[None]:
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now + max(seconds, 0.0), next(self._order), wake))
        return wake

    @property
    def sleeping(self) -> list[float]:
        """When each sleep under way ends, earliest first."""
        return sorted(at for at, _, wake in self._timers if not wake.done())

    async def advance(self, seconds: float) -> None:
        """Move time *seconds* on, waking each sleep at its end, in order."""
        end = self.now + seconds
        await settle()
        while self._timers and self._timers[0][0] <= end:
            at, _, wake = heapq.heappop(self._timers)
            if wake.done():  # cancelled
                continue
            self.now = max(self.now, at)
            wake.set_result(None)
            await settle()
        self.now = end
        await settle()

    async def run(self, awaitable: Awaitable[_T], limit: float = 3600.0) -> _T:
        """Await *awaitable*, moving time from one sleep's end to the next while it waits; fail
        if it waits for anything else, or longer than *limit* seconds."""
        task = asyncio.ensure_future(awaitable)
        deadline = self.now + limit
        await settle()
        while not task.done():
            sleeping = self.sleeping
            if not sleeping:
                task.cancel()
                raise AssertionError("it waits for something other than the clock")
            if sleeping[0] > deadline:
                task.cancel()
                raise AssertionError(f"still waiting after {limit} s")
            await self.advance(sleeping[0] - self.now)
        return task.result()


def limit(text: str, burst: int = 1) -> Limit:
    """A limit as a spider would write it (a rate, with a burst)."""
    parsed = parse_limit({"rate": text, "burst": burst}, default_burst=1, source="test")
    assert parsed is not None
    return parsed


def throttle_config(**settings: Any) -> ThrottleConfig:
    return ThrottleConfig.from_settings(Settings(settings))


def stats() -> MemoryStatsCollector:
    return MemoryStatsCollector(get_crawler())


class FakeDownloader:
    def __init__(self) -> None:
        self.active: set[Request] = set()


class FakeEngine:
    """What the parking area asks of Scrapy's engine: room, and taking a request back
    (``crawl()``, which hands it to the scheduler's ``enqueue_request``)."""

    def __init__(self) -> None:
        self.downloader = FakeDownloader()
        self.backout = False
        self.enqueue: Any = None
        self.crawled: list[Request] = []

    def needs_backout(self) -> bool:
        return self.backout

    def crawl(self, request: Request) -> None:
        self.crawled.append(request)
        if self.enqueue is not None:
            self.enqueue(request)


@dataclass
class FakeCrawler:
    engine: FakeEngine = field(default_factory=FakeEngine)
    stats: MemoryStatsCollector = field(default_factory=stats)


class Fleet:
    """A fleet of *size* workers, as :class:`.Activity` last saw it (None: not seen)."""

    def __init__(self, size: int | None) -> None:
        self.fleet_size = size


class Throttle:
    """The throttle (:class:`scrapy_redis_throttle.throttle.Throttle`) on the fake clock, its
    scripts in memory (:class:`MemoryScripts`). Redis is never called: the pauses' listener is
    not started, nor the reports."""

    def __init__(
        self, clock: FakeClock | None = None, scripts: MemoryScripts | None = None, **settings: Any
    ) -> None:
        """*clock*, *scripts*: those of another worker's, for a fleet."""
        self.clock = clock or FakeClock()
        self.scripts = scripts or MemoryScripts(self.clock)
        settings.setdefault("REDIS_THROTTLE_URL", NO_REDIS)
        crawler = get_crawler(Spider, settings)
        self.throttle = RealThrottle(
            crawler,
            ThrottleConfig.from_settings(crawler.settings),
            self.clock,
            self.scripts,  # type: ignore[arg-type]
        )
        self.config = self.throttle.config
        self.stats = self.throttle.stats
        self.bucket = self.throttle.bucket
        self.pauses = self.throttle.pauses
        self.turns = self.throttle.turns
        self.metrics = self.throttle.metrics
        # What the pauses void in the parking area (a record of ParkingArea.void's calls).
        self.voidings: list[tuple[str, Pause]] = []
        self.pauses.parking = self

    def void(self, domain: str, pause: Pause) -> None:
        self.voidings.append((domain, pause))

    def stat(self, name: str) -> Any:
        return self.stats.get_value(f"redis_throttle/{name}")

    async def restart_redis_empty(self) -> None:
        """Redis loses the throttle's state (a new secret), and this worker reads it now."""
        await self.bucket.guard.read_state()
        self.scripts.secret = b"t" * 64
        await self.bucket.guard.read_state()

    async def take(
        self,
        request: Request,
        limit: Limit,
        ticket: Ticket | None = None,
        may_park: bool = False,
        domain: str = "a.example",
        cost: float = 1.0,
    ) -> Ticket | None:
        """The request's turn, time moving while it waits: None when it went (at the clock's
        time then), or its ticket."""
        budget = RequestBudget(domain, limit, (), cost)
        return await self.clock.run(self.turns.take(request, budget, ticket, may_park))

    def start(
        self,
        request: Request,
        limit: Limit,
        ticket: Ticket | None = None,
        domain: str = "a.example",
    ) -> asyncio.Task[Ticket | None]:
        """The request's turn, under way while the test moves time itself."""
        turn = self.turns.take(request, RequestBudget(domain, limit), ticket, may_park=False)
        return asyncio.ensure_future(turn)


class MemoryScripts:
    """Stands for :class:`.TokenBucket` (the scripts' calls) behind a :class:`.ResilientBucket`:
    one bucket per domain in memory, by the scripts' algorithm on the fake clock (see
    :class:`.LocalBuckets`). A ConnectionError while not :attr:`up`, a script's refusal while
    :attr:`refusing`. Each acquire is recorded (domain, busy_until); :attr:`answers` are given
    before the bucket's own."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.up = True
        self.refusing = False
        self.bucket = LocalBuckets(clock)
        self.calls: list[tuple[str, float]] = []
        self.asked_at: list[float] = []
        self.answers: list[AcquireResult] = []
        self.probes = 0
        # The fleet's secret in Redis: another one is Redis restarted empty.
        self.secret = b"s" * 64
        self.secret_reads = 0
        # The last voiding of a domain's moments, as Redis keeps it; how often it was read, how
        # long each read takes (a slow Redis), and whether a read fails.
        self.voiding: Voiding | None = None
        self.voiding_reads = 0
        self.voiding_read_time = 0.0
        self.voiding_fails = False
        # Seconds a call takes each way (a slow Redis): it decides halfway through.
        self.latency = 0.0
        # Limits set live (see set_live), by domain.
        self.live: dict[str, Limit] = {}
        self._server_clock = ServerClock()

    def _answer(self) -> None:
        if not self.up:
            raise RedisConnectionError("Connection refused")
        if self.refusing:
            raise ResponseError("redis_throttle: a limit of no rate")

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float = 1,
        reserve: float = 0,
        busy_until: float = 0,
        others: Sequence[tuple[str, Limit, float]] = (),
    ) -> AcquireResult:
        self.calls.append((domain, busy_until))
        self.asked_at.append(self._clock.now)
        self._answer()
        if self.answers:
            return self.answers.pop(0)
        limit = self.live.get(domain, limit)
        if self.latency:
            await self._clock.sleep(self.latency)
        # As token_bucket.lua: a bucket is not full before its busy_until.
        full_at = self.bucket._full_at
        for name, busy in ((domain, busy_until), *((name, busy) for name, _, busy in others)):
            full_at[name] = max(full_at.get(name, 0.0), busy)
        budgets = [Budget(name, each) for name, each, _ in others]
        result = self.bucket.acquire(domain, limit, cost, reserve, 1, budgets)
        # As token_bucket.lua, in the domain's own bucket: its limit set live, told.
        live = self.live.get(domain)
        told = NOTHING_LIVE if live is None else LiveLimit(live.rate, live.burst, paused=False)
        result = replace(result, live=told)
        if not self.latency:
            return result
        decided = replace(result, decided_at=self._clock.now)
        await self._clock.sleep(self.latency)
        return decided

    def set_live(self, domain: str, limit: Limit) -> float:
        """Set *domain*'s limit live, as lua/set_limit.lua does: the bucket forgets the moments
        reserved before. How long they were to last: what the change voids (it publishes it)."""
        now = self._clock.now
        void = max(0.0, self.bucket._full_at.get(domain, now) - now)
        self.bucket._full_at[domain] = now
        self.live[domain] = limit
        return void

    async def probe(self, domain: str | None = None) -> None:
        self.probes += 1
        self._answer()

    def server_clock(self, domain: str) -> ServerClock:
        return self._server_clock

    async def last_voiding(self, domain: str) -> Voiding | None:
        self.voiding_reads += 1
        if self.voiding_read_time:
            await self._clock.sleep(self.voiding_read_time)
        self._answer()
        if self.voiding_fails:
            raise RedisConnectionError("Timeout reading from socket")
        return self.voiding

    async def load_secret(self) -> tuple[bytes, bool]:
        self.secret_reads += 1
        self._answer()
        return self.secret, False

    async def aclose(self) -> None:
        pass


class CutPath:
    """One worker's path to the scripts' Redis (a :class:`MemoryScripts` the fleet shares), which
    the test may cut for that worker alone: while :attr:`cut`, its calls fail as if Redis were
    down."""

    def __init__(self, scripts: MemoryScripts) -> None:
        self.scripts = scripts
        self.cut = False

    def _through(self) -> MemoryScripts:
        if self.cut:
            raise RedisConnectionError("Timeout connecting to server")
        return self.scripts

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float = 1,
        reserve: float = 0,
        busy_until: float = 0,
        others: Sequence[tuple[str, Limit, float]] = (),
    ) -> AcquireResult:
        return await self._through().acquire(domain, limit, cost, reserve, busy_until, others)

    async def probe(self, domain: str | None = None) -> None:
        await self._through().probe(domain)

    def server_clock(self, domain: str) -> ServerClock:
        return self.scripts.server_clock(domain)

    async def load_secret(self) -> tuple[bytes, bool]:
        return await self._through().load_secret()

    async def aclose(self) -> None:
        pass


def refused_by_the_site(sends: list[float], each: Limit) -> list[float]:
    """The sends a site that allows *each* (its rate and burst, GCRA) would answer 429."""
    interval, tat, refused = 1 / each.rate, -math.inf, []
    for at in sorted(sends):
        if max(tat, at) - at > (each.burst - 1) * interval + 1e-9:
            refused.append(at)
        else:
            tat = max(tat, at) + interval
    return refused


def resilient_bucket(
    clock: FakeClock,
    fleet: int | None = 2,
    scripts: MemoryScripts | None = None,
    path: CutPath | None = None,
    **settings: Any,
) -> tuple[ResilientBucket, MemoryScripts, MemoryStatsCollector]:
    """A :class:`.ResilientBucket` on *clock* in a fleet of *fleet* workers, with
    :class:`MemoryScripts` for its calls (*scripts*: those of another worker, the same Redis;
    *path*: reached through it)."""
    scripts = scripts or MemoryScripts(clock)
    collector = stats()
    bucket = ResilientBucket(
        Redis(port=1),  # never called: the scripts stand in
        throttle_config(**settings),
        collector,
        dict,
        clock,
        fleet=Fleet(fleet),
        bucket=path or scripts,  # type: ignore[arg-type]
    )
    return bucket, scripts, collector


RESERVATION = Reservation(after=7_000_000, step=500_000, at=1_000_000)
A = "a.example"


class Yard:
    """A parking area attached as :func:`.engine_hooks.attach` attaches it: the engine's ``crawl()``
    goes to its ``enqueue_request``, and the scheduler's own requests come from
    :attr:`scheduled`."""

    def __init__(
        self,
        keep: bool = False,
        concurrency: int = 16,
        keep_into: Callable[[Request], object] | None = None,
    ) -> None:
        self.clock = FakeClock()
        self.crawler = FakeCrawler()
        self.kept: list[Request] = []
        self.given_back: list[tuple[str, list[Reservation]]] = []
        self.store = MemoryParking(keep_into or self.kept.append, self.clock)
        self.metrics = ThrottleMetrics(on=True)
        self.area = ParkingArea(
            self.crawler,  # type: ignore[arg-type]
            self.store,
            keep=keep,
            concurrency=concurrency,
            clock=self.clock,
            unreserve=self.unreserve,
            metrics=self.metrics,
        )
        self.crawler.engine.enqueue = self.area.enqueue_request
        self.scheduled: list[Request] = []

    async def unreserve(self, domain: str, reservations: list[Reservation]) -> Unreserved:
        self.given_back.append((domain, reservations))
        return Unreserved(len(reservations), 0)

    def ticket(
        self, due_in: float, domain: str = A, reserved: bool = True, age: float = 0.0
    ) -> Ticket:
        wall = self.clock.wall() - age
        reservation = RESERVATION if reserved else None
        due = self.clock.now + due_in
        return Ticket(
            domain=domain,
            due=due,
            reserved=reserved,
            locally=False,
            reserved_at=wall,
            waiting_since=wall,
            reservation=reservation,
        )

    def park(self, ticket: Ticket, n: int = 0) -> Request:
        request = Request(f"http://{ticket.domain}/{n}", meta={TICKET_META: ticket})
        assert self.area.enqueue_request(request) is True
        return request

    def next_request(self) -> Request | None:
        return self.area.handoff.next_request(
            lambda: self.scheduled.pop(0) if self.scheduled else None
        )

    def stat(self, name: str) -> Any:
        return self.crawler.stats.get_value(f"redis_throttle/{name}")


class ListScheduler(BaseScheduler):
    """A scheduler of a list, recording what is done to it (``calls``)."""

    def __init__(self) -> None:
        self.queue: list[Request] = []
        self.calls: list[str] = []
        self.idle_before_close = 0

    def open(self, spider: Spider) -> None:
        self.calls.append("open")

    def close(self, reason: str) -> None:
        self.calls.append(f"close {reason}")

    def has_pending_requests(self) -> bool:
        return bool(self.queue)

    def enqueue_request(self, request: Request) -> bool:
        self.calls.append(f"enqueue {request.url}")
        self.queue.append(request)
        return True

    def next_request(self) -> Request | None:
        self.calls.append(f"next idle_before_close={self.idle_before_close}")
        return self.queue.pop(0) if self.queue else None

    def __len__(self) -> int:
        return len(self.queue)


def with_addon(**project: Any) -> Settings:
    """The settings of a project with *project*'s settings and the add-on, once it updated
    them."""
    settings = Settings()
    settings.setdict({"ADDONS": {Addon: 100}, **project}, priority="project")
    AddonManager(Crawler(Spider, settings)).load_settings(settings)
    return settings
