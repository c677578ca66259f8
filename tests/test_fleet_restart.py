"""A fleet goes on at every limit soon after the throttle's Redis restarts empty, while
requests wait parked for moments reserved far ahead (the report "stall after the throttle's
Redis restarts empty").

Six workers, the add-on line alone, with the throttle on a Redis of its own (scrapy-redis's
queue and parked requests stay in REDIS_URL). Three hosts at 2/s, 4/s (burst 2) and 8/s
(burst 4), each with a frontier far longer than the run's first seconds: when the throttle's
Redis is killed, the two slow hosts' parked requests hold moments reserved up to ~30 s ahead.
While it is down, new requests of every host reach the shared queue (as the links a crawl
parses do all the time): a worker that takes them holds them for the first 5 s of its outage
(REDIS_THROTTLE_FALLBACK_AFTER: it might be its alone), then paces them alone, at its share,
after the moments it saw reserved. Eight seconds after the kill, Redis starts again,
empty, on the same port. The moments reserved there are lost and their requests ask anew; from
RECOVERY after the restart, every host must receive requests at (nearly) its limit again, not
after a stall as long as the lost backlog. Then the crawl runs to its end: no 429 (the site refuses any
request over a domain's budget, :attr:`Domain.site_budget`), every page fetched exactly once,
every worker closed by itself.

The workers log to files of their own: a failure quotes what they said of Redis, beside each
host's arrivals second by second. Run it a few times in a row::

    for run in $(seq 5); do .tox/py/bin/pytest -p no:cacheprovider -s -q \\
        tests/test_fleet_restart.py || break; done
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from demo_site import HOSTS, Arrival, DemoSite
from fleet_runs import (
    Domain,
    Ended,
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
from scrapy import Request
from scrapy_redis import defaults as scrapy_redis_defaults
from scrapy_redis import picklecompat
from scrapy_redis.queue import PriorityQueue
from spiders import UrlListSpider
from support import pages

pytestmark = pytest.mark.fleet_scale

WORKERS = 6
SLOW = Domain(HOSTS[0], 2.0, 1)
MIDDLE = Domain(HOSTS[1], 4.0, 2)
FAST = Domain(HOSTS[2], 8.0, 4)
DOMAINS = [SLOW, MIDDLE, FAST]
RATES = {domain.host: domain.spec for domain in DOMAINS}
# The workers' frontier: 34 s of work at its limit for each slow host (their moments reach
# ~29 s ahead when Redis is killed), 24 s for the fast one (it still has work when the
# measure ends). Then the pages that reach the queue while Redis is down, after those.
COUNTS = {SLOW.host: 68, MIDDLE.host: 136, FAST.host: 192}
NEW = {SLOW.host: 4, MIDDLE.host: 8, FAST.host: 16}
PAGES = {host: COUNTS[host] + NEW[host] for host in COUNTS}
# Seconds from the first arrival: when the throttle's Redis is killed, when the new requests
# reach the queue, and how long Redis is down.
KILL_AT, NEW_AT, REDIS_DOWN = 5.0, 5.5, 8.0
# From the restart, how soon each host must receive requests at its limit again (past the
# hand-over, REDIS_THROTTLE_PROBE_INTERVAL after each worker found Redis back), and for how long
# that is measured; the least share of its limit it must reach then.
RECOVERY, MEASURED = 1.5, 8.0
LEAST_SHARE = 0.9
# Seconds from the first arrival by which the whole frontier must be fetched (36 s at the
# limits, and room for a busy machine).
FETCHED_BY = 60.0
# Wall time with milliseconds: the lines of the workers' logs are placed against the restart.
LOG_FORMAT = "%(created).3f [%(name)s] %(levelname)s: %(message)s"


def restart_jobs(site: DemoSite, settings: dict[str, Any], logs: Path) -> list[dict[str, Any]]:
    """WORKERS jobs that share the frontier (COUNTS) between them, each page in one job, each
    worker logging at INFO to a file of its own in *logs* (at DEBUG, six workers that log each
    request's wait starve each other on two cores)."""
    jobs = fleet_jobs(site, settings, COUNTS, RATES, WORKERS)
    for worker, job in enumerate(jobs):
        job["settings"].update(
            LOG_LEVEL="INFO", LOG_FORMAT=LOG_FORMAT, LOG_FILE=str(logs / f"worker-{worker}.log")
        )
    return jobs


def queue_new_pages(site: DemoSite, redis_url: str) -> None:
    """Put the NEW pages into scrapy-redis's shared queue, as its scheduler does with the
    requests a worker's spider yields (its default queue, key and serializer)."""
    spider = UrlListSpider(requests=[])
    key = scrapy_redis_defaults.SCHEDULER_QUEUE_KEY % {"spider": spider.name}
    with redis.Redis.from_url(redis_url) as client:
        queue = PriorityQueue(client, spider, key, picklecompat)
        for host, count in NEW.items():
            for spec in pages(site, host, count, first=COUNTS[host]):
                queue.push(
                    Request(spec["url"], callback=spider.parse, errback=spider.failed,
                            dont_filter=True)
                )  # fmt: skip


def per_second(arrivals: list[Arrival], since: float, first: int, last: int) -> str:
    """Each host's arrivals answered 200 (429s in brackets) in each second from *first* to
    *last* (whole seconds from *since*, monotonic time), a line a second."""
    counts: Counter[tuple[int, str, int]] = Counter(
        (int((a.time - since) // 1), a.host, a.status) for a in arrivals
    )
    lines = ["  s from restart " + "".join(f"{d.host:>16}" for d in DOMAINS)]
    for second in range(first, last + 1):
        cells = [
            f"{counts[second, d.host, 200]:>11}"
            + (f" [{counts[second, d.host, 429]:>2}]" if counts[second, d.host, 429] else "     ")
            for d in DOMAINS
        ]
        lines.append(f"  {second:>+14} " + "".join(cells))
    return "\n".join(lines)


def log_lines(logs: Path, since_wall: float, first: float) -> list[tuple[float, int, str]]:
    """(seconds from *since_wall*, worker, line) of every line the workers logged from *first*
    seconds from it on."""
    found = []
    for path in sorted(logs.glob("worker-*.log")):
        worker = int(path.stem.removeprefix("worker-"))
        for line in path.read_text(errors="replace").splitlines():
            stamp, _, rest = line.partition(" ")
            try:
                at = float(stamp) - since_wall
            except ValueError:
                continue  # a traceback's lines
            if at >= first:
                found.append((at, worker, rest))
    return sorted(found)


def what_workers_said(logs: Path, restart_wall: float, last: float) -> str:
    """What the workers said of Redis from the kill on until *last* (s from the restart, wall
    time *restart_wall*)."""
    lines = [line for line in log_lines(logs, restart_wall, -REDIS_DOWN - 0.5) if line[0] <= last]
    out = ["the workers said of Redis (s from the restart):"]
    out += [
        f"  {at:+6.2f} s worker {worker}: {text.partition('Redis throttle: ')[2][:110]}"
        for at, worker, text in lines
        if "Redis throttle: Redis at" in text
    ]
    return "\n".join(out)


def test_every_host_gets_its_rate_again_soon_after_the_throttles_redis_restarts_empty(
    redis_server: RedisServer, own_redis: RedisServer, tmp_path: Path
) -> None:
    settings = one_line_settings(
        redis_server.url, None, addon=True, REDIS_THROTTLE_URL=own_redis.url
    )
    overload = {domain.host: domain.overload() for domain in DOMAINS}
    with DemoSite(HOSTS[:3], pages=PAGES, overload=overload) as site:
        jobs = restart_jobs(site, settings, tmp_path)
        with fleet(redis_server.url, jobs) as workers:
            wait_until(lambda: site.arrivals(), 30, "a first arrival")
            began = time.monotonic()

            def at(seconds: float, since: float = began) -> None:
                time.sleep(max(0.0, since + seconds - time.monotonic()))

            at(KILL_AT)
            own_redis.stop()  # SIGKILL
            at(NEW_AT)
            queue_new_pages(site, redis_server.url)
            at(KILL_AT + REDIS_DOWN)
            own_redis.start()  # empty, on the same port
            restarted, restart_wall = time.monotonic(), time.time()
            at(RECOVERY + MEASURED, restarted)
            arrivals = site.arrivals()
            window = (restarted + RECOVERY, restarted + RECOVERY + MEASURED)
            got = {
                domain.host: sum(
                    a.host == domain.host and a.status == 200 and window[0] <= a.time < window[1]
                    for a in arrivals
                )
                for domain in DOMAINS
            }
            short = {
                domain.host: f"{got[domain.host] / MEASURED:.2f}/s of {domain.rate:g}/s"
                for domain in DOMAINS
                if got[domain.host] < LEAST_SHARE * domain.rate * MEASURED
            }
            # Judged at once: a fleet that stalls would take as long as its lost backlog to end.
            assert not short, (
                f"from {RECOVERY} s to {RECOVERY + MEASURED} s after the throttle's Redis "
                f"restarted empty, hosts below {LEAST_SHARE:.0%} of their limits: {short} "
                f"(killed {KILL_AT} s after the first arrival, down {REDIS_DOWN} s; "
                f"{refused(arrivals)} 429s so far)\n"
                + per_second(arrivals, restarted, -int(KILL_AT + REDIS_DOWN),
                             int(RECOVERY + MEASURED))
                + f"\n{refusals(arrivals)}\n"
                + what_workers_said(tmp_path, restart_wall, RECOVERY + MEASURED)
            )  # fmt: skip
            done = wait_for(
                lambda: all(
                    len(fetched(site.arrivals(host))) == count for host, count in PAGES.items()
                ),
                max(0.0, began + FETCHED_BY - time.monotonic()),
            )
            if not done:
                arrivals = site.arrivals()
                last = time.monotonic() - restarted
                raise AssertionError(
                    f"not every page fetched {FETCHED_BY} s after the first arrival: "
                    f"{progress(site, PAGES)}\n"
                    + per_second(arrivals, restarted, -int(KILL_AT + REDIS_DOWN), int(last))
                    + "\n"
                    + what_workers_said(tmp_path, restart_wall, last)
                )
            ends = wait_for_workers(workers, 30, "the last page (they close when idle)")
        arrivals = site.arrivals()

    # Each worker's log: its file, and what it wrote to stderr.
    ends = [
        Ended(end.returncode, end.at, end.stats,
              end.log + (tmp_path / f"worker-{index}.log").read_text(errors="replace"))
        for index, end in enumerate(ends)
    ]  # fmt: skip
    check_ended_well(ends)
    stats = [end.stats for end in ends]
    paths = Counter((a.host, a.path) for a in arrivals if a.status == 200)
    last = max(a.time for a in arrivals)
    print(
        f"{len(arrivals)} arrivals in {last - began:.1f} s, {refused(arrivals)} 429s; "
        f"{sum(paths.values())} pages fetched ({sum(n > 1 for n in paths.values())} twice); "
        f"from the restart's +{RECOVERY:g} s for {MEASURED:g} s: "
        + ", ".join(f"{host} {n / MEASURED:.2f}/s" for host, n in got.items())
        + "; Redis lost its state for "
        f"{sum(each.get('redis_throttle/state_lost', 0) > 0 for each in stats)} of "
        f"{len(stats)} workers; "
        f"{sum(each.get('redis_throttle/lost_reservations', 0) for each in stats)} moments "
        f"lost, asked anew; {sum(each.get('redis_throttle/fallback/local', 0) for each in stats)}"
        " requests paced alone"
    )
    assert refused(arrivals) == 0, (
        refusals(arrivals)
        + "\n"
        + per_second(arrivals, restarted, -int(KILL_AT + REDIS_DOWN), int(last - restarted))
    )
    check_fetched_once(arrivals, PAGES)
    # Every worker ran through the restart, and read once that Redis lost its state.
    assert [each.get("redis_throttle/state_lost") for each in stats] == [1] * WORKERS
