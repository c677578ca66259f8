"""The Lua scripts of ``lua/``, and how they are called."""

from __future__ import annotations

import asyncio
import functools
import hashlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .clock import Clock
from .connection import ClusterClient, closed_by_server
from .rates import MAX_LIMITS, MAX_SLIDING_COUNT
from .redis_schema import EPOCH
from .scopes import MAX_SCOPES
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Sequence

    from redis.asyncio.cluster import ClusterNode
    from redis.asyncio.connection import AbstractConnection

    from .connection import ThrottleRedis


def read_lua(name: str) -> str:
    """Return the text of ``lua/<name>``.

    Installed wheels carry the scripts inside the package; a source checkout has them in the
    top-level ``lua/`` folder.
    """
    packaged = resources.files(__package__).joinpath("lua", name)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "lua" / name).read_text(encoding="utf-8")


@functools.cache
def load_script(name: str) -> str:
    """The script Redis runs: ``lua/<name>`` with what the scripts share put after its first
    line (the shebang, which Redis wants first): the values Python owns, then
    ``lua/prelude.lua``."""
    shebang, _, body = read_lua(name).partition("\n")
    owned = (
        f"local EPOCH = {EPOCH}\n"
        f"local MAX_LIMITS, MAX_SLIDING_COUNT = {MAX_LIMITS}, {MAX_SLIDING_COUNT}\n"
        f"local MAX_SCOPES = {MAX_SCOPES}\n"
    )
    return f"{shebang}\n{owned}{read_lua('prelude.lua')}{body}"


_Call = tuple["Sequence[str]", "Sequence[Any]", "asyncio.Future[Any]"]
# As redis-py: a call redirected this many times in a row fails.
MAX_REDIRECTIONS = 16
# TRYAGAIN: the call waits this long before it is sent again (as redis-py does).
TRY_AGAIN_DELAY = 0.05


def lua_script(
    redis: ThrottleRedis, name: str, clock: Clock | None = None
) -> LuaScript | ClusterLuaScript:
    """``lua/<name>``, called as suits the throttle's Redis: one server or a cluster (which
    waits by *clock*, the real one when None)."""
    if isinstance(redis, ClusterClient):
        return ClusterLuaScript(redis, name, clock or Clock())
    pool = redis.connection_pool
    # The client's settings (URL, password, TLS, timeouts, no retries), not its pool.
    return LuaScript(pool.connection_class(**pool.connection_kwargs), name)


class _Source:
    def __init__(self, name: str) -> None:
        self._name = name
        self._source = load_script(name)
        self._sha = hashlib.sha1(self._source.encode("utf-8")).hexdigest()


