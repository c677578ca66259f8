"""Redis's clock as this process sees it: when, by this process's clock, Redis decided a reply.

The scripts place every moment by Redis's clock and reply how long from *then* a request must
wait. A reply is read some time after: a little on an idle process, a lot on one busy with a
batch of other replies (measured: 5 ms at the median, over 100 ms at the 99th percentile, on
this project's fleets). Counted from when it was read, a moment came that much late, and the
site saw its request squeezed against the next one, placed on time by another reply.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

from redis.crc import key_slot

from .clock import Clock
from .connection import ClusterClient
from .redis_schema import server_micros

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from redis.asyncio.cluster import ClusterNode

    from .connection import ThrottleRedis

    # Reads Redis's TIME (seconds, microseconds): Redis.time, or a cluster node's.
    ServerTime = Callable[[], Awaitable[Any]]

# How many times to read Redis's TIME before the first replies: the narrowest bounds of a few
# round trips at start-up, when a process is busy, are fair first bounds.
FIRST_READS = 3
# How long one generation of samples lasts; the bounds are those of this one and the last one,
# so that they follow a drift of either clock within two generations. Older bounds are not used.
GENERATION = 10.0


class ServerClock:
    """The offset between one Redis's clock (its ``TIME``, as the scripts reply it) and this
    process's event loop's clock (``loop.time()``, monotonic), from the replies.

    Redis ran the script of a call *sent* and *read* at loop times (server time *s*) in
    between, so the offset (loop time minus server time) is at least ``sent - s`` and at most
    ``read - s``. The bounds of the recent replies narrow it down to about the fastest round
    trip (tens of µs on a loopback). A reply read late has its times counted from ``s`` plus
    the upper bound: never earlier than Redis decided, whatever the reply's lateness.

    A reply out of the bounds proves a clock stepped or drifted (or that another server
    answered: Redis Cluster nodes set apart): the bounds start again from it alone, so its
    times count from when it was read, as they would without this clock.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        """*clock*: this process's (the real one when None)."""
        self._clock = clock or Clock()
        self._reading: asyncio.Future[None] | None = None
        """Done when the reading of ``TIME`` under way ends (None: none is)."""
        self._generations: list[tuple[float, float]] = []
        """(upper, lower) bounds of the offset, this generation's last."""
        self._generation_ends = 0.0

    def server_us(self, loop_time: float) -> float | None:
        """Redis's time (µs since the scripts' epoch) at *loop_time*, as late as it may be
        (None: unknown, or its bounds are over two generations old)."""
        if not self._known_at(loop_time):
            return None
        return (loop_time - self._bounds()[1]) * 1e6

    def loop_time(self, server_us: float) -> float | None:
        """When, by the loop's clock, Redis's clock reads *server_us* (µs since the scripts'
        epoch), as :meth:`decided_at` counts (None: unknown, or its bounds are over two
        generations old)."""
        if not self._known_at(self._clock.monotonic()):
            return None
        return server_us / 1e6 + self._bounds()[0]

    def moment_us(self, moment: float) -> float | None:
        """A *moment* (loop time) by Redis's clock (µs since the scripts' epoch), as late as the
        bounds allow (None: unknown, or its bounds are over two generations old): a moment a
        worker tells Redis, such as the end of the tokens it took alone, is never earlier there
        than it is here, so that Redis gives no moment before it. A moment of a reply told back
        comes back later by the bounds' width (about a round trip, once they are narrow)."""
        if not self._known_at(self._clock.monotonic()):
            return None
        return (moment - self._bounds()[1]) * 1e6

    def placed(self, moment: float, moment_us: float | None) -> float:
        """A *moment* (loop time) placed by earlier bounds, as the recent bounds place it
        (*moment_us*: the same by Redis's clock; None: not given by Redis). Never later: a
        moment placed by the wide bounds of a reply read late came too late, and the request
        that holds it must know it (it would go squeezed against the next moment)."""
        exact = None if moment_us is None else self.loop_time(moment_us)
        return moment if exact is None else min(moment, exact)

    def _known_at(self, loop_time: float) -> bool:
        """Whether bounds of the last two generations tell the offset at *loop_time*."""
        return bool(self._generations) and loop_time < self._generation_ends + GENERATION

    async def follow(self, server_time: ServerTime) -> None:
        """Unless recent replies bound the offset, learn it from Redis's ``TIME`` (read by
        *server_time*), a few times: a call whose reply counts by this clock must know it
        first, or an unknown clock would take that one reply's bounds alone, and a reply read
        late (by a busy process) would place its moments that much late."""
        if self._reading is not None:
            # One reading for the calls that come meanwhile: they go after it, in the order
            # they came (a call that came later must not overtake them with the clock known).
            await asyncio.shield(self._reading)
            return
        if self.server_us(self._clock.monotonic()) is not None:
            return
        self._reading = asyncio.get_running_loop().create_future()
        try:
            for _ in range(FIRST_READS):
                sent = self._clock.monotonic()
                seconds, micros = await server_time()
                self.decided_at(sent, self._clock.monotonic(), server_micros(seconds, micros))
        finally:
            # Failed or not, the calls waiting go on (each learns from its own reply if need be).
            reading, self._reading = self._reading, None
            reading.set_result(None)

    def decided_at(self, sent: float, read: float, server_us: float) -> float:
        """When Redis decided (by the loop's clock) a reply to a call *sent*, read at *read*
        (loop times), that its script timed at *server_us* (µs by Redis's clock): never
        before it did, nor after *read*."""
        server = server_us / 1e6  # from the scripts' epoch: the offset takes it in
        upper, lower = read - server, sent - server
        if self._generations:
            known_upper, known_lower = self._bounds()
            if lower > known_upper or upper < known_lower:
                self._generations = []  # a clock stepped, or another server answered
        if not self._generations or read >= self._generation_ends:
            recent = read < self._generation_ends + GENERATION
            kept = self._generations[-1:] if recent else []
            self._generations = [*kept, (upper, lower)]
            self._generation_ends = read + GENERATION
        else:
            last_upper, last_lower = self._generations[-1]
            self._generations[-1] = (min(last_upper, upper), max(last_lower, lower))
        return server + self._bounds()[0]

    def _bounds(self) -> tuple[float, float]:
        """The narrowest (upper, lower) bounds of the offset the recent generations give."""
        return (
            min(upper for upper, _ in self._generations),
            max(lower for _, lower in self._generations),
        )


