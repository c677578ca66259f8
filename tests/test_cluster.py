"""Redis Cluster (part of #9): every script call touches the keys of one hash slot; and, on a
real cluster of 3 primaries with a replica each, the tool, a slot moved under a running fleet
(ASK and MOVED), and failovers. (tests/test_fleet.py runs its fleet on such a cluster too.)"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer, free_port
from redis_topologies import UNUSED_URL, LocalCluster
from scrapy.settings import Settings
from support import (
    add_worker_user,
    assert_released_paced,
    async_test,
    crawl_settings,
    crawl_through_failover,
    documented_cluster_rights,
    finish_crawl_workers,
    one_domain_jobs,
    pages,
    run_crawl,
    start_crawl_workers,
    tool,
    wait_until,
)

from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.cli import EXIT_REDIS_FAILED
from scrapy_redis_throttle.config import ThrottleConfig
from scrapy_redis_throttle.connection import close, connect
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.rates import Limit, parse_limit
from scrapy_redis_throttle.redis_schema import bucket_key
from scrapy_redis_throttle.replies import AcquireResult
from scrapy_redis_throttle.scripts import load_script
from scrapy_redis_throttle.server_clock import FIRST_READS

A, B, C = HOSTS
PREFIX = "redis_throttle"


@pytest.fixture
def cluster_node(tmp_path: Path) -> Iterator[RedisServer]:
    """A cluster-enabled redis-server that serves every slot: Redis checks each script call's
    keys as a cluster node does (CROSSSLOT), and answers CLUSTER KEYSLOT."""
    server = RedisServer(
        "--cluster-enabled", "yes",
        "--cluster-config-file", str(tmp_path / "nodes.conf"),
        # Not the default port + 10000, which may be taken or above 65535.
        "--cluster-port", str(free_port()),
    ).start()  # fmt: skip
    with server.client() as client:
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_until(
            lambda: (
                client.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") >= 0
            ),
            30,
            "the one-node cluster to be up",
        )
    yield server
    server.stop()


class ScriptCalls:
    """Every EVALSHA / EVAL the server runs, with its keys (MONITOR, in a thread)."""

    def __init__(self, server: RedisServer) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self._client = server.client()
        self._monitor = self._client.monitor()  # type: ignore[no-untyped-call]
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                command = self._monitor.next_command()["command"].split()
                if command and command[0].upper() in ("EVALSHA", "EVAL"):
                    self.calls.append((command[1][:8], command[3 : 3 + int(command[2])]))
        except (redis.ConnectionError, ValueError, OSError):
            pass  # closed

    def close(self) -> None:
        self._monitor.connection.disconnect()
        self._thread.join(timeout=10)
        self._client.close()


@async_test
async def test_every_script_call_touches_one_slot(cluster_node: RedisServer) -> None:
    """A crawl that uses every script of the throttle (buckets with quotas and the adaptive
    rate, a 429's pause and decrease, parking counts, limits set live) on a cluster node."""
    errors = {(A, "/page/1"): [(429, {"Retry-After": "1"})]}
    calls = ScriptCalls(cluster_node)
    try:
        with redis.Redis.from_url(cluster_node.url) as client:
            control = LiveControl(client, "redis_throttle")
            window = parse_limit(
                {"rate": "3/s", "algorithm": "sliding_window"}, default_burst=1, source=""
            )
            assert window is not None
            control.set(B, 10, 2, window.quotas)
            control.pause(C)
            control.resume(C)
        with DemoSite(HOSTS, pages=10, errors=errors) as site:
            crawler = await run_crawl(
                crawl_settings(
                    cluster_node.url,
                    SCHEDULER="scrapy_redis_throttle.ThrottleScheduler",
                    REDIS_THROTTLE_MAX_HOLD=0,
                    REDIS_THROTTLE_REPORT_INTERVAL=0.1,
                    REDIS_THROTTLE_ADAPTIVE_ENABLED=True,
                ),
                pages(site, A, 4) + pages(site, B, 6) + pages(site, C, 2),
                redis_throttle_rates={
                    A: ["10/s", {"rate": "20/m", "algorithm": "fixed_window"}],
                    C: "5/s",
                },
            )
    finally:
        calls.close()

    stats: dict[str, Any] = crawler.stats.get_stats()
    assert stats["test/responses"] == 12
    assert not [key for key in stats if "errors" in key], "no CROSSSLOT, no other error"
    assert stats["redis_throttle/adaptive/lowered"] == 1
    assert stats["redis_throttle/parked"] >= 1
    scripts = script_names()
    with cluster_node.client() as client:

        def slot(key: str) -> int:
            return int(client.execute_command("CLUSTER", "KEYSLOT", key))

        seen: dict[str, set[int]] = {}
        for sha, keys in calls.calls:
            name = scripts.get(sha, sha)
            seen.setdefault(name, set()).add(len(keys))
            assert len({slot(key) for key in keys}) == 1, f"{name}: keys {keys} in several slots"
    # Each script, with every set of keys it takes here: a bucket and its adaptive rate, and
    # those with the quota hash and log.
    assert seen == {
        "token_bucket.lua": {2, 4},
        "penalty.lua": {3},
        "slow_down.lua": {3},
        "set_limit.lua": {3},
        "parked.lua": {1},
        "fleet.lua": {1},
    }


def script_names() -> dict[str, str]:
    """Each worker script's name, by the first 8 hex digits of its SHA-1 (as MONITOR shows)."""
    names = (
        "token_bucket.lua",
        "penalty.lua",
        "slow_down.lua",
        "set_limit.lua",
        "parked.lua",
        "fleet.lua",
        "voided.lua",
    )
    return {hashlib.sha1(load_script(name).encode()).hexdigest()[:8]: name for name in names}


@async_test
async def test_script_calls_follow_ask_and_moved_and_run_once(redis_cluster: LocalCluster) -> None:
    """20 calls at a time on a domain's bucket, before its slot moves, while its key has left
    (ASK) and after (MOVED): each one runs once, where the key is. (redis-py's own client sends
    ASKING on one of its pooled connections and the call on another: most such calls failed.)"""
    key = bucket_key(PREFIX, A)
    slot = redis_cluster.slot(key)
    source = redis_cluster.owner(slot)
    target = next(node for node in redis_cluster.primaries() if node is not source)
    target_id = redis_cluster.node_id(target)
    client = connect(
        ThrottleConfig.from_settings(
            Settings({"REDIS_URL": UNUSED_URL, **redis_cluster.settings()})
        )
    )
    bucket = TokenBucket(client, PREFIX)
    limit = Limit(rate=0.001, burst=100, text="100 tokens, none back during the test")
    results: list[AcquireResult] = []

    async def twenty_calls() -> None:
        results.extend(await asyncio.gather(*(bucket.acquire(A, limit) for _ in range(20))))

    try:
        await twenty_calls()
        with source.client() as old, target.client() as new:
            new.execute_command(
                "CLUSTER", "SETSLOT", slot, "IMPORTING", redis_cluster.node_id(source)
            )
            old.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            old.execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 5000)
            await twenty_calls()
            asked = errors(source, "ASK")
            for node in redis_cluster.primaries():
                with node.client() as each:
                    each.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            await twenty_calls()
            moved = errors(source, "MOVED")
            in_slot = [
                node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) for node in (old, new)
            ]
            assert in_slot == [0, 1], "the key moved"
    finally:
        await bucket.aclose()
        await close(client)

    assert all(result.allowed for result in results)
    assert sorted(round(result.tokens_left) for result in results) == list(range(40, 100)), (
        "60 tokens taken, one by each call"
    )
    assert asked >= 20
    assert moved >= 1


