"""Redis Cluster: every script call touches the keys of one hash slot (part of #9)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer, free_port
from support import (
    async_test,
    crawl_settings,
    pages,
    run_crawl,
    wait_until,
)

from scrapy_redis_throttle.config import parse_limit
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.scripts import load_script

A, B, C = HOSTS


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
        "penalty.lua": {2},
        "slow_down.lua": {2},
        "set_limit.lua": {2},
        "parked.lua": {1},
    }


def script_names() -> dict[str, str]:
    """Each worker script's name, by the first 8 hex digits of its SHA-1 (as MONITOR shows)."""
    names = ("token_bucket.lua", "penalty.lua", "slow_down.lua", "set_limit.lua", "parked.lua")
    return {hashlib.sha1(load_script(name).encode()).hexdigest()[:8]: name for name in names}