class ServerClocks:
    """The clock of each Redis the buckets are on: one, or each primary of a Redis Cluster,
    by its address (as many as the cluster has told of, at most one per slot). Each node has
    its own clock, and a moment one gave is read by its clock alone (a reply from another
    node, the slot moved, starts the clock again)."""

    def __init__(self, redis: ThrottleRedis, clock: Clock) -> None:
        self._redis = redis
        self._process_clock = clock
        self._clock = ServerClock(clock)
        self._node_clocks: dict[str, ServerClock] = {}

    def of(self, key: str) -> ServerClock:
        """The clock of the bucket *key*: on a Redis Cluster, that of the primary that serves
        its slot, as the cluster last said."""
        if not isinstance(self._redis, ClusterClient):
            return self._clock
        primary = self._redis.known_primary_for(key_slot(key.encode()))
        return ServerClock(self._process_clock) if primary is None else self._node(primary)

    async def read(self) -> None:
        """Learn each clock before the first requests (see :meth:`ServerClock.follow`): a
        clock learned at its first call would let the requests that come meanwhile wait."""
        if not isinstance(self._redis, ClusterClient):
            await self._clock.follow(self._redis.time)
            return
        await self._redis.initialize()
        for primary in self._redis.get_primaries():
            await self._node(primary).follow(partial(self._redis.time, target_nodes=primary))

    async def known(self, key: str) -> ServerClock:
        """The clock of the bucket *key* (see :meth:`of`), read first from Redis's ``TIME``
        if it knows no recent bounds (see :meth:`ServerClock.follow`)."""
        if not isinstance(self._redis, ClusterClient):
            await self._clock.follow(self._redis.time)
            return self._clock
        primary = await self._redis.primary_for(key_slot(key.encode()))
        clock = self._node(primary)
        await clock.follow(partial(self._redis.time, target_nodes=primary))
        return clock

    def _node(self, node: ClusterNode) -> ServerClock:
        clock = self._node_clocks.get(node.name)
        if clock is None:
            clock = self._node_clocks[node.name] = ServerClock(self._process_clock)
        return clock
