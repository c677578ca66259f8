"""A worker cut off from the throttle's Redis alone adds nothing to what the fleet sends (issue
#43, "a worker cut off alone").

Six workers, the add-on line alone, with the throttle on a Redis of its own, each worker
reaching it through a TcpProxy of its own (scrapy-redis's queue and parked requests stay in
REDIS_URL, direct). Six hosts at 1, 2 and 4/s, with WORK seconds of pages at their rates: the
workers park their requests, and ask Redis for them again and again (each reserves at most 2 s
ahead), so that worker 0 has calls to make all through the cut. CUT_AT seconds after
the first arrival, worker 0's proxy swallows every byte, both ways, for CUT seconds: its calls
time out, its breaker opens, and it cannot tell that from an outage of the fleet, while the
other five still draw each whole budget from Redis. It sends only the moments it reserved
there (REDIS_THROTTLE_FALLBACK_AFTER, 5 s, is longer than the cut): it never paces alone.

Then the crawl runs to its end: no 429 (the site refuses any request over a domain's budget,
:attr:`Domain.site_budget`), every page fetched exactly once, every worker closed by itself.
Run it a few times in a row::

    for run in $(seq 10); do .tox/py/bin/pytest -p no:cacheprovider -s -q -m fleet_scale \\
        tests/test_fleet_partition.py || break; done
"""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import ExitStack

import pytest
from demo_site import DemoSite
from fleet_runs import (
    Domain,
    check_ended_well,
    check_fetched_once,
    fetched,
    fleet,
    fleet_jobs,
    one_line_settings,
    progress,
    refusals,
    refused,
    wait_for,
    wait_for_workers,
)
from local_redis import RedisServer
from processes import wait_until
from tcp_proxy import TcpProxy

pytestmark = pytest.mark.fleet_scale

WORKERS = 6
DOMAINS = [Domain(f"127.0.0.{2 + n}", (1.0, 2.0, 4.0)[n % 3], 1) for n in range(6)]
RATES = {domain.host: domain.spec for domain in DOMAINS}
WORK = 20.0
COUNTS = {domain.host: round(domain.rate * WORK) for domain in DOMAINS}
# Seconds from the first arrival: when worker 0 is cut off, and for how long (its calls time
# out after 1 s, so its breaker opens a second or so into the cut, and its hold lasts past it).
CUT_AT, CUT = 5.0, 3.0
FETCHED_BY, CLOSED_WITHIN = 45.0, 20.0
# Stats of the throttle quoted, per worker.
QUOTED = ("outages", "fallback/held", "fallback/local", "fallback_time", "missed_moments",
          "lost_reservations", "park_requests", "delayed")  # fmt: skip


def test_a_worker_cut_off_alone_adds_nothing_to_what_the_fleet_sends(
    redis_server: RedisServer, own_redis: RedisServer
) -> None:
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    with ExitStack() as stack:
        proxies = [stack.enter_context(TcpProxy(own_redis.port)) for _ in range(WORKERS)]
        site = stack.enter_context(
            DemoSite([d.host for d in DOMAINS], pages=COUNTS, overload=overload)
        )
        # With the default horizon (300 s) the whole frontier is reserved in Redis in the first
        # seconds, and a cut after that goes unseen (the moments are the fleet's already):
        # reserving at most 2 s ahead, every worker asks Redis all through the cut.
        settings = one_line_settings(
            redis_server.url, None, addon=True, REDIS_THROTTLE_MAX_RESERVE=2
        )
        jobs = fleet_jobs(site, settings, COUNTS, RATES, WORKERS)
        for job, proxy in zip(jobs, proxies, strict=True):
            job["settings"]["REDIS_THROTTLE_URL"] = proxy.url
        with fleet(redis_server.url, jobs) as workers:
            wait_until(lambda: site.arrivals(), 30, "a first arrival")
            began = time.monotonic()
            time.sleep(max(0.0, began + CUT_AT - time.monotonic()))  # the fault's start
            proxies[0].blackhole(True)
            cut = time.monotonic()
            time.sleep(CUT)  # the fault's duration
            proxies[0].blackhole(False)
            healed = time.monotonic()
            done = wait_for(
                lambda: all(
                    len(fetched(site.arrivals(host))) == total for host, total in COUNTS.items()
                ),
                max(0.0, began + FETCHED_BY - time.monotonic()),
            )
            assert done, f"not every page fetched {FETCHED_BY:g} s after the first arrival: " + (
                progress(site, COUNTS)
            )
            ends = wait_for_workers(workers, CLOSED_WITHIN, "the last page (they close when idle)")
        arrivals = site.arrivals()

    check_ended_well(ends)
    during = {
        d.host: sum(
            a.status == 200 and a.host == d.host and cut <= a.time < healed for a in arrivals
        )
        / (d.rate * (healed - cut))
        for d in DOMAINS
    }
    quoted = [{stat: end.stats.get(f"redis_throttle/{stat}") for stat in QUOTED} for end in ends]
    paths = Counter((a.host, a.path) for a in arrivals if a.status == 200)
    figures = (
        f"{len(arrivals)} arrivals in {max(a.time for a in arrivals) - began:.1f} s, "
        f"{refused(arrivals)} 429s; {sum(paths.values())} pages fetched "
        f"({sum(n > 1 for n in paths.values())} twice); each host's share of its rate during "
        f"the cut: {json.dumps({h.removeprefix('127.0.0.'): round(s, 2) for h, s in during.items()})}"
        f"\n  cut worker: {json.dumps(quoted[0])}\n  others: "
        + "; ".join(json.dumps(each) for each in quoted[1:])
    )
    print(figures)
    assert refused(arrivals) == 0, f"{refusals(arrivals)}\n{figures}"
    assert (quoted[0]["outages"] or 0) >= 1, f"worker 0 was not cut off: {figures}"
    assert (quoted[0]["fallback/held"] or 0) > 0, f"worker 0 held nothing: {figures}"
    assert quoted[0]["fallback/local"] is None, f"worker 0 paced alone: {figures}"
    assert all(each["outages"] is None for each in quoted[1:]), f"others cut off: {figures}"
    check_fetched_once(arrivals, COUNTS)
