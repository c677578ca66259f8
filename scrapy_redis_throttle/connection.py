from __future__ import annotations

import asyncio
import random
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.cluster
import redis.sentinel
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, RedisClusterException, RedisError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Mapping

    from redis.asyncio.client import PubSub
    from redis.asyncio.connection import AbstractConnection

    from .config import ThrottleConfig

_T = TypeVar("_T")


# redis-py before 6 replays a command that failed on a connection error this many times, its
# Retry object aside; later versions take the count from the Retry object alone (and warn).
_CLUSTER_REPLAYS: dict[str, Any] = (
    {"cluster_error_retry_attempts": 0} if int(redis.__version__.split(".")[0]) < 6 else {}
)


class ClusterClient(RedisCluster):
    """redis-py's asyncio cluster client, whose every failure is a :exc:`RedisError`, as the
    throttle handles them (when no node answers, or the slots are not all served, redis-py
    raises a :exc:`RedisClusterException`, which is not one, and an ASK to a node it does not
    know yet fails with an AttributeError), and which tells the scripts where each slot is
    (see :class:`.scripts.ClusterLuaScript`)."""

    # Moves heard of (MOVED, a failed call), and how many of them the slots were read after.
    _moves_heard = 0
    _moves_read = 0
    _reading: asyncio.Lock | None = None

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        return await _as_redis_error(super().initialize(*args, **kwargs))

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await _as_redis_error(super().execute_command(*args, **kwargs))

    async def primary_for(self, slot: int) -> ClusterNode:
        """The primary that serves *slot*, as the cluster last said (read again first when a
        move was heard of since: the calls that come meanwhile wait for that one reading)."""
        await self.initialize()
        if self._moves_read != self._moves_heard:
            if self._reading is None:
                self._reading = asyncio.Lock()
            async with self._reading:
                heard = self._moves_heard
                if self._moves_read != heard:
                    await _as_redis_error(self.nodes_manager.initialize())
                    self._moves_read = heard
        try:
            return self.nodes_manager.get_node_from_slot(slot)
        except RedisClusterException as exc:  # not served (a primary failed): read them again
            self.slots_moved()
            raise ClusterError(str(exc)) from exc

    def known_primary_for(self, slot: int) -> ClusterNode | None:
        """The primary that serves *slot*, as the cluster last said (None: not read yet, or
        not served)."""
        nodes = self.nodes_manager.slots_cache.get(slot)
        return nodes[0] if nodes else None

    def slots_moved(self) -> None:
        """A node said a slot has moved, or failed: the slots are read again before the next
        script call is routed."""
        self._moves_heard += 1


ThrottleRedis = Redis | ClusterClient
"""The throttle's Redis: one server (perhaps Sentinel-managed), or a cluster."""


async def _as_redis_error(call: Awaitable[_T]) -> _T:
    try:
        return await call
    except RedisError:
        raise
    except Exception as exc:
        raise ClusterError(f"{type(exc).__name__}: {exc}") from exc


def connect(config: ThrottleConfig) -> ThrottleRedis:
    """A client of the throttle's Redis: for the start-up PING and the pause listener
    (:class:`.pauses.Pauses`), and the settings of the scripts' own connections (see
    :mod:`.scripts`). With Redis Sentinel, each connection asks the sentinels for the primary
    when it connects, so that it follows a failover. On a cluster, the scripts follow MOVED
    and ASK (resharding) and read the slots again after a failed call (a failover): see
    :class:`.scripts.ClusterLuaScript`.

    No client replays a command itself (a replayed acquire would spend tokens twice)."""
    if config.cluster is not None:
        return ClusterClient(
            startup_nodes=[ClusterNode(host, port) for host, port in config.cluster.addresses],
            retry=Retry(NoBackoff(), 0),
            **_CLUSTER_REPLAYS,
            **_cluster_params(config),
        )
    if config.sentinel is None:
        return connect_url(config.redis_url, config.redis_params, 2)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        config.sentinel.addresses, sentinel_kwargs=dict(config.sentinel.params)
    )
    primary: Redis = sentinel.master_for(
        config.sentinel.service,
        redis_class=Redis,
        retry=Retry(NoBackoff(), 0),
        **_url_params(config),
    )
    return primary


