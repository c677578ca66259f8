"""What the throttle does when its Redis fails: a circuit breaker, and the fallback policies.

Every acquire goes to Redis while it answers. The first failure (refused, timed out, stalled,
read-only replica, out of memory, ...) opens the breaker: from then on no request calls Redis.
A probe in the background does, after a delay that doubles up to
``REDIS_THROTTLE_PROBE_INTERVAL``; its first success closes the breaker. The probe spends no
domain's tokens: a request's own acquire would be granted without what the fallback gave out
while the probe was under way. Meanwhile ``REDIS_THROTTLE_ON_REDIS_ERROR`` decides:

* ``"local"`` (default): each domain is paced in this process, at its rate (and burst)
  divided by the number of workers that were live in Redis just before it failed (see
  :attr:`.Activity.fleet_size`; ``REDIS_THROTTLE_FALLBACK_WORKERS`` overrides it), starting
  where the shared bucket was last seen, so that the fleet together keeps the limit. A worker
  that never reached Redis does not know the fleet's size: its requests wait for Redis;
* ``"open"``: requests go unthrottled;
* ``"wait"``: requests wait until Redis answers again.

A failed call is never replayed: a call that timed out may have taken its tokens in Redis, and a
replay would take them twice. The request is decided by the policy instead.

A call a script refuses (its arguments, or what it read, are no limit: ``ERR redis_throttle:
...``), or that met one of the domain's keys holding another type (``WRONGTYPE``: something else
wrote it), is no failure of Redis, which answered: it is that request's problem. The breaker stays
closed, the refusal is counted (``redis_throttle/rejected/script_call``) and logged once per
domain, and the request is paced by this worker alone, at its share (whatever the policy: it
never goes unthrottled, nor asks again at once).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import RedisError, ResponseError

from .across_nodes import CallsStopped
from .bucket import AcquireResult, TokenBucket
from .config import FALLBACK_LOCAL, FALLBACK_OPEN, STATS_PREFIX
from .connection import ping
from .rejections import Rejections
from .seals import Seals
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

    from scrapy.statscollectors import StatsCollector

    from .bucket import Penalty, Reservation, SlowDown, Unreserved, Voiding
    from .clock import Clock
    from .config import ThrottleConfig
    from .connection import ThrottleRedis
    from .rates import Limit
    from .server_clock import ServerClock

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# The first probe of a failed Redis; later ones back off up to REDIS_THROTTLE_PROBE_INTERVAL.
FIRST_PROBE_DELAY = 0.5
# Local buckets that are full again are forgotten once there are this many (or twice as many as
# after the last clean-up): a crawl of millions of domains must not grow without bound.
LOCAL_PRUNE_SIZE = 10_000

# How the scripts' error replies begin, once redis-py has taken "ERR " off; and Redis's reply
# to a script that met a key of another type (something else wrote it): that domain's problem,
# not a failure of Redis.
REFUSAL = "redis_throttle:"
WRONG_TYPE = "WRONGTYPE"


class ScriptRefused(Exception):
    """A script refused a call (see the module's docstring)."""


_ALLOWED = AcquireResult(allowed=True, reserved=False, tokens_left=0, retry_after=0, reset_after=0)


def _later(seconds: float) -> AcquireResult:
    """Nothing reserved: ask again in *seconds* (held or parked meanwhile)."""
    return AcquireResult(False, False, 0.0, seconds, 0.0, paused=True)


class CircuitBreaker:
    """Whether Redis is usable. Closed: requests call it. Open (after a failure): requests do not;
    a probe tries it after a delay that doubles from *first_delay* up to *max_delay*."""

    def __init__(
        self,
        first_delay: float,
        max_delay: float,
        clock: Callable[[], float],
    ) -> None:
        self._first_delay = min(first_delay, max_delay)
        self._max_delay = max_delay
        self._clock = clock
        self.open_since: float | None = None
        self._delay = self._first_delay
        self._closed: list[asyncio.Future[None]] = []

    def open_for(self) -> float | None:
        """Seconds since the breaker opened; ``None`` while it is closed."""
        return None if self.open_since is None else self._clock() - self.open_since

    def failed(self) -> bool:
        """Record a failed call; return whether it opened the breaker (a call that started
        before it opened changes nothing)."""
        if self.open_since is not None:
            return False
        self.open_since = self._clock()
        self._delay = self._first_delay
        return True

    def next_probe_in(self) -> float:
        """Seconds to wait before the next probe; each call doubles the one after."""
        delay = self._delay
        self._delay = min(self._delay * 2, self._max_delay)
        return delay

    def succeeded(self) -> float | None:
        """Record a successful call; return how long the breaker was open, if it was."""
        if self.open_since is None:
            return None
        outage = self._clock() - self.open_since
        self.open_since = None
        for waiter in self._closed:
            if not waiter.done():
                waiter.set_result(None)
        self._closed.clear()
        return outage

    async def wait_closed(self) -> None:
        if self.open_since is not None:
            waiter = asyncio.get_running_loop().create_future()
            self._closed.append(waiter)
            await waiter


class LocalBuckets:
    """Per-domain buckets in this process, for the ``"local"`` policy: the same algorithm as
    ``token_bucket.lua`` (GCRA), on *clock* (monotonic time), at the rate and the burst divided
    by the fleet's size (the *workers* passed to :meth:`acquire`).

    While Redis answers, :meth:`follow` records when each domain's shared bucket is full again;
    a fallback starts from there, so that tokens reserved in Redis before the outage are not
    spent a second time locally. Once Redis is back, :meth:`busy_until` tells it until when this
    process sees a bucket busy, for the domains it took tokens of locally or saw busy when Redis
    failed (Redis may have lost them), until a call that took tokens was answered
    (:meth:`told`). Only those: while Redis answers, it knows better than this view, which keeps
    the latest time seen of each bucket (Redis's may go back: moments given back or voided, a
    limit raised live on another scope's bucket, whose time this view guesses). The caller sends
    that time by Redis's clock, not as a duration, so that a call that reaches Redis late does
    not push the bucket later.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._full_at: dict[str, float] = {}  # GCRA's "theoretical arrival time"
        # The domains this process took tokens of locally and has not told Redis of since, by
        # the number of their last local take (a take after a call was sent is told by the next).
        self._untold: dict[str, int] = {}
        self._takes = 0
        self._prune_size = LOCAL_PRUNE_SIZE

    def __len__(self) -> int:
        return len(self._full_at)

    def follow(
        self,
        domain: str,
        shared: AcquireResult,
        others: Sequence[tuple[str, Limit]] = (),
        cost: float = 1,
    ) -> None:
        """Record *shared*, Redis's decision for *domain* (and for its *others* scopes, whose
        buckets are full again at least the request's own time after its moment)."""
        now = self._clock()
        decided = shared.decided(now)
        full_at = decided + shared.reset_after
        self._full_at[domain] = max(self._full_at.get(domain, now), full_at)
        if shared.allowed or shared.reserved:
            moment = decided + shared.retry_after
            for name, each in others:
                taken = moment + cost / each.rate
                self._full_at[name] = max(self._full_at.get(name, now), taken)
        self._prune(now)

    def snapshot(self) -> LocalBuckets:
        """A copy of these buckets as they are now, which goes its own way from here."""
        copy = LocalBuckets(self._clock)
        copy._full_at = dict(self._full_at)
        return copy

    def forget(self, domain: str) -> None:
        """Redis emptied *domain*'s bucket (a limit changed, the moments reserved are void):
        what this process saw of it must not be sent back as :meth:`busy_until`."""
        self._full_at.pop(domain, None)
        self._untold.pop(domain, None)

    def busy_until(self, domain: str) -> float:
        """Until when (clock time) the tokens this process took of *domain* locally, or saw
        reserved when Redis failed, not told to Redis yet, keep its bucket busy (0: none, or
        not later than now)."""
        full_at = self._full_at.get(domain, 0.0)
        if domain not in self._untold or full_at <= self._clock():
            return 0.0
        return full_at

    def tell_again(self) -> None:
        """Redis failed: once it is back, every bucket still busy is told again, as if its tokens
        were taken locally. It may have lost them (restarted empty; a replica that had not
        caught up took over), and requests hold moments reserved there."""
        now = self._clock()
        for domain, full_at in self._full_at.items():
            if full_at > now:
                self._takes += 1
                self._untold[domain] = self._takes

    def untold(self, domains: Iterable[str]) -> dict[str, int]:
        """Which of *domains* have a :meth:`busy_until` to tell Redis of, as :meth:`told` takes
        them back once a call that told it was answered."""
        return {domain: self._untold[domain] for domain in domains if domain in self._untold}

    def told(self, untold: Mapping[str, int]) -> None:
        """Redis took tokens for a call sent with *untold*'s :meth:`busy_until`, which it wrote
        with them: what was taken locally before is known there (what was taken since is told
        by the next call)."""
        for domain, take in untold.items():
            if self._untold.get(domain) == take:
                del self._untold[domain]

    def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        reserve: float,
        workers: int,
        others: Sequence[tuple[str, Limit]] = (),
    ) -> AcquireResult:
        """Take *cost* tokens of *domain*'s share of *limit* in a fleet of *workers*, and of
        the shares of the request's *others* scopes (see :meth:`.TokenBucket.acquire`): at
        the latest moment any of them allows."""
        now = self._clock()
        wait, budgets = 0.0, []
        for name, each in ((domain, limit), *others):
            interval = workers / each.rate
            # Each worker's share of the burst, so that the fleet's first moments after a
            # switch hold one burst, not one per worker; a request always fits.
            burst = max(cost, each.burst / workers)
            full_at = max(self._full_at.get(name, now), now)
            wait = max(wait, full_at + cost * interval - burst * interval - now)
            budgets.append((name, full_at, interval, burst))
        _, full_at, interval, burst = budgets[0]
        if wait > reserve:
            return AcquireResult(
                allowed=False,
                reserved=False,
                tokens_left=max(0.0, burst - (full_at - now) / interval),
                retry_after=wait,
                reset_after=full_at - now,
            )
        for name, each_full_at, each_interval, _ in budgets:
            self._full_at[name] = max(each_full_at, now + wait) + cost * each_interval
            self._takes += 1
            self._untold[name] = self._takes
        self._prune(now)
        new_full_at = self._full_at[domain]
        return AcquireResult(
            allowed=wait == 0,
            reserved=wait > 0,
            tokens_left=max(0.0, burst - (new_full_at - now) / interval),
            retry_after=wait,
            reset_after=new_full_at - now,
        )

    def _prune(self, now: float) -> None:
        if len(self._full_at) <= self._prune_size:
            return
        self._full_at = {domain: at for domain, at in self._full_at.items() if at > now}
        self._untold = {
            domain: take for domain, take in self._untold.items() if domain in self._full_at
        }
        self._prune_size = max(LOCAL_PRUNE_SIZE, 2 * len(self._full_at))


