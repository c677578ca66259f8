from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .config import ThrottleConfig


def connect(config: ThrottleConfig) -> Redis:
    """A client of the throttle's Redis with a pool of its own: for the start-up PING and the
    pause listener (:class:`.penalties.Pauses`), and the settings of the scripts' own
    connections (see :class:`.scripts.LuaScript`)."""
    return connect_url(config.redis_url, config.redis_params, 2)


def connect_url(url: str, params: Mapping[str, Any], max_connections: int) -> Redis:
    """A client of the Redis at *url* with a pool of its own.

    The pool waits for a free connection instead of raising when all are busy, and the client
    never replays a command itself (a replayed acquire would spend tokens twice): callers decide.
    """
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, retry=Retry(NoBackoff(), 0), **params
    )
    return Redis(connection_pool=pool)