@async_test
async def test_reserved_moments_go_back_on_a_cluster(redis_cluster: LocalCluster) -> None:
    """The bucket and its moments set aside are in one slot: given back on the primary that
    serves it, whichever that is for each domain."""
    client = connect(
        ThrottleConfig.from_settings(
            Settings({"REDIS_URL": UNUSED_URL, **redis_cluster.settings()})
        )
    )
    bucket = TokenBucket(client, PREFIX)
    limit = Limit(rate=1 / 60, burst=1, text="none back during the test")
    try:
        for domain in (A, B, C):
            first = await bucket.acquire(domain, limit, reserve=600)
            held = [await bucket.acquire(domain, limit, reserve=600) for _ in range(3)]
            assert first.allowed
            reservations = [result.reservation for result in held if result.reservation]
            assert len(reservations) == 3
            assert await bucket.unreserve(domain, reservations[:1]) == (0, 1), "set aside"
            assert await bucket.unreserve(domain, reservations[1:]) == (3, 0), domain
            again = await bucket.acquire(domain, limit, reserve=600)
            assert again.moment_us == held[0].moment_us, "the first moment given back"
    finally:
        await bucket.aclose()
        await close(client)


@async_test
async def test_each_primary_s_clock_is_read_before_its_first_reply(
    redis_cluster: LocalCluster,
) -> None:
    """Each primary has a clock of its own, which its first script reply must not set alone: a
    busy worker that read it late would place its moments that late, squeezed against the
    next ones (seen on test_fleet's cluster). So each primary's TIME is read first, a few
    times, once: its clock serves every domain it holds."""
    client = connect(
        ThrottleConfig.from_settings(
            Settings({"REDIS_URL": UNUSED_URL, **redis_cluster.settings()})
        )
    )
    bucket = TokenBucket(client, PREFIX)
    limit = Limit(rate=1, burst=5, text="1/s")
    domains = one_domain_per_primary(redis_cluster)
    # A second domain on the first one's primary.
    first_primary = redis_cluster.owner(redis_cluster.slot(bucket_key(PREFIX, domains[0])))
    neighbour = next(
        domain
        for domain in (f"neighbour-{n}.example" for n in range(100))
        if redis_cluster.owner(redis_cluster.slot(bucket_key(PREFIX, domain))) is first_primary
    )
    try:
        for domain in [*domains, neighbour]:
            assert bucket.server_clock(domain).server_us(0.0) is None or domain == neighbour
            result = await bucket.acquire(domain, limit)
            assert result.allowed, domain
            assert (
                bucket.server_clock(domain).server_us(asyncio.get_running_loop().time()) is not None
            )
        assert bucket.server_clock(neighbour) is bucket.server_clock(domains[0])
        assert len({id(bucket.server_clock(domain)) for domain in domains}) == 3
    finally:
        await bucket.aclose()
        await close(client)
    # TIME counts the reads, and each script's own (once per acquire).
    time_calls = {
        node.port: redis_cluster.info(node, "commandstats").get("cmdstat_time", {}).get("calls")
        for node in redis_cluster.primaries()
    }
    acquires = {node.port: 1 for node in redis_cluster.primaries()}
    acquires[first_primary.port] = 2
    assert time_calls == {port: FIRST_READS + n for port, n in acquires.items()}


