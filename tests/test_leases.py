"""Leases (issue #22): what a worker takes from scrapy-redis's Redis stays there, leased to it,
until it is done with it; the requests of a worker that died are given back, exactly once.

The scripts on a real Redis, then a fleet of 3 worker processes of which one is SIGKILLed."""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from fleet_runs import (
    check_ended_well,
    fetched,
    fleet,
    fleet_jobs,
    one_line_settings,
    wait_for_workers,
)
from local_redis import RedisServer
from processes import start_crawl_worker
from support import wait_until

from scrapy_redis_throttle.scripts import load_script

QUEUE, LEASES, LESSEES, PARKING = "q", "q:leases:w1", "q:lessees", "q:parked"
TTL_US = 60_000_000


def scripts(client: redis.Redis) -> Callable[..., Any]:
    def call(name: str, keys: list[str], *args: Any) -> Any:
        return client.eval(load_script(name), len(keys), *keys, *args)

    return call


def expire(client: redis.Redis, worker: str = "w1") -> None:
    """As if *worker* had stopped renewing its leases long ago."""
    client.zadd(LESSEES, {worker: 0})


def fill(client: redis.Redis, kind: str) -> None:
    """A and B queued: A is taken first, B from a LIFO queue (pushed last)."""
    if kind == "priority":
        client.zadd(QUEUE, {b"A": -1, b"B": 0})
    else:
        client.lpush(QUEUE, b"A", b"B")


def test_a_request_taken_stays_leased_in_redis_until_acknowledged(
    redis_server: RedisServer,
) -> None:
    with redis_server.client() as client:
        call = scripts(client)
        for kind, first in (("fifo", b"A"), ("lifo", b"B"), ("priority", b"A")):
            client.flushall()
            fill(client, kind)
            assert (
                call("lease_pop.lua", [QUEUE, LEASES, LESSEES], kind, "w1", "id1", TTL_US) == first
            )
            assert client.hget(LEASES, "id1").endswith(b" " + first), kind
            assert client.zscore(LESSEES, "w1") is not None, kind
            assert call("renew_leases.lua", [LEASES, LESSEES], "w1", TTL_US, "id1") == 0, kind
            assert not client.exists(LEASES), f"{kind}: acknowledged, the lease is gone"
            # A worker that leaves with nothing leased leaves the lessees.
            assert call("renew_leases.lua", [LEASES, LESSEES], "w1", 0) == 0
            assert client.zcard(LESSEES) == 0, kind
        client.flushall()
        assert call("lease_pop.lua", [QUEUE, LEASES, LESSEES], "lifo", "w1", "id2", TTL_US) is None
        assert not client.exists(LEASES), "an empty queue leases nothing"


def test_only_expired_leases_are_given_back_and_only_once(redis_server: RedisServer) -> None:
    with redis_server.client() as client:
        call = scripts(client)
        for kind, after in (
            ("fifo", [b"B", b"A"]),
            ("lifo", [b"B", b"A"]),
            ("priority", [b"A", b"B"]),
        ):
            client.flushall()
            fill(client, kind)
            call("lease_pop.lua", [QUEUE, LEASES, LESSEES], kind, "w1", "id1", TTL_US)
            keys = [LESSEES, LEASES, QUEUE, PARKING]
            assert call("give_back.lua", keys, "w1", kind, "0") == [-1, 1], "alive: kept"
            assert call("expired_lessees.lua", [LESSEES], 8) == []
            expire(client)
            assert call("expired_lessees.lua", [LESSEES], 8) == [b"w1"]
            assert call("give_back.lua", keys, "w1", kind, "0") == [1, 0]
            queue = (
                client.zrange(QUEUE, 0, -1) if kind == "priority" else client.lrange(QUEUE, 0, -1)
            )
            assert queue == after, f"{kind}: back where it is taken next"
            assert not client.exists(LEASES)
            assert client.zcard(LESSEES) == 0
            assert call("give_back.lua", keys, "w1", kind, "0") == [0, 0], "given back once"


def test_parked_requests_taken_out_are_leased_and_come_back_asking_again(
    redis_server: RedisServer,
) -> None:
    member = b"r" + b"0" * 32 + b"00003abc" + b"0" * 16 + b"request"
    with redis_server.client() as client:
        call = scripts(client)
        assert call("park.lua", [PARKING, PARKING + ":moments"], "0", member) == 1
        reply = call(
            "unpark.lua",
            [PARKING, PARKING + ":moments", LEASES, LESSEES],
            "0", "10", "", "w1", TTL_US,
        )  # fmt: skip
        assert reply[3] == member
        assert client.hget(LEASES, "0" * 32).endswith(b" " + member)
        expire(client)
        keys = [LESSEES, LEASES, QUEUE, PARKING]
        assert call("give_back.lua", keys, "w1", "priority", "0") == [1, 0]
        assert client.zrange(PARKING, 0, -1) == [b"a" + member[1:]], "asks for a new moment"
        # The worker's own clean close gives back what it holds, expired or not.
        call("unpark.lua", [PARKING, PARKING + ":moments", LEASES, LESSEES], "0", "10", "",
             "w1", TTL_US)  # fmt: skip
        assert call("give_back.lua", keys, "w1", "priority", "1") == [1, 0]


