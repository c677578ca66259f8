"""Several scopes on a Redis Cluster: a request's budgets are buckets on several nodes, which no
one script call can decide for together (a call touches one slot). Each bucket is asked on its
own node, and the request counts in every one at the same moment, or in none:

1. *Peek*: each bucket says when it would let the request go, taking nothing (all at once).
   The latest of those moments is the request's.
2. *Reserve at that moment*: first in the bucket that gave it, then in the others (all at
   once), each taking the request's tokens at exactly that moment (``not_before``), or nothing
   if it cannot, and replying when it could instead. A bucket another worker took the moment
   of meanwhile refuses: the moments taken are given back (``lua/unreserve.lua``) and the
   request tries its new moment, the latest of the refusals' (at most :data:`ROUNDS` times;
   then it asks again when that moment comes, as any refused request does).

Moments are converted between the nodes' clocks through this process's loop clock, by the
same offsets that place a reply's moments (see :class:`.ServerClock`): every bucket counts the
request at the moment it goes, to within the uncertainty of those offsets (about a round trip).

Two calls per bucket instead of one call in all: the cost of the cluster (see the performance
docs). The requests of one worker that share a bucket take turns (:class:`Turns`): asking at
once, they would all peek the same moment and all but one be refused, again and again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

    from .bucket import AcquireResult, Reservation
    from .rates import Limit

    # One bucket's call of token_bucket.lua: name, limit, cost, reserve, busy_for, not_before.
    AcquireOne = Callable[[str, Limit, float, float, float, int], Awaitable[AcquireResult]]
    Unreserve = Callable[[str, Sequence[Reservation]], Awaitable[object]]

# The script's reserve for a peek: below 0, it takes nothing and replies when.
PEEK = -1.0
# Tries at a moment before the request asks again when its latest refusal says.
ROUNDS = 3


class Turns:
    """One lock per bucket name, held while a request of this process decides in it; a name's
    lock is forgotten when no request holds or waits for it (bounded by the requests under
    way)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def of(self, names: Iterable[str]) -> AsyncIterator[None]:
        """Hold every one of *names*' locks (taken in sorted order: no two requests wait for
        each other)."""
        async with AsyncExitStack() as stack:
            for name in sorted(set(names)):
                await stack.enter_async_context(self._one(name))
            yield

    @asynccontextmanager
    async def _one(self, name: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(name) or (asyncio.Lock(), 0)
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


class AcrossNodes:
    """Decides for a request under several scopes whose buckets are on several nodes (see the
    module's docs)."""

    def __init__(self, acquire_one: AcquireOne, unreserve: Unreserve) -> None:
        self._acquire_one = acquire_one
        self._unreserve = unreserve
        self.turns = Turns()

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        reserve: float,
        busy_for: float,
        others: Sequence[tuple[str, Limit, float]],
    ) -> AcquireResult:
        """As :meth:`.TokenBucket.acquire`, the result of *domain*'s bucket: the request's
        moment (or its refusal, or a pause of any of its buckets)."""
        # Another scope's quotas count only where it is a request's domain, as in one call.
        buckets = [
            (domain, limit, busy_for),
            *((name, dataclasses.replace(each, quotas=()), busy) for name, each, busy in others),
        ]
        async with self.turns.of(name for name, _, _ in buckets):
            return await self._decide(buckets, cost, reserve)

    async def _decide(
        self, buckets: list[tuple[str, Limit, float]], cost: float, reserve: float
    ) -> AcquireResult:
        loop = asyncio.get_running_loop()
        peeks = await asyncio.gather(
            *(self._acquire_one(name, each, cost, PEEK, busy, 0) for name, each, busy in buckets)
        )
        paused = [result for result in peeks if result.paused]
        if paused:
            return paused[0]
        # When each bucket's busy_for ends, by its node's clock: the same end for every call.
        busy_until = [
            _server_us(peek) - peek.retry_after * 1e6 + busy * 1e6
            for (_, _, busy), peek in zip(buckets, peeks, strict=True)
        ]
        results = list(peeks)
        for _ in range(ROUNDS):
            moments = [_moment(result) for result in results]
            moment = max(moments)
            if moment - loop.time() > reserve:
                break
            first = moments.index(moment)
            results[first] = await self._at(
                buckets[first], cost, moment, results[first], busy_until[first]
            )
            if _taken(results[first]):
                rest = [n for n in range(len(buckets)) if n != first]
                replies = await asyncio.gather(
                    *(self._at(buckets[n], cost, moment, results[n], busy_until[n]) for n in rest)
                )
                for n, reply in zip(rest, replies, strict=True):
                    results[n] = reply
                if all(_taken(result) for result in results):
                    return results[0]
                await self._give_back(buckets, results)
            paused = [result for result in results if result.paused]
            if paused:
                return paused[0]
        return _refused(results[0], max(_moment(result) for result in results))

    async def _at(
        self,
        bucket: tuple[str, Limit, float],
        cost: float,
        moment: float,
        last: AcquireResult,
        busy_until: float,
    ) -> AcquireResult:
        """*bucket*'s tokens taken at *moment* (loop time), or nothing: its reply. *last*: its
        last reply, whose offset converts the moment to its node's clock; *busy_until*: when
        its busy_for ends by that clock (the script counts busy_for from not_before)."""
        name, each, _ = bucket
        not_before = max(0, math.ceil(_server_us(last) + (moment - _moment(last)) * 1e6))
        busy = max(0.0, busy_until - not_before) / 1e6
        return await self._acquire_one(name, each, cost, 0.0, busy, not_before)

    async def _give_back(
        self, buckets: list[tuple[str, Limit, float]], results: list[AcquireResult]
    ) -> None:
        """Give back the moments reserved by *results* (taken now ones are spent: they cannot
        be told from the next request's)."""
        await asyncio.gather(
            *(
                self._unreserve(name, [result.reservation])
                for (name, _, _), result in zip(buckets, results, strict=True)
                if result.reservation is not None
            )
        )


def _taken(result: AcquireResult) -> bool:
    return result.allowed or result.reserved


def _moment(result: AcquireResult) -> float:
    """When *result* lets its request go (loop time; for a refusal, when it could)."""
    return result.decided(asyncio.get_running_loop().time()) + result.retry_after


def _server_us(result: AcquireResult) -> float:
    """:func:`_moment` by its node's clock (µs since the scripts' epoch)."""
    assert result.moment_us is not None, "a reply of Redis"
    return result.moment_us


def _refused(result: AcquireResult, moment: float) -> AcquireResult:
    """*result* (its domain's reply) as a refusal that may ask again at *moment*."""
    later = moment - _moment(result)
    return dataclasses.replace(
        result,
        allowed=False,
        reserved=False,
        retry_after=result.retry_after + later,
        moment_us=_server_us(result) + later * 1e6,
        reservation=None,
    )
