"""A host's pauses end with its requests flowing again at its limit (issue #43, "a host that
took 429 penalties of 2, 4 and 8 s sent almost nothing afterwards").

Six workers, the add-on line alone, scrapy-redis's queue. Three hosts at 2, 4 and 8/s, the
slow one with a frontier far longer than the run: its workers park their requests for moments
reserved well ahead. PAUSE_AT seconds after the first arrival the site answers the slow host's
next request 429 (no Retry-After: a pause of the backoff, 2 s); the first request after that
pause gets a 429 too (4 s), and the first after that one (8 s). Each pause voids the moments
reserved within it, whose parked requests come back and ask again. From RECOVERY after the
last pause ends, the slow host must receive requests at (nearly) its limit again for MEASURED
seconds: not a trickle behind parked requests that never come back. Then the crawl runs to
its end: no 429 but the three, every page fetched exactly once (the refused ones retried),
every worker closed by itself. Run it a few times in a row::

    for run in $(seq 10); do .tox/py/bin/pytest -p no:cacheprovider -s -q -m fleet_scale \\
        tests/test_fleet_penalties.py || break; done
"""

from __future__ import annotations

import time

import pytest
from demo_site import HOSTS, DemoSite
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
    wait_for,
    wait_for_workers,
)
from local_redis import RedisServer
from processes import wait_until

pytestmark = pytest.mark.fleet_scale

WORKERS = 6
SLOW = Domain(HOSTS[0], 2.0, 1)
MIDDLE = Domain(HOSTS[1], 4.0, 2)
FAST = Domain(HOSTS[2], 8.0, 4)
DOMAINS = [SLOW, MIDDLE, FAST]
RATES = {domain.host: domain.spec for domain in DOMAINS}
# 40 s of work at its limit for the slow host (its moments reach far past the pauses), 10 s
# for the others.
COUNTS = {SLOW.host: 80, MIDDLE.host: 40, FAST.host: 80}
# Seconds from the first arrival: the first 429. Then the pauses the backoff gives (2.0 s,
# doubled for each 429 within REDIS_THROTTLE_PENALTY_DECAY).
PAUSE_AT, PAUSES = 4.0, (2.0, 4.0, 8.0)
# From the last pause's end, how soon the slow host must receive requests at its limit again,
# for how long that is measured, and the least share of its limit it must reach then.
RECOVERY, MEASURED, LEAST_SHARE = 1.0, 6.0, 0.9
FETCHED_BY, CLOSED_WITHIN = 70.0, 20.0


def test_a_hosts_pauses_end_with_its_requests_flowing_at_its_limit(
    redis_server: RedisServer,
) -> None:
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    with DemoSite([d.host for d in DOMAINS], pages=COUNTS, overload=overload) as site:
        settings = one_line_settings(redis_server.url, None, addon=True)
        with fleet(redis_server.url, fleet_jobs(site, settings, COUNTS, RATES, WORKERS)) as workers:
            wait_until(lambda: site.arrivals(), 30, "a first arrival")
            began = time.monotonic()
            time.sleep(max(0.0, began + PAUSE_AT - time.monotonic()))  # the first 429's time
            refused: list[float] = []

            def refusals_of_slow() -> list[float]:
                return [a.time for a in site.arrivals(SLOW.host) if a.status == 429]

            for pause in PAUSES:
                site.add_errors((SLOW.host, "*"), [(429, {})])
                wait_until(
                    lambda: len(refusals_of_slow()) > len(refused),
                    pause + 10,
                    f"the slow host's 429 number {len(refused) + 1}",
                )
                refused.append(refusals_of_slow()[-1])
            ended = refused[-1] + PAUSES[-1]
            time.sleep(max(0.0, ended + RECOVERY + MEASURED - time.monotonic()))
            arrivals = site.arrivals(SLOW.host)
            after = sorted(a.time for a in arrivals if a.status == 200 and a.time > refused[-1])
            window = [at for at in after if ended + RECOVERY <= at < ended + RECOVERY + MEASURED]
            figures = (
                f"429s at +{', +'.join(f'{at - began:.2f}' for at in refused)} s; first arrival "
                f"{after[0] - refused[-1]:.2f} s after the last one (its pause: "
                f"{PAUSES[-1]:g} s); then {len(window) / MEASURED:.2f}/s of {SLOW.rate:g}/s"
                if after
                else "nothing after the last 429"
            )
            print(figures)
            assert len(window) >= LEAST_SHARE * SLOW.rate * MEASURED, figures
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
    assert after[0] >= ended, f"a request within the last pause: {figures}"
    refused_all = [a for a in arrivals if a.status == 429]
    assert len(refused_all) == len(PAUSES), refusals(arrivals)
    check_fetched_once(arrivals, COUNTS)