@async_test
async def test_the_probe_of_a_failed_call_goes_to_its_primary(redis_cluster: LocalCluster) -> None:
    """After a call for A failed, the breaker's probe must ask A's primary: another primary may
    answer while A's is down, and closing the breaker then would switch back and forth."""
    primary = redis_cluster.owner(redis_cluster.slot(bucket_key(PREFIX, A)))
    client = connect(
        ThrottleConfig.from_settings(
            Settings({"REDIS_URL": UNUSED_URL, **redis_cluster.settings()})
        )
    )
    bucket = TokenBucket(client, PREFIX)
    try:
        for _ in range(3):
            await bucket.probe(A)
    finally:
        await bucket.aclose()
        await close(client)
    calls = {
        node.port: redis_cluster.info(node, "commandstats")
        .get("cmdstat_evalsha", {})
        .get("calls", 0)
        for node in redis_cluster.primaries()
    }
    # (The first one's NOSCRIPT counts as a call too.)
    assert calls.pop(primary.port) >= 3
    assert set(calls.values()) == {0}, "no other primary was asked"


def test_the_tool_works_on_every_node_of_a_cluster(redis_cluster: LocalCluster) -> None:
    """Domains whose keys live on three different primaries: the tool sets and lists them
    all, and its status scans every primary."""
    domains = one_domain_per_primary(redis_cluster)
    nodes = ["--cluster-nodes", redis_cluster.addresses[0]]
    for domain in domains:
        done = tool(*nodes, "set", domain, "2/s")
        assert (done.returncode, done.stderr) == (0, ""), domain
    done = tool(*nodes, "list")
    assert done.stdout == "".join(f"{domain}: 2/s (workers' burst)\n" for domain in domains)
    done = tool(*nodes, "status")
    assert [line.split()[0] for line in done.stdout.splitlines()[2:]] == domains, done.stdout


def test_the_tool_says_when_no_node_of_the_cluster_answers(tmp_path: Path) -> None:
    done = tool("--cluster-nodes", "127.0.0.1:1", "list", cwd=tmp_path)
    assert done.returncode == EXIT_REDIS_FAILED
    assert "Redis at Redis Cluster (seed nodes 127.0.0.1:1) failed: " in done.stderr


def one_domain_per_primary(cluster: LocalCluster) -> list[str]:
    """Domains (sorted) whose bucket keys are on different primaries, one per primary."""
    domains: dict[int, str] = {}
    for n in range(100):
        domain = f"shop-{n}.example"
        domains.setdefault(cluster.owner(cluster.slot(bucket_key(PREFIX, domain))).port, domain)
    assert len(domains) == 3, domains
    return sorted(domains.values())


