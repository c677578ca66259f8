"""The one-line set-up: only ``DOWNLOADER_MIDDLEWARES = {"scrapy_redis_throttle.
RedisThrottleMiddleware": 950}`` beside scrapy-redis's own scheduler and dupefilter, Scrapy's
default concurrency, and the limits in the spider's ``redis_throttle_rates``. No parking
scheduler, no REDIS_THROTTLE_FALLBACK_WORKERS: a fleet set up so must still share each domain's
budget fully, close promptly and keep the limits through an outage of the throttle's Redis.

Three ``crawl_worker.py`` processes crawl the demo site through scrapy-redis's shared queue (one
key for all of them: each page is in exactly one worker's job), judged from the site's arrivals.
The site answers 429 to whatever exceeds a domain's budget (:attr:`Domain.site_budget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from demo_site import HOSTS, DemoSite
from fleet_runs import (
    DOMAINS,
    FAST,
    FRONTIER_DEADLINE,
    FRONTIERS,
    MIDDLE,
    RATES,
    SLOW,
    WORKERS,
    Domain,
    check_ended_well,
    fetched,
    fleet,
    fleet_jobs,
    interrupt,
    one_line_settings,
    progress,
    refusals,
    refused,
    wait_for,
    wait_for_workers,
)
from local_redis import RedisServer
from run_demo import busiest_window
from support import achieved_rate, assert_released_paced, missed_moments, wait_until

UTILISATION = 0.9

# The two one-line set-ups, each with one of the two concurrencies (Scrapy's default
# CONCURRENT_REQUESTS_PER_DOMAIN, 8, is None: not set): the middleware line binds parking onto
# the project's scheduler, the add-on composes it (ParkingScheduler).
SETUPS = pytest.mark.parametrize(
    ("per_domain", "addon"),
    [(1, False), (None, True)],
    ids=["middleware-line-per-domain-1", "addon-per-domain-default"],
)

CLOSE_TIMEOUT = 8
"""CLOSESPIDER_TIMEOUT of the prompt-close test."""
CLOSE_GRACE = 5.0
"""How long a worker may take to close, from CLOSESPIDER_TIMEOUT or from a SIGINT."""
# Far more than 3 workers can crawl in CLOSE_TIMEOUT at these rates.
HUGE = {SLOW.host: 100, MIDDLE.host: 100, FAST.host: 600}

OUTAGE = Domain(HOSTS[0], 5.0, 5)
FAULT_AFTER = 15
"""Arrivals before the fault (2 s at 5/s after a burst of 5)."""
FAULT_SECONDS = 10.0
# The fault's 10 s plus 10 s of shared limits after it, at 5/s: 2 + 10 + 10 s of crawling.
OUTAGE_PAGES = OUTAGE.burst + int(OUTAGE.rate * 22)


@pytest.mark.parametrize("frontier", FRONTIERS)
@SETUPS
def test_every_domain_uses_its_whole_budget(
    redis_server: RedisServer, frontier: str, per_domain: int | None, addon: bool
) -> None:
    """Every domain with work gets at least 0.9 of its budget while it has work, none more
    than its budget (no 429), whatever the other domains' share of the frontier. Slow-rich: the
    fleet is stopped (SIGINT) once the fast domain is done, and the fast and middle domains are
    judged; the slow one must only keep its pace."""
    counts = FRONTIERS[frontier]
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    settings = one_line_settings(redis_server.url, per_domain, addon)
    with DemoSite(HOSTS, pages=counts, overload=overload) as site:
        jobs = fleet_jobs(site, settings, counts, RATES)
        with fleet(redis_server.url, jobs) as workers:
            go = time.monotonic()
            if frontier == "even":
                done = wait_for(
                    lambda: all(len(fetched(site.arrivals(h))) == n for h, n in counts.items()),
                    FRONTIER_DEADLINE,
                )
                assert done, (
                    f"not every page fetched in {FRONTIER_DEADLINE:g} s: {progress(site, counts)}"
                )
                stopped = None
                ends = wait_for_workers(workers, 30, "the last page (they close when idle)")
            else:
                fast_done = wait_for(
                    lambda: len(fetched(site.arrivals(FAST.host))) == counts[FAST.host],
                    FRONTIER_DEADLINE,
                )
                stopped = time.monotonic()
                sent = interrupt(workers)
                ends = wait_for_workers(workers, CLOSE_GRACE + 10, "a SIGINT")
                closed = max(end.at - at for end, at in zip(ends, sent, strict=True))
                print(f"slow-rich, per-domain {per_domain}: closed {closed:.2f} s after SIGINT")
                # A fast domain stalled behind the slow one's requests would keep a good pace
                # over the few pages it got: it must get them all.
                assert fast_done, (
                    f"{FAST.host} not done in {FRONTIER_DEADLINE:g} s: {progress(site, counts)}"
                )
                assert closed <= CLOSE_GRACE, f"closed {closed:.2f} s after SIGINT"
        arrivals = {domain.host: site.arrivals(domain.host) for domain in DOMAINS}

    check_ended_well(ends)
    judged = [domain for domain in DOMAINS if frontier == "even" or domain is not SLOW]
    utilisations = {}
    for domain in DOMAINS:
        host = domain.host
        times = sorted(a.time for a in arrivals[host])
        busy = [t for t in times if stopped is None or t <= stopped]
        assert len(busy) >= domain.burst + 2, f"{host}: only {len(busy)} arrivals"
        # A slot a busy worker missed (by over waiting.MISSED_AFTER) is lost, for politeness.
        missed = missed_moments([end.stats for end in ends], host)
        utilisations[host] = achieved_rate(busy, domain.burst, missed) / domain.rate
        print(
            f"{frontier}, per-domain {per_domain}: {host} at {domain.rate:g}/s: "
            f"{len(busy)} arrivals from {busy[0] - go:.2f} s to {busy[-1] - go:.2f} s after the go,"
            f" utilisation {utilisations[host]:.2f}, missed moments {missed}, "
            f"429s {refused(arrivals[host])}"
        )
    for domain in DOMAINS:
        host = domain.host
        assert refused(arrivals[host]) == 0, refusals(arrivals[host])
        # Paced as the throttle let them go (a request's new connection then delays it more,
        # at the site: the site's 429s above judge those arrivals), and none arrived before.
        assert_released_paced(
            [end.stats for end in ends], arrivals[host], domain.rate, domain.burst, host
        )
        twice = [path for path, n in fetched(arrivals[host]).items() if n > 1]
        assert twice == [], f"{host}: fetched twice: {twice}"
    low = {
        d.host: round(utilisations[d.host], 2) for d in judged if utilisations[d.host] < UTILISATION
    }
    assert low == {}, f"domains that used under {UTILISATION:g} of their budget while busy: {low}"


@SETUPS
def test_closespider_timeout_closes_every_worker_promptly(
    redis_server: RedisServer, per_domain: int | None, addon: bool
) -> None:
    """With far more work than fits in CLOSESPIDER_TIMEOUT, each worker closes within
    CLOSE_GRACE of it (its stat elapsed_time_seconds counts from its spider's opening)."""
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    settings = one_line_settings(
        redis_server.url, per_domain, addon, CLOSESPIDER_TIMEOUT=CLOSE_TIMEOUT
    )
    with DemoSite(HOSTS, pages=HUGE, overload=overload) as site:
        with fleet(redis_server.url, fleet_jobs(site, settings, HUGE, RATES)) as workers:
            # The workers opened before the go: CLOSE_TIMEOUT from it is an upper bound.
            ends = wait_for_workers(workers, CLOSE_TIMEOUT + CLOSE_GRACE + 10, "the go")
        arrivals = site.arrivals()

    check_ended_well(ends)
    elapsed = [end.stats["elapsed_time_seconds"] for end in ends]
    print(
        f"CLOSESPIDER_TIMEOUT {CLOSE_TIMEOUT} s, per-domain {per_domain}: elapsed "
        + ", ".join(f"{e:.2f} s" for e in elapsed)
        + f"; {len(arrivals)} arrivals, {refused(arrivals)} 429s"
    )
    assert [end.stats["finish_reason"] for end in ends] == ["closespider_timeout"] * WORKERS
    assert max(elapsed) <= CLOSE_TIMEOUT + CLOSE_GRACE, (
        f"elapsed_time_seconds {elapsed}: over {CLOSE_TIMEOUT} s + {CLOSE_GRACE:g} s"
    )
    assert refused(arrivals) == 0, refusals(arrivals)


@SETUPS
def test_sigint_closes_every_worker_promptly(
    redis_server: RedisServer, per_domain: int | None, addon: bool
) -> None:
    """Ctrl-C mid-crawl (with work waiting for every domain): each worker exits, cleanly,
    within CLOSE_GRACE of its signal."""
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    settings = one_line_settings(redis_server.url, per_domain, addon)
    with DemoSite(HOSTS, pages=HUGE, overload=overload) as site:
        with fleet(redis_server.url, fleet_jobs(site, settings, HUGE, RATES)) as workers:
            wait_until(
                lambda: len(site.arrivals(FAST.host)) >= 60, 30, f"60 arrivals at {FAST.host}"
            )
            sent = interrupt(workers)
            ends = wait_for_workers(workers, CLOSE_GRACE + 10, "a SIGINT")
        arrivals = site.arrivals()

    closed = [end.at - at for end, at in zip(ends, sent, strict=True)]
    print(
        f"SIGINT, per-domain {per_domain}: exited "
        + ", ".join(f"{c:.2f} s" for c in closed)
        + f" after it; finish reasons {[end.stats.get('finish_reason') for end in ends]}"
    )
    check_ended_well(ends)
    assert [end.stats["finish_reason"] for end in ends] == ["shutdown"] * WORKERS
    assert max(closed) <= CLOSE_GRACE, f"exited {closed} s after SIGINT"
    assert refused(arrivals) == 0, refusals(arrivals)


FAULTS: dict[str, tuple[Callable[[RedisServer], object], Callable[[RedisServer], object]]] = {
    "killed": (RedisServer.stop, RedisServer.start),  # and restarted empty, on the same port
    "stopped": (RedisServer.pause, RedisServer.resume),  # SIGSTOP, then SIGCONT
}


# Each fault with one of the two set-ups: they pace one domain alike while Redis fails.
@pytest.mark.parametrize(
    ("fault", "per_domain", "addon"),
    [("killed", None, True), ("stopped", 1, False)],
    ids=["killed-addon-per-domain-default", "stopped-middleware-line-per-domain-1"],
)
def test_an_outage_of_the_throttles_redis_keeps_the_fleet_within_the_limit(
    redis_server: RedisServer,
    own_redis: RedisServer,
    fault: str,
    per_domain: int | None,
    addon: bool,
) -> None:
    """The throttle on a Redis of its own (REDIS_THROTTLE_URL; scrapy-redis's queue and parked
    requests stay in REDIS_URL, untouched) fails for FAULT_SECONDS. No
    REDIS_THROTTLE_FALLBACK_WORKERS: each worker must pace the domain at rate / (workers seen
    live), so the fleet stays within the limit and one burst more (a fresh local bucket per
    worker at the switches). No page is lost."""
    host = OUTAGE.host
    inject, recover = FAULTS[fault]
    # The site refuses only what breaks the bound asserted: a 429 is a broken limit.
    overload = {host: OUTAGE.overload(extra=OUTAGE.burst)}
    settings = one_line_settings(
        redis_server.url,
        per_domain,
        addon,
        REDIS_THROTTLE_URL=own_redis.url,
        # With the default horizon (300 s) the whole frontier is reserved in Redis in the first
        # seconds, and a fault after that goes unseen (the moments are the fleet's already):
        # reserving at most 1 s ahead, every worker needs Redis all through the fault.
        REDIS_THROTTLE_MAX_RESERVE=1,
    )
    counts = {host: OUTAGE_PAGES}
    rates = {host: OUTAGE.spec}
    with DemoSite([host], pages=counts, overload=overload) as site:
        with fleet(redis_server.url, fleet_jobs(site, settings, counts, rates)) as workers:
            wait_until(
                lambda: len(site.arrivals(host)) >= FAULT_AFTER,
                30,
                f"{FAULT_AFTER} arrivals before the fault",
            )
            began = time.monotonic()
            inject(own_redis)
            time.sleep(FAULT_SECONDS)  # the fault's duration
            ended = time.monotonic()
            recover(own_redis)
            done = wait_for(lambda: len(fetched(site.arrivals(host))) == OUTAGE_PAGES, 60)
            assert done, f"not every page fetched 60 s after the fault: {progress(site, counts)}"
            ends = wait_for_workers(workers, 30, "the last page (they close when idle)")
        arrivals = site.arrivals(host)

    check_ended_well(ends)
    times = sorted(a.time for a in arrivals)
    during = [t for t in times if began <= t < ended]
    paths = fetched(arrivals)
    lost = sorted({f"/page/{n}" for n in range(OUTAGE_PAGES)} - set(paths))
    twice = sorted(path for path, n in paths.items() if n > 1)
    print(
        f"throttle's Redis {fault} for {FAULT_SECONDS:g} s, per-domain {per_domain}: "
        f"{len(during)} arrivals during it ({len(during) / FAULT_SECONDS:.2f}/s, limit "
        f"{OUTAGE.rate:g}/s), busiest 1 s {busiest_window(times, 1.0)} (budget "
        f"{OUTAGE.site_budget}); {refused(arrivals)} 429s; {len(twice)} pages fetched twice; "
        f"outages {[end.stats.get('redis_throttle/outages') for end in ends]}, paced locally "
        f"{[end.stats.get('redis_throttle/fallback/local') for end in ends]}"
    )
    assert lost == [], f"pages never fetched: {lost}"
    assert during, "no request went during the fault"
    for index, end in enumerate(ends):
        assert end.stats.get("redis_throttle/outages", 0) >= 1, f"worker {index}: {end.stats}"
        assert end.stats.get("redis_throttle/fallback/local", 0) > 0, f"worker {index}: {end.stats}"
    # The rate, and one burst at each switch (to local pacing and back).
    assert_released_paced(
        [end.stats for end in ends], arrivals, OUTAGE.rate, OUTAGE.burst, host, extra=OUTAGE.burst
    )
