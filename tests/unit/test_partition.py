"""A worker cut off from the throttle's Redis alone, while the rest of the fleet still reaches
it (issue #43): it cannot tell that from an outage of the fleet, so for
REDIS_THROTTLE_FALLBACK_AFTER it sends nothing it did not reserve in Redis, and the others
keep drawing each whole budget there (see :meth:`.Fallback.decide`). On a fake clock, with
the fleet's calls on one Redis in memory and one worker's path to it cut."""

from __future__ import annotations

import asyncio

from fakes import CutPath, FakeClock, MemoryScripts, limit, refused_by_the_site, resilient_bucket
from support import async_test

from scrapy_redis_throttle.config import DEFAULT_FALLBACK_AFTER
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.resilience import ResilientBucket

A = "a.example"
SIX_PER_SECOND = limit("6/s")
WORKERS = 3
CUT_AT = 5.0


async def sends(
    clock: FakeClock, bucket: ResilientBucket, each: Limit, until: float
) -> list[float]:
    """A worker's requests of A, two under way at a time, each going at the moment it was
    given (by Redis, or by this worker alone), until *until* (loop time): their moments."""
    sent: list[float] = []

    async def one_at_a_time() -> None:
        while clock.now < until:
            grant = await bucket.acquire(A, each, 1)
            result = grant.result
            if result.allowed or result.reserved:
                await clock.sleep(result.retry_after)
                sent.append(clock.now)
            else:  # held, or asked to wait for this worker's share (the handover)
                await clock.sleep(result.retry_after)

    await asyncio.gather(one_at_a_time(), one_at_a_time())
    return sent


async def cut_one_worker(
    cut_for: float, until: float, **settings: object
) -> tuple[list[list[float]], float]:
    """Three workers (with *settings*) send to A at 6/s; at CUT_AT the path of worker 0 alone
    is cut, for *cut_for* seconds. Each worker's sends until *until*, and when the cut began
    (loop time)."""
    clock = FakeClock()
    scripts = MemoryScripts(clock)
    paths = [CutPath(scripts) for _ in range(WORKERS)]
    workers = [
        resilient_bucket(clock, fleet=WORKERS, scripts=scripts, path=path, **settings)[0]
        for path in paths
    ]
    start = clock.now

    async def cut() -> None:
        await clock.sleep(CUT_AT)
        paths[0].cut = True
        await clock.sleep(cut_for)
        paths[0].cut = False

    cutting = asyncio.ensure_future(cut())
    sent = await clock.run(
        asyncio.gather(*(sends(clock, bucket, SIX_PER_SECOND, start + until) for bucket in workers))
    )
    assert cutting.done()
    for bucket in workers:
        await bucket.aclose()
    return sent, start + CUT_AT


@async_test
async def test_a_worker_cut_off_alone_adds_nothing_to_what_the_fleet_sends() -> None:
    """Cut off for less than REDIS_THROTTLE_FALLBACK_AFTER: the fleet never sends more than
    the limit (a site allowing 6/s refuses nothing), and the two others take the whole budget
    meanwhile."""
    cut_for = DEFAULT_FALLBACK_AFTER - 0.5
    sent, cut_at = await cut_one_worker(cut_for, until=20.0)
    assert refused_by_the_site([at for each in sent for at in each], SIX_PER_SECOND) == []
    during = [at for each in sent for at in each if cut_at + 1 <= at < cut_at + cut_for]
    assert len(during) >= 0.95 * 6 * (cut_for - 1), f"{len(during)} sends in {cut_for - 1} s"
    alone = [at for at in sent[0] if cut_at + 1 <= at < cut_at + cut_for]
    assert alone == [], "the cut worker sent beyond the moments Redis gave it"


@async_test
async def test_a_worker_cut_off_longer_paces_its_share_alone_and_never_stops_for_good() -> None:
    """Cut off past REDIS_THROTTLE_FALLBACK_AFTER, the outage may be the fleet's: the worker
    paces its share alone (here on top of the others: the trade-off its setting tunes)."""
    cut_for = DEFAULT_FALLBACK_AFTER + 10
    sent, cut_at = await cut_one_worker(cut_for, until=CUT_AT + cut_for)
    held = [at for at in sent[0] if cut_at + 1 <= at < cut_at + DEFAULT_FALLBACK_AFTER]
    assert held == []
    paced = [at for at in sent[0] if cut_at + DEFAULT_FALLBACK_AFTER <= at < cut_at + cut_for]
    # Its share, 2/s; the requests held come back WAIT_FOR_REDIS apart at most.
    assert len(paced) >= 2 * (cut_for - DEFAULT_FALLBACK_AFTER - 5), paced
    assert len(paced) <= 2 * (cut_for - DEFAULT_FALLBACK_AFTER) + 1, paced


@async_test
async def test_without_the_hold_the_cut_worker_adds_its_share() -> None:
    """What the hold prevents (REDIS_THROTTLE_FALLBACK_AFTER = 0): sends over the limit."""
    cut_for = DEFAULT_FALLBACK_AFTER - 0.5
    sent, _ = await cut_one_worker(cut_for, until=20.0, REDIS_THROTTLE_FALLBACK_AFTER=0)
    assert refused_by_the_site([at for each in sent for at in each], SIX_PER_SECOND) != []