def connect_sync(config: ThrottleConfig) -> redis.Redis | redis.cluster.RedisCluster:
    """A synchronous client of the throttle's Redis, for the command line tool."""
    if config.cluster is not None:
        return redis.cluster.RedisCluster(
            startup_nodes=[
                redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in config.cluster.addresses
            ],
            **_cluster_params(config),
        )
    if config.sentinel is None:
        return redis.Redis.from_url(config.redis_url, **config.redis_params)
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        config.sentinel.addresses, sentinel_kwargs=dict(config.sentinel.params)
    )
    primary: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        config.sentinel.service, redis_class=redis.Redis, **_url_params(config)
    )
    return primary


def _url_params(config: ThrottleConfig) -> dict[str, Any]:
    """The URL's user, password, database and TLS, and the parameters, for the servers the
    sentinels or the cluster name (the URL's host and port are not used)."""
    from_url = {
        key: value
        for key, value in parse_url(config.redis_url).items()
        if key not in ("host", "port", "path")
    }
    return {**from_url, **config.redis_params}


def _cluster_params(config: ThrottleConfig) -> dict[str, Any]:
    """:func:`_url_params`, as the cluster clients take them: TLS as a flag, and no database
    (a cluster has database 0 alone, which the configuration checked)."""
    params = _url_params(config)
    params.pop("db", None)
    if params.pop("connection_class", None) is SSLConnection:
        params["ssl"] = True
    return params


def connect_url(url: str, params: Mapping[str, Any], max_connections: int) -> Redis:
    """A client of the Redis at *url* with a pool of its own.

    The pool waits for a free connection instead of raising when all are busy, and the client
    never replays a command itself (a replayed acquire would spend tokens twice): callers decide.
    """
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, retry=Retry(NoBackoff(), 0), **params
    )
    return Redis(connection_pool=pool)


async def ping(client: ThrottleRedis) -> None:
    """PING the server, or every primary of a cluster (not its replicas: a replica down is no
    outage of the throttle)."""
    if isinstance(client, RedisCluster):
        await client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        await client.ping()


async def closed_by_server(connection: AbstractConnection) -> bool:
    """Whether the server closed *connection*, which waits for no reply (or left something on
    it that no command asked for): a command sent on it would fail without running. (redis-py's
    pool checks this only without maintenance notifications, off by default since redis-py 8.)"""
    # can_read (redis-py 6+) is can_read_destructive before (deprecated since).
    check = getattr(connection, "can_read", None) or connection.can_read_destructive
    return bool(await check())


async def drop_idle_connections(client: ThrottleRedis) -> None:
    """Disconnect the connections of *client*'s pool that are not in use, so that its next
    command goes on a new one (not on a cluster, whose nodes' connections are not told apart)."""
    if not isinstance(client, RedisCluster):
        await client.connection_pool.disconnect(inuse_connections=False)


async def close(client: ThrottleRedis) -> None:
    if isinstance(client, RedisCluster):
        nodes = client.get_nodes()
        await client.aclose()
        # redis-py 8 leaves them connected when a call failed before (it marks the client for
        # a new start, and aclose() then passes).
        for node in nodes:
            await node.disconnect()
    else:
        await client.aclose(close_connection_pool=True)


@asynccontextmanager
async def pubsub(client: ThrottleRedis) -> AsyncIterator[PubSub]:
    """A :class:`~redis.asyncio.client.PubSub` of the throttle's Redis, closed on leaving. It
    passes on the confirmations of subscriptions too: they tell when messages start to come.

    On a cluster, it is on a node picked at random: every node of a cluster passes each
    PUBLISH on to the others, and a node that failed is likely left behind on the next try.
    (redis-py's asyncio ``ClusterPubSub`` is newer than the oldest redis-py we support.)"""
    if not isinstance(client, RedisCluster):
        subscriber = client.pubsub()
        try:
            yield subscriber
        finally:
            with suppress(RedisError, OSError):
                await subscriber.aclose()  # type: ignore[no-untyped-call]
        return
    await client.initialize()
    node = random.choice(client.get_nodes())
    pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
    node_client = Redis(connection_pool=pool)
    try:
        async with pubsub(node_client) as subscriber:
            yield subscriber
    finally:
        with suppress(RedisError, OSError):
            await node_client.aclose(close_connection_pool=True)