@pytest.mark.parametrize("dropped", [None, "+asking"])
def test_a_fleet_goes_on_while_a_slot_moves(
    redis_cluster: LocalCluster, redis_server: RedisServer, dropped: str | None
) -> None:
    """Two worker processes crawl A at 10/s while its slot moves to another primary, as
    ``redis-cli --cluster reshard`` moves it. The slot's key moves first: meanwhile, the old
    node answers ASK (for a key that has left), then, once the move ends, MOVED. The workers,
    with the documented rights on a cluster, follow both, and no call fails; without ``+asking``, the
    calls sent on with ASK fail."""
    slot = redis_cluster.slot(bucket_key(PREFIX, A))
    source = redis_cluster.owner(slot)
    target = next(node for node in redis_cluster.primaries() if node is not source)
    source_id, target_id = redis_cluster.node_id(source), redis_cluster.node_id(target)
    settings = crawl_settings(
        redis_server.url,
        **redis_cluster.settings(),
        REDIS_THROTTLE_URL=add_worker_user(redis_cluster, dropped),
        REDIS_THROTTLE_FALLBACK_WORKERS=2,
        CONCURRENT_REQUESTS=2,
    )
    with DemoSite(HOSTS, pages=60) as site:
        jobs = one_domain_jobs(site, A, settings, {A: "10/s"}, 2, 30)
        workers = start_crawl_workers(redis_server.url, jobs)
        wait_until(lambda: len(site.arrivals(A)) >= 15, 60, "15 arrivals before the move")
        with source.client() as old, target.client() as new:
            new.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            old.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while keys := old.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                old.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            # The move is held here until a worker was sent on with ASK.
            wait_until(lambda: errors(source, "ASK") > 0, 30, "an ASK redirection")
            for node in (new, old):
                node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        for node in redis_cluster.primaries():
            if node not in (source, target):
                with node.client() as client:
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        wait_until(lambda: errors(source, "MOVED") > 0, 30, "a MOVED redirection")
        all_stats = finish_crawl_workers(workers, 120)
        arrivals = site.arrivals(A)

    assert redis_cluster.owner(slot) is target
    assert sorted(arrival.path for arrival in arrivals) == sorted(
        f"/page/{n}" for n in range(60)
    ), "every page once"
    failures = {name for stats in all_stats for name in stats if "errors" in name}
    if dropped is None:
        assert failures == set()
        assert_released_paced(all_stats, arrivals, 10, 1, A)
    else:  # the policy paces the calls that failed (docs, "When Redis fails")
        assert "redis_throttle/redis_errors/NoPermissionError" in failures
    print(
        f"slot moved: ASK {errors(source, 'ASK')}, MOVED {errors(source, 'MOVED')}, "
        f"TRYAGAIN {errors(source, 'TRYAGAIN') + errors(target, 'TRYAGAIN')}"
    )


@pytest.mark.parametrize(
    "dropped", [right for right in documented_cluster_rights() if right != "+asking"]
)
@async_test
async def test_each_documented_cluster_right_is_needed(
    redis_cluster: LocalCluster, dropped: str
) -> None:
    """Without it, the cluster client cannot reach the cluster: every call fails. (The test
    above shows that ``+asking`` is needed while a slot moves.)"""
    url = add_worker_user(redis_cluster, dropped)
    with DemoSite(HOSTS, pages=3) as site:
        # One worker alone: it paces locally though it never read the fleet's size.
        settings = crawl_settings(
            url, REDIS_THROTTLE_FALLBACK_WORKERS=1, **redis_cluster.settings()
        )
        crawler = await run_crawl(settings, pages(site, A, 3))
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 3
    # Every request paced by this worker alone (one may ask again after a wait: more decisions).
    assert stats["redis_throttle/fallback/local"] >= 3, stats
    assert any(name.startswith("redis_throttle/redis_errors/") for name in stats), stats


def errors(node: RedisServer, code: str) -> int:
    """How many replies of the error *code* (MOVED, ASK, ...) *node* sent."""
    with node.client() as client:
        stats = client.info("errorstats")
    return int(stats.get(f"errorstat_{code}", {}).get("count", 0))


@pytest.mark.parametrize("how", ["asked", "primary killed"])
def test_a_fleet_goes_on_through_a_cluster_failover(
    own_cluster: LocalCluster, redis_server: RedisServer, how: str
) -> None:
    """The replica of the primary that serves A's keys takes over under a running fleet,
    asked to (``CLUSTER FAILOVER``) or because the primary died (see
    :func:`crawl_through_failover`)."""
    slot = own_cluster.slot(bucket_key(PREFIX, A))
    primary = own_cluster.owner(slot)
    replica = own_cluster.replica_of(primary)

    def fail_over() -> None:
        if how == "asked":
            with replica.client() as client:
                client.execute_command("CLUSTER", "FAILOVER")
        else:
            primary.stop()

    crawl_through_failover(
        crawl_settings(redis_server.url, **own_cluster.settings()),
        redis_server.url,
        fail_over,
        lambda: own_cluster.owner(slot) is replica,
        killed=how == "primary killed",
    )