@pytest.mark.parametrize(
    "args",
    [("stack", "w", "i", 1), ("fifo", "", "i", 1), ("fifo", "w", "", 1), ("fifo", "w", "i", 0),
     ("fifo", "w", "i", "nan"), ("fifo", "w", "i", 1.5)],
)  # fmt: skip
def test_lease_pop_refuses_bad_arguments(redis_server: RedisServer, args: tuple[Any, ...]) -> None:
    with (
        redis_server.client() as client,
        pytest.raises(redis.ResponseError, match="redis_throttle"),
    ):
        scripts(client)("lease_pop.lua", [QUEUE, LEASES, LESSEES], *args)


# 3 workers, 3 domains at 4/s: about 10 s of crawling; a slow one, whose requests are parked.
RATES = {HOSTS[0]: "4/s", HOSTS[1]: "4/s", HOSTS[2]: "1/s"}
COUNTS = {HOSTS[0]: 40, HOSTS[1]: 40, HOSTS[2]: 10}
LEASE_TTL = 3


def finish(
    workers: list[subprocess.Popen[str]], site: DemoSite, client: redis.Redis
) -> dict[str, Counter[str]]:
    """Wait for *workers* to end the crawl (killed if they do not); check that every page was
    fetched, that dead workers' requests were given back, and that no lease is left. What the
    site answered."""
    try:
        ends = wait_for_workers(workers, 60, "the last page")
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    arrivals = {host: fetched(site.arrivals(host)) for host in HOSTS}
    left = list(client.scan_iter("*:lease*"))
    check_ended_well(ends)
    for host, count in COUNTS.items():
        missing = {f"/page/{n}" for n in range(count)} - set(arrivals[host])
        assert not missing, f"{host}: never fetched: {sorted(missing)}"
    given = sum(end.stats.get("redis_throttle/leases/given_back", 0) for end in ends)
    assert given >= 1, "the dead workers' requests were given back"
    assert left == [], f"leases left after the crawl: {left}"
    return arrivals


def test_the_requests_of_a_killed_worker_are_crawled_by_the_others(
    redis_server: RedisServer,
) -> None:
    """A worker SIGKILLed while it holds requests (waiting, parked for later, downloading): its
    leases expire, another worker gives them back, and every page is fetched; the others and a
    replacement end the crawl. Pages fetched twice: at most those the killed worker held."""
    settings = one_line_settings(redis_server.url, None, REDIS_THROTTLE_LEASE_TTL=LEASE_TTL)
    with (
        DemoSite(HOSTS, pages=COUNTS) as site,
        fleet(redis_server.url, fleet_jobs(site, settings, COUNTS, RATES)) as workers,
        redis_server.client() as client,
    ):
        victim = workers[0]

        def held() -> int:
            keys = [
                key for key in client.scan_iter("*:leases:*") if f":{victim.pid}:" in key.decode()
            ]
            return sum(client.hlen(key) for key in keys)

        wait_until(lambda: sum(fetched(site.arrivals(h)).total() for h in HOSTS) >= 15 and held() > 0,
                   30, "15 pages fetched, and the first worker holding leases")  # fmt: skip
        held_at_kill = held()
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        replacement = start_crawl_worker({"settings": settings, "requests": [],
                                          "spider_attributes": {"redis_throttle_rates": RATES}})  # fmt: skip
        arrivals = finish([*workers[1:], replacement], site, client)

    twice = sum(n - 1 for counter in arrivals.values() for n in counter.values() if n > 1)
    assert twice <= held_at_kill, (
        f"{twice} pages fetched twice; the killed worker held {held_at_kill}"
    )


def test_a_fleet_restarted_after_every_worker_was_killed_crawls_what_they_held(
    redis_server: RedisServer,
) -> None:
    """Every worker SIGKILLed mid-crawl; once their leases expired, a new fleet (with no start
    requests of its own) gives their requests back at its start and crawls every page."""
    settings = one_line_settings(redis_server.url, None, REDIS_THROTTLE_LEASE_TTL=LEASE_TTL)
    with DemoSite(HOSTS, pages=COUNTS) as site, redis_server.client() as client:
        with fleet(redis_server.url, fleet_jobs(site, settings, COUNTS, RATES)) as workers:
            wait_until(lambda: sum(fetched(site.arrivals(h)).total() for h in HOSTS) >= 15,
                       30, "15 pages fetched")  # fmt: skip
            for worker in workers:
                worker.send_signal(signal.SIGKILL)
            for worker in workers:
                worker.wait(timeout=10)
        lessees = [key.decode() for key in client.scan_iter("*:lessees")]
        assert len(lessees) == 1, lessees
        call = scripts(client)

        def all_expired() -> bool:
            return len(call("expired_lessees.lua", lessees, 8)) == len(workers)

        wait_until(all_expired, 3 * LEASE_TTL, "the killed workers' leases to expire")
        empty = {"settings": settings, "requests": [],
                 "spider_attributes": {"redis_throttle_rates": RATES}}  # fmt: skip
        restarted = [start_crawl_worker(empty) for _ in workers]
        finish(restarted, site, client)
