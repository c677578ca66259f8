"""A fleet keeps every host's budget while the throttle's Redis is slow (issue #43, "a slow
Redis starves the fleet").

Six workers, the add-on line alone, with the throttle on a Redis of its own reached through a
TcpProxy (scrapy-redis's queue and parked requests stay in REDIS_URL, direct). Nine hosts, three
each at 1/s, 2/s and 3/s, with WORK seconds of pages at their rates: the workers park their
requests for moments reserved up to that far ahead. Then one host at 40/s (burst 4), whose
pages come last: the scheduler still holds hundreds of them through the spike, so each unit of
the downloader that a request frees has a taker there too. SPIKE_AT seconds after the first
arrival, the proxy holds every byte back LATENCY seconds each way (a round trip to the
throttle's Redis takes 0.4 s more) for SPIKE seconds.

A slow reply must not cost its request its moment, nor a parked request its turn: through the
spike, from its second second on, every host receives at least LEAST_SHARE of its rate (the
way a fleet starves: late replies that let their requests go at once missed those moments, and
parked requests came back seconds late, behind new requests that held every downloader unit
for a round trip). Then the crawl runs to its end: no 429 (the site refuses any request over a
domain's budget, :attr:`Domain.site_budget`: none may go early either), every page fetched
exactly once, every worker closed by itself. Run it a few times in a row::

    for run in $(seq 3); do .tox/py/bin/pytest -p no:cacheprovider -s -q \\
        tests/test_fleet_slow_redis.py || break; done
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import pytest
import redis
from demo_site import Arrival, DemoSite
from fleet_runs import (
    Domain,
    Ended,
    check_ended_well,
    check_fetched_once,
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
from processes import wait_until
from releases import MISSED
from scrapy_redis import defaults as scrapy_redis_defaults
from spiders import UrlListSpider
from tcp_proxy import TcpProxy

from scrapy_redis_throttle.redis_schema import parking_key

pytestmark = pytest.mark.fleet_scale

WORKERS = 6
DOMAINS = [Domain(f"127.0.0.{2 + n}", 1.0 + n % 3, 1) for n in range(9)]
FAST = Domain("127.0.1.2", 40.0, 4)
DOMAINS.append(FAST)
RATES = {domain.host: domain.spec for domain in DOMAINS}
BUDGET = sum(domain.rate for domain in DOMAINS)
# Seconds of work at its rate for each host: past the spike's end, whenever a host starts.
# The fast host's pages come last in each worker's start() (and its host name after the
# others' in scrapy-redis's queue): most are still to park when the spike starts.
WORK = 26.0
COUNTS = {domain.host: round(domain.rate * WORK) for domain in DOMAINS}
# Seconds from the first arrival: when the spike starts, and how long it lasts.
SPIKE_AT, SPIKE = 5.0, 12.0
LATENCY = 0.2
# The spike is measured from its second second on (the calls under way when it starts come
# back late once), and LEAST_SHARE of each host's rate is kept then; AFTER seconds after it
# (from its end's second second on), the fleet's rate.
SETTLE, LEAST_SHARE, AFTER = 1.0, 0.8, 4.0
# Seconds from the first arrival by which the whole frontier must be fetched (WORK at the
# rates, and room for a busy machine), then for the workers to close.
FETCHED_BY, CLOSED_WITHIN = 45.0, 20.0
# Where the fleet's requests are parked, in scrapy-redis's Redis.
PARKED_KEY = parking_key(scrapy_redis_defaults.SCHEDULER_QUEUE_KEY % {"spider": UrlListSpider.name})
# Stats of the throttle quoted on a failure, per worker.
QUOTED = ("missed_moments", "park_requests", "parked", "delayed", "allowed_immediately",
          "redis_calls", "voidings_read", "wait_time_max", "lost_reservations", "outages")  # fmt: skip


def count(arrivals: list[Arrival], start: float, end: float, host: str | None = None) -> int:
    """Arrivals answered 200 (of *host*, else of any) from *start* to *end* (monotonic)."""
    return sum(
        a.status == 200 and start <= a.time < end and host in (None, a.host) for a in arrivals
    )


def per_second(arrivals: list[Arrival], since: float, first: int, last: int) -> str:
    """Each host's arrivals answered 200 (429s in brackets) and the fleet's, in each second
    from *first* to *last* (whole seconds from *since*, the spike's start), a line a second."""
    counts: Counter[tuple[int, str, int]] = Counter(
        (int((a.time - since) // 1), a.host, a.status) for a in arrivals
    )
    lines = ["  s from spike " + "".join(f"{d.host.removeprefix('127.0.'):>8}" for d in DOMAINS)]
    lines.append("  (rate /s)   " + "".join(f"{d.rate:>8g}" for d in DOMAINS) + "   fleet")
    for second in range(first, last + 1):
        cells = [
            f"{counts[second, d.host, 200]:>4}"
            + (f"[{counts[second, d.host, 429]:>2}]" if counts[second, d.host, 429] else "    ")
            for d in DOMAINS
        ]
        total = sum(counts[second, d.host, 200] for d in DOMAINS)
        lines.append(f"  {second:>+12} " + "".join(cells) + f"{total:>8}")
    return "\n".join(lines)


def worker_stats(ends: list[Ended]) -> str:
    """What each worker's throttle did: QUOTED, and the moments it missed per host."""
    lines = []
    for index, end in enumerate(ends):
        quoted = {
            stat: value
            for stat in QUOTED
            if (value := end.stats.get(f"redis_throttle/{stat}")) is not None
        }
        lines.append(
            f"  worker {index} (exit {end.returncode}): {json.dumps(quoted)}; missed per "
            f"host: {json.dumps(end.stats.get(MISSED, {}), sort_keys=True)}"
        )
    return "\n".join(lines)


def round_trip(url: str) -> float:
    """Seconds a PING to the Redis at *url* takes, on a new connection."""
    with redis.Redis.from_url(url) as client:
        client.ping()  # connected
        sent = time.monotonic()
        client.ping()
        return time.monotonic() - sent


def unparked(site: DemoSite, redis_url: str) -> int:
    """The pages neither fetched nor parked (some may be under way): those the scheduler or
    the workers' start() still hold."""
    with redis.Redis.from_url(redis_url) as client:
        parked = int(client.zcard(PARKED_KEY))
    return sum(COUNTS.values()) - parked - len(fetched(site.arrivals()))


def stop_and_report(workers: list[subprocess.Popen[str]]) -> str:
    """SIGINT the workers, and what their throttles did (for a failure's message)."""
    interrupt(workers)
    return worker_stats(wait_for_workers(workers, 30, "SIGINT"))


def test_a_fleet_keeps_every_budget_while_the_throttles_redis_is_slow(
    redis_server: RedisServer, own_redis: RedisServer
) -> None:
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    with (
        TcpProxy(own_redis.port) as proxy,
        DemoSite([d.host for d in DOMAINS], pages=COUNTS, overload=overload) as site,
    ):
        settings = one_line_settings(
            redis_server.url, None, addon=True, REDIS_THROTTLE_URL=proxy.url
        )
        jobs = fleet_jobs(site, settings, COUNTS, RATES, WORKERS)
        with fleet(redis_server.url, jobs) as workers:
            wait_until(lambda: site.arrivals(), 30, "a first arrival")
            began = time.monotonic()

            def at(seconds: float, since: float = began) -> None:
                time.sleep(max(0.0, since + seconds - time.monotonic()))

            at(SPIKE_AT)
            proxy.latency = LATENCY
            spiked = time.monotonic()
            left = [unparked(site, redis_server.url)]
            slow = round_trip(proxy.url)  # the proxy holds the replies back indeed
            at(SPIKE, spiked)
            proxy.latency = 0.0
            calm = time.monotonic()
            left.append(unparked(site, redis_server.url))
            at(SETTLE + AFTER, calm)
            arrivals = site.arrivals()

            def fleet_rate(start: float, end: float) -> float:
                return count(arrivals, start, end) / (end - start)

            phases = {
                "before": fleet_rate(began + SETTLE, spiked),
                "during": fleet_rate(spiked + SETTLE, calm),
                "after": fleet_rate(calm + SETTLE, calm + SETTLE + AFTER),
            }
            measured = calm - spiked - SETTLE
            shares = {
                d.host: count(arrivals, spiked + SETTLE, calm, d.host) / (d.rate * measured)
                for d in DOMAINS
            }
            figures = (
                "fleet rate before/during/after the spike: "
                + "/".join(f"{rate:.1f}" for rate in phases.values())
                + f" requests/s of {BUDGET:g}/s; least share of a host's rate during it: "
                f"{min(shares.values()):.2f}; a PING through the proxy took {slow:.2f} s; pages "
                f"not yet parked at its start and end: {left[0]}, {left[1]}; "
                f"{refused(arrivals)} 429s so far"
            )
            print(figures)
            table = per_second(arrivals, spiked, -int(SPIKE_AT), int(SPIKE + SETTLE + AFTER))
            assert slow >= 2 * LATENCY, figures
            short = {host: f"{share:.2f}" for host, share in shares.items() if share < LEAST_SHARE}
            if short:  # judged at once: a starved fleet takes long to end
                raise AssertionError(
                    f"hosts below {LEAST_SHARE:.0%} of their rates during the spike: {short}\n"
                    f"{figures}\n{table}\n{refusals(arrivals)}\n{stop_and_report(workers)}"
                )
            done = wait_for(
                lambda: all(
                    len(fetched(site.arrivals(host))) == total for host, total in COUNTS.items()
                ),
                max(0.0, began + FETCHED_BY - time.monotonic()),
            )
            if not done:
                raise AssertionError(
                    f"not every page fetched {FETCHED_BY:g} s after the first arrival: "
                    f"{progress(site, COUNTS)}\n{table}\n{stop_and_report(workers)}"
                )
            ends = wait_for_workers(workers, CLOSED_WITHIN, "the last page (they close when idle)")
        arrivals = site.arrivals()

    check_ended_well(ends)
    paths = Counter((a.host, a.path) for a in arrivals if a.status == 200)
    print(
        f"{len(arrivals)} arrivals in {max(a.time for a in arrivals) - began:.1f} s, "
        f"{sum(paths.values())} pages fetched ({sum(n > 1 for n in paths.values())} twice)\n"
        + worker_stats(ends)
    )
    last = int(max(a.time for a in arrivals) - spiked)
    assert refused(arrivals) == 0, (
        f"{refusals(arrivals)}\n{per_second(arrivals, spiked, -int(SPIKE_AT), last)}\n"
        + worker_stats(ends)
    )
    check_fetched_once(arrivals, COUNTS)
