"""Faults piled up on a fleet that crawls to the end (issue #36): a worker killed and replaced,
the throttle's Redis killed and restarted empty while requests wait parked for moments reserved
far ahead, and a worker stopped (SIGSTOP) for a while. The add-on line alone, with the
throttle on a Redis of its own (scrapy-redis's queue and parked requests stay in REDIS_URL).

The site answers 429 to any request over a domain's budget (:attr:`Domain.site_budget`, the
configured limit): one is a request the fleet sent over its limit. Run it ten times in a row::

    for run in $(seq 10); do .tox/py/bin/pytest -p no:cacheprovider -s -q \\
        tests/test_fleet_faults.py || break; done
"""

from __future__ import annotations

import signal
import time
from collections import Counter

from demo_site import HOSTS, DemoSite
from fleet_runs import (
    Domain,
    check_ended_well,
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
from processes import start_crawl_worker, wait_until
from releases import EXTENSION as RELEASES_EXTENSION
from releases import RELEASED

# The slow domain has a long backlog: its parked requests hold moments up to ~15 s ahead when
# the throttle's Redis restarts.
SLOW = Domain(HOSTS[0], 2.0, 1)
MIDDLE = Domain(HOSTS[1], 4.0, 2)
FAST = Domain(HOSTS[2], 10.0, 2)
DOMAINS = [SLOW, MIDDLE, FAST]
COUNTS = {SLOW.host: 44, MIDDLE.host: 60, FAST.host: 150}
RATES = {domain.host: domain.spec for domain in DOMAINS}
# Seconds from the first arrival: each fault, and how long it lasts.
KILL_AT, REPLACE_AFTER = 3.0, 2.0
RESTART_AT, REDIS_DOWN = 7.0, 3.0
STOP_AT, STOPPED = 12.0, 3.0
# A killed worker's requests come back to the others this long after its last renewal.
LEASE_TTL = 6


def test_a_fleet_keeps_every_limit_through_kills_a_redis_restarted_empty_and_a_stop(
    redis_server: RedisServer, own_redis: RedisServer
) -> None:
    settings = one_line_settings(
        redis_server.url,
        None,
        addon=True,
        REDIS_THROTTLE_URL=own_redis.url,
        REDIS_THROTTLE_LEASE_TTL=LEASE_TTL,
    )
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    with DemoSite(HOSTS[:3], pages=COUNTS, overload=overload) as site:
        jobs = fleet_jobs(site, settings, COUNTS, RATES)
        with fleet(redis_server.url, jobs) as workers:
            wait_until(lambda: site.arrivals(), 30, "a first arrival")
            began = time.monotonic()

            def at(seconds: float) -> None:
                time.sleep(max(0.0, began + seconds - time.monotonic()))

            at(KILL_AT)
            workers[0].kill()
            at(KILL_AT + REPLACE_AFTER)
            # The replacement takes work from the shared queue only (its requests are there).
            replacement = start_crawl_worker(
                {
                    "settings": {**settings, "EXTENSIONS": RELEASES_EXTENSION},
                    "requests": [],
                    "spider_attributes": {"redis_throttle_rates": RATES},
                }
            )
            workers.append(replacement)
            at(RESTART_AT)
            own_redis.stop()
            at(RESTART_AT + REDIS_DOWN)
            own_redis.start()  # empty, on the same port
            at(STOP_AT)
            workers[1].send_signal(signal.SIGSTOP)
            at(STOP_AT + STOPPED)
            workers[1].send_signal(signal.SIGCONT)
            done = wait_for(
                lambda: all(
                    len(fetched(site.arrivals(host))) == count for host, count in COUNTS.items()
                ),
                120,
            )
            assert done, f"not every page fetched: {progress(site, COUNTS)}"
            ends = wait_for_workers(workers[1:], 60, "the last page (they close when idle)")
        arrivals = site.arrivals()

    check_ended_well(ends)
    stats = [end.stats for end in ends]

    def total(stat: str) -> int:
        return sum(each.get(f"redis_throttle/{stat}", 0) for each in stats)

    paths = Counter((a.host, a.path) for a in arrivals if a.status == 200)
    print(
        f"{len(arrivals)} arrivals in {max(a.time for a in arrivals) - began:.1f} s, "
        f"{refused(arrivals)} 429s; {sum(paths.values())} pages fetched "
        f"({sum(n > 1 for n in paths.values())} twice); Redis lost its state for "
        f"{sum(each.get('redis_throttle/state_lost', 0) > 0 for each in stats)} of "
        f"{len(stats)} workers; {total('lost_reservations')} moments lost, asked anew; "
        f"outages {total('outages')}"
    )
    # When a 429 came: what the workers said of Redis, and when each released requests of its
    # host in the second before it (ms before it), to tell which of them paced how.
    told = [
        f"worker {index}: {line}"
        for index, end in enumerate(ends)
        for line in end.log.splitlines()
        if "Redis throttle: Redis at" in line
    ]
    for refusal in (a for a in arrivals if a.status == 429):
        told.append(f"429 at {refusal.time - began:.2f} s (faults from {KILL_AT} s):")
        for index, each in enumerate(stats):
            released = each.get(RELEASED, {}).get(refusal.host, [])
            near = [refusal.wall_time - t for t in released if -0.2 < refusal.wall_time - t < 1]
            told.append(f"  worker {index} released " + " ".join(f"{d * 1000:.0f}" for d in near))
    assert refused(arrivals) == 0, "\n".join([refusals(arrivals), *told])
    for host, count in COUNTS.items():
        pages = fetched([a for a in arrivals if a.host == host])
        assert {f"/page/{n}" for n in range(count)} <= set(pages), host
    # The two first workers ran through the restart, and read once that Redis lost its state
    # (the replacement may have started while Redis was down, and read the new one first).
    assert [each.get("redis_throttle/state_lost") for each in stats[:2]] == [1, 1]
    assert stats[2].get("redis_throttle/state_lost") in (None, 1)
    assert total("lost_reservations") > 0, "no moment was reserved across the restart"