class ClusterLuaScript(_Source):
    """``lua/<name>`` on a Redis Cluster: a :class:`LuaScript` per primary, on a connection
    of its own with the cluster client's settings; each call goes to the primary that serves
    its keys' slot (all of one call's keys are in one slot).

    Redirections are followed here, not by redis-py's cluster client: it sends ``ASKING`` and
    the command on two of its pooled connections, which fails once it has several. A call
    answered MOVED goes straight to the node it names (later calls read the slots again first);
    one answered ASK (its slot is moving, its keys have gone) goes to the node it names, after
    ``ASKING`` on the same connection; TRYAGAIN (a call with several keys while its slot moves,
    one of them missing on the node that answers) waits a moment. Each of these replies means
    the script did not run. A failed call is not made again (it may have run), but the slots
    are read again before the next one: a failover may be under way."""

    def __init__(self, cluster: ClusterClient, name: str, clock: Clock) -> None:
        super().__init__(name)
        self._clock = clock
        self._cluster = cluster
        self._on_node: dict[str, LuaScript] = {}

    async def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        like = await self._cluster.primary_for(key_slot(keys[0].encode()))
        primary = (like.host, int(like.port))  # the slot's primary, as last heard
        target, asking = primary, False
        for _ in range(MAX_REDIRECTIONS):
            try:
                if asking:
                    return await self._asking(like, *target, keys, args)
                return await self._script_at(like, *target)(keys, args)
            except MovedError as moved:
                # Straight there; later calls read the slots again first.
                self._cluster.slots_moved()
                primary = (moved.host, moved.port)
                target, asking = primary, False
            except AskError as ask:
                target, asking = (ask.host, ask.port), True
            except TryAgainError:
                target, asking = primary, False
                await self._clock.sleep(TRY_AGAIN_DELAY)
            except (RedisConnectionError, RedisTimeoutError, ClusterDownError):
                self._cluster.slots_moved()
                raise
        raise ClusterError(f"{keys[0]!r} redirected {MAX_REDIRECTIONS} times in a row")

    def _script_at(self, like: ClusterNode, host: str, port: int) -> LuaScript:
        """The script on a connection of its own to the primary at *host*:*port*."""
        name = f"{host}:{port}"
        script = self._on_node.get(name)
        if script is None:
            script = self._on_node[name] = LuaScript(_connection_to(like, host, port), self._name)
        return script

    async def _asking(
        self, like: ClusterNode, host: str, port: int, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        """The call on the node an ASK named, on a connection for it alone (a slot moves
        rarely): the script loaded, ``ASKING``, and the call, in one pipeline."""
        connection = _connection_to(like, host, port)
        try:
            await connection.connect()  # type: ignore[no-untyped-call]
            await connection.send_packed_command(
                connection.pack_commands(
                    [
                        ("SCRIPT", "LOAD", self._source),
                        ("ASKING",),
                        ("EVALSHA", self._sha, len(keys), *keys, *args),
                    ]
                ),
                check_health=False,
            )
            await connection.read_response()
            await connection.read_response()
            return await connection.read_response()
        finally:
            await connection.disconnect()

    async def aclose(self) -> None:
        for script in self._on_node.values():
            await script.aclose()


def _connection_to(like: ClusterNode, host: str, port: int) -> AbstractConnection:
    """A connection to the node at *host*:*port*, with the settings of the node *like*."""
    connection: AbstractConnection = like.connection_class(
        **{**like.connection_kwargs, "host": host, "port": port}
    )
    return connection


class LuaScript(_Source):
    """``lua/<name>``, run with EVALSHA on a connection of its own, one batch at a time.

    A call made while nothing is under way goes at once. The calls made while a batch is under
    way go together in the next one, in one pipeline (one write, one read): when calls come
    faster than Redis answers, they share round trips. Each call still runs atomically on its
    own and fails on its own; a failed connection fails its whole batch, and the next batch
    connects again.

    Why not redis-py's pool and ``AsyncScript``: taking a connection from the pool and giving
    it back cost about 90 µs of client CPU per call (242 µs per EVALSHA through the pool, 150 µs
    on a connection of its own, measured interleaved), ``AsyncScript`` about 15 µs more. The
    script is loaded again when Redis lost it (restarted, SCRIPT FLUSH): running a call again
    after NOSCRIPT is safe, it did not run.
    """

    def __init__(self, connection: AbstractConnection, name: str) -> None:
        super().__init__(name)
        self._connection = connection
        self._in_flight = False  # a batch is on the connection
        self._queue: list[_Call] = []  # the calls made meanwhile: the next batch
        self._sender: asyncio.Task[None] | None = None

    async def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if self._in_flight:
            reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._queue.append((keys, args, reply))
            return await reply
        # Nothing under way (the usual case when Redis is fast): this call goes at once, by
        # itself, with no task and no future.
        self._in_flight = True
        try:
            [result] = await self._run([(keys, args)])
        finally:
            self._in_flight = False
            self._send_queued_calls()
        if isinstance(result, Exception):
            raise result
        return result

    async def aclose(self) -> None:
        """Stop sending (calls still waiting are cancelled) and disconnect."""
        if self._sender is not None:
            await cancel_and_wait(self._sender, "the sending of script calls")
            self._sender = None
        # A sender cancelled before it ran never runs its clean-up: the queue is cleared here.
        for _, _, reply in self._queue:
            reply.cancel()
        self._queue = []
        await self._connection.disconnect()

    def _send_queued_calls(self) -> None:
        if self._queue and not self._in_flight:
            self._in_flight = True
            self._sender = asyncio.ensure_future(self._send_queue())

    async def _send_queue(self) -> None:
        batch: list[_Call] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    replies = await self._run([(keys, args) for keys, args, _ in batch])
                except Exception as exc:  # every caller must hear of it, whatever it is
                    replies = [exc] * len(batch)
                for (_, _, reply), result in zip(batch, replies, strict=True):
                    if reply.done():  # its caller was cancelled
                        continue
                    if isinstance(result, Exception):
                        reply.set_exception(result)
                    else:
                        reply.set_result(result)
        finally:
            self._in_flight = False
            self._sender = None
            # Only if this task was cancelled: no caller may wait for a reply that cannot come.
            for _, _, reply in batch + self._queue:
                reply.cancel()
            self._queue = []

    async def _run(
        self, calls: list[tuple[Sequence[str], Sequence[Any]]], reload: bool = True
    ) -> list[Any]:
        """Replies to *calls*, in order; a call that failed on its own has its exception."""
        connection = self._connection
        try:
            if connection.is_connected and await closed_by_server(connection):
                # Since the last batch (a restart of Redis): the calls would fail on it, sent to
                # a server that has gone, and say nothing of the one that may answer now.
                await connection.disconnect()
            if not connection.is_connected:
                # Not left to send_packed_command: a Sentinel-managed connection asks the
                # sentinels for the primary in connect() alone.
                await connection.connect()  # type: ignore[no-untyped-call]
            await connection.send_packed_command(
                connection.pack_commands(
                    [("EVALSHA", self._sha, len(keys), *keys, *args) for keys, args in calls]
                ),
                check_health=False,
            )
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
        except Exception as exc:
            # Replies may be left unread on it: only a new connection is in a known state.
            await connection.disconnect()
            if isinstance(exc, RedisError):
                raise
            # redis-py lets some failures of its connection through unwrapped (Python 3.13: an
            # AttributeError from writing to a transport closed by a reset): a failure of the
            # connection all the same, never the request's.
            raise RedisConnectionError(
                f"the connection failed: {type(exc).__name__}: {exc}"
            ) from exc
        except BaseException:  # cancelled
            await connection.disconnect()
            raise
        lost = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost and reload:
            await connection.send_command("SCRIPT", "LOAD", self._source, check_health=False)
            await connection.read_response()
            for n, reply in zip(
                lost, await self._run([calls[n] for n in lost], False), strict=True
            ):
                replies[n] = reply
        return replies
