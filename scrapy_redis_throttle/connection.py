from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis
import redis.sentinel
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .config import ThrottleConfig


def connect(config: ThrottleConfig) -> Redis:
    """A client of the throttle's Redis with a pool of its own: for the start-up PING and the
    pause listener (:class:`.penalties.Pauses`), and the settings of the scripts' own
    connections (see :class:`.scripts.LuaScript`). With Redis Sentinel, each connection asks
    the sentinels for the primary when it connects, so that it follows a failover."""
    if config.sentinel is None:
        return connect_url(config.redis_url, config.redis_params, 2)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        config.sentinel.addresses, sentinel_kwargs=dict(config.sentinel.params)
    )
    primary: Redis = sentinel.master_for(
        config.sentinel.service,
        redis_class=Redis,
        retry=Retry(NoBackoff(), 0),
        **_primary_params(config),
    )
    return primary


def connect_sync(config: ThrottleConfig) -> redis.Redis:
    """A synchronous client of the throttle's Redis, for the command line tool."""
    if config.sentinel is None:
        return redis.Redis.from_url(config.redis_url, **config.redis_params)
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        config.sentinel.addresses, sentinel_kwargs=dict(config.sentinel.params)
    )
    primary: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        config.sentinel.service, redis_class=redis.Redis, **_primary_params(config)
    )
    return primary


def _primary_params(config: ThrottleConfig) -> dict[str, Any]:
    """The URL's user, password, database and TLS, and the parameters, for the primary the
    sentinels name (the URL's host and port are not used)."""
    from_url = {
        key: value
        for key, value in parse_url(config.redis_url).items()
        if key not in ("host", "port", "path")
    }
    return {**from_url, **config.redis_params}


def connect_url(url: str, params: Mapping[str, Any], max_connections: int) -> Redis:
    """A client of the Redis at *url* with a pool of its own.

    The pool waits for a free connection instead of raising when all are busy, and the client
    never replays a command itself (a replayed acquire would spend tokens twice): callers decide.
    """
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, retry=Retry(NoBackoff(), 0), **params
    )
    return Redis(connection_pool=pool)