@dataclass(frozen=True)
class Grant:
    """The answer to one acquire, and who gave it."""

    result: AcquireResult
    shared: bool
    """Decided by Redis (else by the fallback policy)."""
    waited_for_redis: bool = False
    handover: bool = False
    """A wait for this worker's share right after an outage (see ``_handover_wait``)."""


class ResilientBucket:
    """The shared bucket behind a circuit breaker, with the configured fallback policy."""

    def __init__(
        self,
        redis: ThrottleRedis,
        config: ThrottleConfig,
        stats: StatsCollector,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
        fleet_size: Callable[[], int | None] = lambda: None,
        bucket: TokenBucket | None = None,
    ) -> None:
        self._redis = redis
        self._clock = clock
        # The scripts' calls (a test passes its own).
        self._bucket = bucket or TokenBucket(
            redis,
            config.key_prefix,
            adaptive=config.adaptive is not None,
            may_call=lambda: self.breaker.open_for() is None,
        )
        self._config = config
        self._stats = stats
        self._log_extra = log_extra
        self._rejections = Rejections(stats, log_extra)
        self.breaker = CircuitBreaker(FIRST_PROBE_DELAY, config.probe_interval, clock.monotonic)
        self.local = LocalBuckets(clock.monotonic)
        self._fleet_size = fleet_size
        self._prober: asyncio.Task[None] | None = None
        self._openings = 0
        # Until then (monotonic time), after an outage, requests also keep to this worker's
        # share, in buckets of their own: the other workers may still pace alone (see
        # _handover_wait).
        self._handover_until = 0.0
        self._handover = LocalBuckets(clock.monotonic)
        # The domain of the last call that failed (and its other scopes' budgets): on a Redis
        # Cluster, the probe tries their primaries (another one may answer while one is down).
        self._failed_domains: tuple[str | None, ...] = (None,)
        self.seals = Seals()

    async def check(self) -> None:
        """PING Redis at start-up, so that an unavailable Redis is reported before the first
        request (and the first requests go by the policy at once), read its clock and the
        fleet's secret."""
        try:
            await ping(self._redis)
            await self._bucket.read_time()
        except RedisError as exc:
            self._failed(exc)
            return
        await self._load_secret()

    async def _load_secret(self) -> None:
        """Learn the fleet's secret (see :mod:`.seals`): at start, else once Redis is back."""
        try:
            self.seals.know(await self._bucket.load_secret())
        except (RedisError, ValueError) as exc:
            # Not fatal: meanwhile what this worker parks asks again when it comes back.
            self._rejections.reject(
                "secret", "", str(exc)[:300], "parked requests keep no reservation"
            )

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        others: Sequence[tuple[str, Limit]] = (),
    ) -> Grant:
        """The decision for a request of *domain* (and of its *others* scopes, see
        :meth:`.TokenBucket.acquire`): Redis's, or the fallback policy's."""
        waited = False
        while True:
            if self.breaker.open_for() is None:
                share = self._handover_wait(domain, limit, cost, others)
                if share:
                    return Grant(_later(share), shared=False, handover=True)
                try:
                    result = await self._call_redis(domain, limit, cost, others)
                except ScriptRefused:
                    return self._paced_alone(domain, limit, cost, others)
                if result is not None:
                    return Grant(result, shared=True, waited_for_redis=waited)
            policy = self._config.on_redis_error
            if policy == FALLBACK_LOCAL:
                return self._paced_alone(domain, limit, cost, others)
            if policy == FALLBACK_OPEN:
                self._stats.inc_value(f"{STATS_PREFIX}/fallback/open")
                return Grant(_ALLOWED, shared=False)
            waited = True
            await self.breaker.wait_closed()

    def _paced_alone(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        others: Sequence[tuple[str, Limit]],
    ) -> Grant:
        """A decision of this worker alone: its share of *domain*'s rate (and of its other
        scopes')."""
        workers = self.workers()
        if workers is not None:
            self._stats.inc_value(f"{STATS_PREFIX}/fallback/local")
            result = self.local.acquire(
                domain, limit, cost, self._config.max_reserve, workers, others
            )
            return Grant(result, shared=False)
        # The fleet's size is not known, nor this worker's share: it sends nothing until Redis
        # answers, and asks again after the longest probe delay (parked meanwhile when that is
        # over REDIS_THROTTLE_MAX_HOLD, as by default, so that it holds no download slot and a
        # close is not delayed).
        self._stats.inc_value(f"{STATS_PREFIX}/fallback/unknown_fleet")
        return Grant(_later(self._config.probe_interval), shared=False)

    async def _call_redis(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        others: Sequence[tuple[str, Limit]],
    ) -> AcquireResult | None:
        openings = self._openings
        untold = self.local.untold([domain, *(name for name, _ in others)])
        try:
            result = await self._guarded(
                domain,
                self._bucket.acquire(
                    domain,
                    limit,
                    cost,
                    self._config.max_reserve,
                    busy_until=self.local.busy_until(domain),
                    others=[(name, each, self.local.busy_until(name)) for name, each in others],
                ),
                also=[name for name, _ in others],
            )
        except CallsStopped:
            return None
        if result is None:
            return None
        if result.allowed or result.reserved:
            # Only a call that takes tokens writes the buckets (busy_until with them): after a
            # refusal or a pause, what was taken locally is still to tell.
            self.local.told(untold)
        self.local.follow(domain, result, others, cost)
        if openings != self._openings and self._config.on_redis_error == FALLBACK_LOCAL:
            # Redis answered a call sent before it failed: its moment was chosen without what
            # the fallback gave out meanwhile, and may collide with it. The request goes by the
            # fallback's pace instead (its tokens in Redis stay spent: on the polite side).
            return None
        return result

    def _handover_wait(
        self, domain: str, limit: Limit, cost: float, others: Sequence[tuple[str, Limit]]
    ) -> float:
        """Right after an outage, how long a request must wait for this worker's share (0: it
        may ask Redis now, and its share is taken). Redis is back for this worker, but another
        one may not have noticed yet (its next probe may be up to
        REDIS_THROTTLE_PROBE_INTERVAL away) and still paces alone at its share, unknown to
        Redis: keeping to its own share meanwhile, this one leaves the other's to it, and
        together they stay within the rate. The share's buckets are this worker's alone:
        neither told to Redis nor following it, so that they hold back no other worker."""
        workers = self.workers()
        if workers is None or self._clock.monotonic() >= self._handover_until:
            return 0.0
        share = self._handover.acquire(domain, limit, cost, 0.0, workers, others)
        if share.allowed:
            return 0.0
        self._stats.inc_value(f"{STATS_PREFIX}/handover_waits")
        return share.retry_after

    def workers(self) -> int | None:
        """The ``"local"`` policy's divisor: the setting, else the fleet's size as last seen."""
        return self._config.fallback_workers or self._fleet_size()

    def server_clock(self, domain: str) -> ServerClock:
        """Redis's clock as *domain*'s bucket sees it (see :meth:`.TokenBucket.server_clock`)."""
        return self._bucket.server_clock(domain)

    async def voided(self, domain: str) -> tuple[bool, Voiding | None]:
        """Whether Redis could tell, and the last voiding of *domain*'s reserved moments (see
        :meth:`.TokenBucket.voided`)."""
        if self.breaker.open_for() is not None:
            return False, None
        reply = await self._answered(domain, self._voided(domain))
        return (False, None) if reply is None else (True, reply[0])

    async def _voided(self, domain: str) -> tuple[Voiding | None]:
        # In a tuple: None is an answer here, and _guarded's word for a failed call.
        return (await self._bucket.voided(domain),)

    async def penalize(
        self, domain: str, limit: Limit, retry_after: float | None
    ) -> Penalty | None:
        """Pause *domain* for the fleet (see :mod:`.penalties`); None when Redis could not be
        told."""
        if self.breaker.open_for() is not None:
            return None
        return await self._answered(
            domain, self._bucket.penalize(domain, limit, retry_after, self._config.backoff)
        )

    async def slow_down(
        self, domain: str, limit: Limit, age: float, hold: float = 0
    ) -> SlowDown | None:
        """Lower *domain*'s adaptive rate for the fleet (see :meth:`TokenBucket.slow_down`); None
        when the adaptive rate is off or Redis could not be told."""
        adaptive = self._config.adaptive
        if adaptive is None or self.breaker.open_for() is not None:
            return None
        return await self._answered(
            domain, self._bucket.slow_down(domain, limit, adaptive, age, hold)
        )

    async def unreserve(self, domain: str, reservations: list[Reservation]) -> Unreserved | None:
        """Give *domain*'s bucket back *reservations* (see :meth:`.TokenBucket.unreserve`); None
        when Redis could not be told (they expire with their moments)."""
        if self.breaker.open_for() is not None:
            return None
        return await self._answered(domain, self._bucket.unreserve(domain, reservations))

    async def _answered(self, domain: str, call: Awaitable[_T]) -> _T | None:
        """:meth:`_guarded`, with a refused call taken as no answer."""
        try:
            return await self._guarded(domain, call)
        except ScriptRefused:
            return None

    async def _guarded(
        self, domain: str, call: Awaitable[_T], also: Sequence[str] = ()
    ) -> _T | None:
        """Await a script *call* for *domain* (and the budgets *also*), counted; None when it
        failed (the breaker hears of both, and the probe then tries where *domain* and *also*
        live); ScriptRefused when the script refused it (Redis answered: a success to the
        breaker)."""
        self._stats.inc_value(f"{STATS_PREFIX}/redis_calls")
        try:
            result = await call
        except RedisError as exc:
            if isinstance(exc, ResponseError) and str(exc).startswith((REFUSAL, WRONG_TYPE)):
                self._succeeded()
                self._rejections.reject(
                    "script_call",
                    domain,
                    str(exc)[:300],
                    "this request is paced by this worker alone",
                )
                raise ScriptRefused(str(exc)) from None
            self._failed_domains = (domain, *also)
            self._failed(exc)
            return None
        self._succeeded()
        return result

    def _failed(self, exc: RedisError) -> None:
        self._stats.inc_value(f"{STATS_PREFIX}/redis_errors/{type(exc).__name__}")
        if not self.breaker.failed():
            return
        self._openings += 1
        self.local.tell_again()
        self._went_down(exc)
        self._prober = asyncio.ensure_future(self._probe_until_back())

    def _succeeded(self) -> None:
        outage = self.breaker.succeeded()
        if outage is not None:
            if self._config.on_redis_error == FALLBACK_LOCAL:
                self._handover_until = self._clock.monotonic() + self._config.probe_interval
                # Each share goes on from where this worker's pace alone was: no new burst.
                self._handover = self.local.snapshot()
            self._came_back(outage)

    async def _probe_until_back(self) -> None:
        while self.breaker.open_for() is not None:
            await self._clock.sleep(self.breaker.next_probe_in())
            if self.breaker.open_for() is None:  # a call under way got through meanwhile
                break
            self._stats.inc_value(f"{STATS_PREFIX}/redis_calls")
            try:
                for name in self._failed_domains:
                    await self._bucket.probe(name)
            except RedisError as exc:
                self._stats.inc_value(f"{STATS_PREFIX}/redis_errors/{type(exc).__name__}")
                continue
            self._succeeded()
        if not self.seals.known:  # Redis was down at start
            await self._load_secret()

    def describe_policy(self) -> str:
        """What requests do while Redis fails, for the logs."""
        policy = self._config.on_redis_error
        if policy == FALLBACK_LOCAL:
            if self._config.fallback_workers is not None:
                return (
                    f"each domain is paced in this process at 1/{self._config.fallback_workers} "
                    f"of its rate (REDIS_THROTTLE_FALLBACK_WORKERS) until it is back"
                )
            workers = self._fleet_size()
            if workers is None:
                return (
                    "throttled requests wait until it is back (this worker has not seen the "
                    "fleet's size, so it knows no share of the rates to pace alone)"
                )
            return (
                f"each domain is paced in this process at 1/{workers} of its rate (the "
                f"{workers} worker{'s' if workers != 1 else ''} last seen live) until it is back"
            )
        if policy == FALLBACK_OPEN:
            return "requests go unthrottled until it is back"
        return "throttled requests wait until it is back"

    def _went_down(self, exc: RedisError) -> None:
        self._stats.inc_value(f"{STATS_PREFIX}/outages")
        logger.warning(
            "Redis throttle: Redis at %s is unavailable (%s: %s); %s",
            self._config.redis_location,
            type(exc).__name__,
            exc,
            self.describe_policy(),
            extra=self._log_extra(),
        )

    def _came_back(self, outage: float) -> None:
        self._add_fallback_time(outage)
        logger.info(
            "Redis throttle: Redis at %s is back after %.1f s; limits are shared again",
            self._config.redis_location,
            outage,
            extra=self._log_extra(),
        )

    def _add_fallback_time(self, seconds: float) -> None:
        key = f"{STATS_PREFIX}/fallback_time"
        self._stats.set_value(key, self._stats.get_value(key, 0.0) + seconds)

    async def aclose(self) -> None:
        """Stop probing, disconnect; count an outage still under way in the stats."""
        if self._prober is not None:
            await cancel_and_wait(self._prober, "the probe of Redis")
        outage = self.breaker.open_for()
        if outage is not None:
            self._add_fallback_time(outage)
        await self._bucket.aclose()
