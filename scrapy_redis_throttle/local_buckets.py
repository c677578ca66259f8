"""Each domain's pace in this process alone, while Redis fails (the ``"local"`` policy, see
:mod:`.fallback`): the scripts' algorithm on this process's clock, at its share of the fleet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .replies import AcquireResult

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from .budgets import Budget
    from .clock import Clock
    from .rates import Limit

# Local buckets that are full again are forgotten once there are this many (or twice as many as
# after the last clean-up): a crawl of millions of domains must not grow without bound.
LOCAL_PRUNE_SIZE = 10_000


class LocalBuckets:
    """Per-domain buckets in this process, for the ``"local"`` policy: the same algorithm as
    ``token_bucket.lua`` (GCRA), on *clock*'s monotonic time, at the rate and the burst divided
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

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._full_at: dict[str, float] = {}  # GCRA's "theoretical arrival time"
        # The domains this process took tokens of locally and has not told Redis of since, by
        # the number of their last local take (a take after a call was sent is told by the next).
        self._untold: dict[str, int] = {}
        self._takes = 0
        self._prune_size = LOCAL_PRUNE_SIZE
        # The moments this process gave out alone that may not have come yet, per bucket, in
        # order: (moment, the bucket's time before that take), for :meth:`returned`.
        self._alone: dict[str, list[tuple[float, float]]] = {}

    def __len__(self) -> int:
        return len(self._full_at)

    def follow(
        self,
        domain: str,
        shared: AcquireResult,
        others: Sequence[Budget] = (),
        cost: float = 1,
    ) -> None:
        """Record *shared*, Redis's decision for a request of *domain* (and for its
        *others* scopes, whose buckets are full again at least the request's own time after its
        moment)."""
        now = self._clock.monotonic()
        decided = shared.decided(now)
        full_at = decided + shared.reset_after
        self._full_at[domain] = max(self._full_at.get(domain, now), full_at)
        if self._alone:
            # Redis's view since: what was taken alone before stays as it is (see returned).
            self._alone.pop(domain, None)
        if shared.allowed or shared.reserved:
            moment = decided + shared.retry_after
            for name, each in others:
                taken = moment + cost / each.rate
                self._full_at[name] = max(self._full_at.get(name, now), taken)
                self._alone.pop(name, None)
        self._prune(now)

    def seen(self, domain: str) -> bool:
        """Whether these buckets know where *domain*'s shared bucket was (see :meth:`follow`), or
        took tokens of it."""
        return domain in self._full_at

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
        if domain not in self._untold or full_at <= self._clock.monotonic():
            return 0.0
        return full_at

    def tell_again(self) -> None:
        """Redis failed: once it is back, every bucket still busy is told again, as if its tokens
        were taken locally. It may have lost them (restarted empty; a replica that had not
        caught up took over), and requests hold moments reserved there."""
        now = self._clock.monotonic()
        for domain, full_at in self._full_at.items():
            if full_at > now:
                self._takes += 1
                self._untold[domain] = self._takes

    def lost(self) -> None:
        """Redis lost what it held (restarted empty): every moment reserved before, there or
        in this process alone, is void (its request asks anew), and none is told to the new
        buckets, which would stand idle for it. What went before is told as one bound by
        :class:`.ResilientBucket`: each bucket counts as drained when the loss was read."""
        self._full_at.clear()
        self._untold.clear()
        self._alone.clear()

    def returned(self) -> None:
        """Redis answers again: the moments this process gave out alone that have not come
        yet are void (their requests ask Redis, see :meth:`.Fallback.returned_since`), and are
        not told to Redis as busy: each bucket goes back to its time before the first of them,
        which still counts what went alone and what was seen reserved in Redis."""
        now = self._clock.monotonic()
        for name, takes in self._alone.items():
            for moment, before in takes:
                if moment > now:
                    if name in self._full_at:
                        self._full_at[name] = min(self._full_at[name], before)
                    break
        self._alone.clear()

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
        others: Sequence[Budget] = (),
    ) -> AcquireResult:
        """Take *cost* tokens of *domain*'s share of *limit* in a fleet of *workers*, and of
        the shares of the request's *others* scopes (see :meth:`.TokenBucket.acquire`): at
        the latest moment any of them allows."""
        now = self._clock.monotonic()
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
            takes = [take for take in self._alone.get(name, ()) if take[0] > now]
            takes.append((now + wait, each_full_at))
            self._alone[name] = takes
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
        self._alone = {
            domain: takes for domain, takes in self._alone.items() if domain in self._full_at
        }
        self._prune_size = max(LOCAL_PRUNE_SIZE, 2 * len(self._full_at))
