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
docs). The requests of one worker that share a bucket take turns (:class:`BudgetLocks`):
asking at once, they would all peek the same moment and all but one be refused, again and
again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, NamedTuple, Protocol

from redis.exceptions import RedisError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence

    from .breaker import CircuitBreaker
    from .clock import Clock
    from .rates import Limit
    from .replies import AcquireResult, Reservation

# The script's reserve for a peek: below 0, it takes nothing and replies when.
PEEK = -1.0
# Tries at a moment before the request asks again when its latest refusal says.
ROUNDS = 3


class BudgetLocks:
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


class CallsStopped(Exception):
    """Redis failed while the request waited for its turn (see :class:`AcrossNodes`): it does
    not call Redis, the policy decides."""


class NodeBudget(NamedTuple):
    """One of a request's budgets, as :class:`AcrossNodes` asks it."""

    name: str
    limit: Limit
    busy_until: float
    alone: bool
    """Another scope's: its bucket is read as in one call (see ``lua/token_bucket.lua``)."""


class NodeCalls(Protocol):
    """The calls of one bucket on its node (:class:`.OneNode`)."""

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        reserve: float,
        busy_until: float,
        not_before: int,
        alone: bool = False,
    ) -> AcquireResult: ...

    async def unreserve(self, domain: str, reservations: Sequence[Reservation]) -> object: ...


class AcrossNodes:
    """Decides for a request under several scopes whose buckets are on several nodes (see the
    module's docs), each asked through *node*; no request calls Redis while *breaker* is open
    (None: none is)."""

    def __init__(self, node: NodeCalls, breaker: CircuitBreaker | None, clock: Clock) -> None:
        self._clock = clock
        self._node = node
        self._breaker = breaker
        self.locks = BudgetLocks()

    async def acquire(
        self,
        domain: str,
        limit: Limit,
        cost: float,
        reserve: float,
        busy_until: float,
        others: Sequence[tuple[str, Limit, float]],
    ) -> AcquireResult:
        """As :meth:`.TokenBucket.acquire`, the result of *domain*'s bucket: the request's
        moment (or its refusal, or a pause of any of its buckets). Raises
        :class:`CallsStopped` if Redis failed while the request waited for its turn."""
        # Another scope's quotas count only where it is a request's domain, as in one call.
        budgets = [
            NodeBudget(domain, limit, busy_until, alone=False),
            *(
                NodeBudget(name, dataclasses.replace(each, quotas=()), busy, alone=True)
                for name, each, busy in others
            ),
        ]
        async with self.locks.of(budget.name for budget in budgets):
            # The requests that waited for a call that failed do not call the node again, each
            # in turn, for as long as a call takes to fail.
            if self._breaker is not None and self._breaker.is_open:
                raise CallsStopped
            taken: list[tuple[str, AcquireResult]] = []
            try:
                return await self._decide(budgets, cost, reserve, taken)
            except BaseException:
                # Failed or cancelled half-way: what it reserved is given back (a call under
                # way may have taken its tokens unseen: spent, the polite side).
                await asyncio.shield(self._unreserve_taken(taken))
                raise

    async def _decide(
        self,
        budgets: list[NodeBudget],
        cost: float,
        reserve: float,
        taken: list[tuple[str, AcquireResult]],
    ) -> AcquireResult:
        """The rounds (see the module's docs); *taken* holds the reservations made and not
        given back yet, until the request's moment is decided."""
        peeks = await asyncio.gather(*(self._call(budget, cost, PEEK, 0) for budget in budgets))
        paused = [result for result in peeks if result.paused]
        if paused:
            return paused[0]
        results = list(peeks)

        async def at(n: int, moment: float) -> None:
            results[n] = await self._at(budgets[n], cost, moment, results[n])
            if _taken(results[n]):
                taken.append((budgets[n].name, results[n]))

        for _ in range(ROUNDS):
            now = self._clock.monotonic()
            moments = [_moment(result, now) for result in results]
            moment = max(moments)
            if moment - now > reserve:
                break
            first = moments.index(moment)
            await at(first, moment)
            if taken:
                outcomes = await asyncio.gather(
                    *(at(n, moment) for n in range(len(budgets)) if n != first),
                    return_exceptions=True,  # every reservation made is known before a raise
                )
                for outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        raise outcome
                if len(taken) == len(budgets):
                    taken.clear()  # decided
                    return results[0]
                # Out of *taken* before they are given back: a request cancelled meanwhile
                # must not give them back again (the second would take another's moment).
                given, taken[:] = list(taken), []
                await self._unreserve_taken(given)
            paused = [result for result in results if result.paused]
            if paused:
                return paused[0]
        now = self._clock.monotonic()
        return _refused(results[0], max(_moment(result, now) for result in results), now)

    async def _at(
        self, budget: NodeBudget, cost: float, moment: float, last: AcquireResult
    ) -> AcquireResult:
        """*budget*'s tokens taken at *moment* (loop time), or nothing: its reply. *last*: its
        last reply, whose offset converts the moment to its node's clock."""
        later = moment - _moment(last, self._clock.monotonic())
        not_before = max(0, math.ceil(_server_us(last) + later * 1e6))
        return await self._call(budget, cost, 0.0, not_before)

    async def _call(
        self, budget: NodeBudget, cost: float, reserve: float, not_before: int
    ) -> AcquireResult:
        return await self._node.acquire(
            budget.name, budget.limit, cost, reserve, budget.busy_until, not_before, budget.alone
        )

    async def _unreserve_taken(self, taken: list[tuple[str, AcquireResult]]) -> None:
        """Give back the moments *taken* reserved (taken now ones are spent: they cannot be
        told from the next request's). A failure leaves them spent too."""
        results = await asyncio.gather(
            *(
                self._node.unreserve(name, [result.reservation])
                for name, result in taken
                if result.reservation is not None
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, RedisError):
                raise result


def _taken(result: AcquireResult) -> bool:
    return result.allowed or result.reserved


def _moment(result: AcquireResult, now: float) -> float:
    """When *result*, read at *now*, lets its request go (loop time; for a refusal, when it
    could)."""
    return result.decided(now) + result.retry_after


def _server_us(result: AcquireResult) -> float:
    """:func:`_moment` by its node's clock (µs since the scripts' epoch)."""
    assert result.moment_us is not None, "a reply of Redis"
    return result.moment_us


def _refused(result: AcquireResult, moment: float, now: float) -> AcquireResult:
    """*result* (its domain's reply, read by *now*) as a refusal that may ask again at
    *moment*."""
    later = moment - _moment(result, now)
    return dataclasses.replace(
        result,
        allowed=False,
        reserved=False,
        retry_after=result.retry_after + later,
        moment_us=_server_us(result) + later * 1e6,
        reservation=None,
    )
