"""Downloader middleware that makes every request wait for its domain's shared budget in Redis.

Settings (see README.md for the full reference):

* ``REDIS_THROTTLE_ENABLED`` - on by default once the middleware is enabled
* ``REDIS_THROTTLE_DEFAULT_RATE`` / ``REDIS_THROTTLE_DEFAULT_BURST`` - for domains not listed
* ``REDIS_THROTTLE_RATES`` and the spider attribute ``redis_throttle_rates`` - per-domain limits
* ``REDIS_THROTTLE_URL`` / ``REDIS_THROTTLE_PARAMS`` - default to scrapy-redis's ``REDIS_URL`` /
  ``REDIS_PARAMS``
* ``REDIS_THROTTLE_KEY_PREFIX``, ``REDIS_THROTTLE_MAX_CONNECTIONS``

Request meta keys: ``dont_redis_throttle``, ``redis_throttle_key``, ``redis_throttle_cost``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, NoReturn

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from scrapy import signals
from scrapy.utils.asyncio import is_asyncio_available

from .bucket import AcquireResult, TokenBucket
from .config import InvalidThrottleMeta, ThrottleConfig, ThrottleConfigError, redact_url

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from typing_extensions import Self

    from .config import Limit

logger = logging.getLogger(__name__)

STATS_PREFIX = "redis_throttle"
# Backoff between attempts while Redis is unreachable.
REDIS_RETRY_FIRST_DELAY = 0.1
REDIS_RETRY_MAX_DELAY = 5.0
# Braces would break the Redis Cluster hash tag of the bucket key.
_HASH_TAG_BRACES = frozenset("{}")


class RedisThrottleMiddleware:
    def __init__(self, crawler: Crawler) -> None:
        self.config = ThrottleConfig.from_crawler(crawler)
        if not is_asyncio_available():
            raise ThrottleConfigError(
                "scrapy-redis-throttle needs the asyncio reactor: set TWISTED_REACTOR = "
                "'twisted.internet.asyncioreactor.AsyncioSelectorReactor' (Scrapy's default), "
                f"got {crawler.settings.get('TWISTED_REACTOR')!r}"
            )
        self.crawler = crawler
        self.stats = crawler.stats
        self.redis = self._connect(self.config)
        self.bucket = TokenBucket(self.redis, self.config.key_prefix)
        self._redis_down = False
        self._key_locks: dict[str, asyncio.Lock] = {}
        self._key_users: Counter[str] = Counter()
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self._spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    @staticmethod
    def _connect(config: ThrottleConfig) -> Redis:
        # One pool per crawler. It waits for a free connection instead of raising when all are
        # busy, and it never replays a command itself: the acquire loop below decides.
        pool = BlockingConnectionPool.from_url(
            config.redis_url,
            max_connections=config.max_connections,
            retry=Retry(NoBackoff(), 0),
            **config.redis_params,
        )
        return Redis(connection_pool=pool)

    async def _spider_opened(self, spider: Spider) -> None:
        logger.info(
            "Redis throttle: shared limits in %s (key prefix %r):\n  %s",
            redact_url(self.config.redis_url),
            self.config.key_prefix,
            "\n  ".join(self.config.limits.describe()),
            extra={"spider": spider},
        )
        try:
            await self.redis.ping()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self._redis_unreachable(exc)

    async def _spider_closed(self, spider: Spider) -> None:
        await self.redis.aclose(close_connection_pool=True)

    async def process_request(self, request: Request) -> None:
        stats = self.stats
        if request.meta.get("dont_redis_throttle"):
            stats.inc_value(f"{STATS_PREFIX}/skipped")
            return
        key = self._key(request)
        limit = self.config.limits.lookup(key) if key else None  # "": data: or file: URLs
        if limit is None:
            stats.inc_value(f"{STATS_PREFIX}/unthrottled")
            return
        cost = self._cost(request, limit)

        loop = asyncio.get_running_loop()
        started = loop.time()
        async with self._turn(key):
            delayed = await self._wait_for_tokens(request, key, limit, cost)
        stats.inc_value(f"{STATS_PREFIX}/requests")
        if not delayed:
            stats.inc_value(f"{STATS_PREFIX}/allowed_immediately")
            return
        waited = loop.time() - started
        stats.inc_value(f"{STATS_PREFIX}/delayed")
        total_key = f"{STATS_PREFIX}/wait_time_total"
        stats.set_value(total_key, stats.get_value(total_key, 0.0) + waited)
        stats.max_value(f"{STATS_PREFIX}/wait_time_max", waited)

    @asynccontextmanager
    async def _turn(self, key: str) -> AsyncIterator[None]:
        """Let this process's requests for one key ask Redis one at a time, first come first
        served: waiters that all woke at the same moment would only refuse each other."""
        lock = self._key_locks.setdefault(key, asyncio.Lock())
        self._key_users[key] += 1
        try:
            async with lock:
                yield
        finally:
            self._key_users[key] -= 1
            if not self._key_users[key]:
                del self._key_users[key], self._key_locks[key]

    async def _wait_for_tokens(self, request: Request, key: str, limit: Limit, cost: float) -> bool:
        """Take the request's tokens, waiting as long as it takes; return whether it waited."""
        delayed = False
        redis_retry_delay = REDIS_RETRY_FIRST_DELAY
        while True:
            try:
                result = await self._acquire(key, limit, cost)
            except (RedisConnectionError, RedisTimeoutError):
                # Nothing goes out unthrottled: wait for Redis to come back.
                delayed = True
                await asyncio.sleep(redis_retry_delay)
                redis_retry_delay = min(redis_retry_delay * 2, REDIS_RETRY_MAX_DELAY)
                continue
            if result.allowed:
                return delayed
            delayed = True
            logger.debug(
                "Redis throttle: %(request)s waits %(delay).3f s for %(key)s (%(limit)s)",
                {"request": request, "delay": result.retry_after, "key": key, "limit": limit},
                extra={"spider": self.crawler.spider},
            )
            # The script says exactly when the tokens will be there; another worker may take
            # them first, in which case the next attempt says how much longer to wait.
            await asyncio.sleep(result.retry_after)

    def _key(self, request: Request) -> str:
        key = request.meta.get("redis_throttle_key")
        if key is None:
            return self.crawler.engine.downloader.get_slot_key(request).lower()
        if isinstance(key, str) and key and not _HASH_TAG_BRACES & set(key):
            return key.lower()
        self._bad_meta(
            request, f"redis_throttle_key must be a non-empty string without braces, got {key!r}"
        )

    def _cost(self, request: Request, limit: Limit) -> float:
        cost = request.meta.get("redis_throttle_cost", 1)
        if (
            isinstance(cost, bool)
            or not isinstance(cost, (int, float))
            or not math.isfinite(cost)
            or cost <= 0
        ):
            self._bad_meta(request, f"redis_throttle_cost must be a positive number, got {cost!r}")
        if cost > limit.burst:
            self._bad_meta(
                request,
                f"redis_throttle_cost {cost!r} exceeds the burst of {limit} for this domain, "
                f"so the request could never go",
            )
        return float(cost)

    def _bad_meta(self, request: Request, message: str) -> NoReturn:
        self.stats.inc_value(f"{STATS_PREFIX}/invalid_meta")
        raise InvalidThrottleMeta(f"{message} ({request})")

    async def _acquire(self, key: str, limit: Limit, cost: float) -> AcquireResult:
        """One call of the script, counted in stats; logs when Redis goes away and comes back."""
        self.stats.inc_value(f"{STATS_PREFIX}/redis_calls")
        try:
            result = await self.bucket.acquire(key, limit, cost)
        except RedisError as exc:
            self.stats.inc_value(f"{STATS_PREFIX}/redis_errors/{type(exc).__name__}")
            if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
                self._redis_unreachable(exc)
            raise
        if self._redis_down:
            self._redis_down = False
            logger.info(
                "Redis throttle: Redis at %s is reachable again",
                redact_url(self.config.redis_url),
                extra={"spider": self.crawler.spider},
            )
        return result

    def _redis_unreachable(self, exc: RedisError) -> None:
        if self._redis_down:
            return
        self._redis_down = True
        logger.warning(
            "Redis throttle: Redis at %s is unreachable (%r); throttled requests wait until "
            "it is back",
            redact_url(self.config.redis_url),
            exc,
            extra={"spider": self.crawler.spider},
        )
