"""Fixtures: real redis-server processes on free ports, and a real multi-host HTTP site."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLE_PROJECT = Path(__file__).resolve().parent.parent / "example_project"
sys.path.insert(0, str(EXAMPLE_PROJECT))

from demo_site import HOSTS, DemoSite  # noqa: E402 - needs the path above
from local_redis import RedisServer  # noqa: E402
from redis_topologies import LocalCluster, SentinelSetup, Topology  # noqa: E402


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def redis_server(shared_redis: RedisServer) -> RedisServer:
    """The session's redis-server, emptied for this test."""
    with shared_redis.client() as client:
        client.flushall()
    return shared_redis


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server for this test alone, for tests that stop or restart it."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def site() -> Iterator[DemoSite]:
    with DemoSite(HOSTS, pages=50) as demo_site:
        yield demo_site


@pytest.fixture
def sentinel_setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    setup = SentinelSetup(tmp_path / "sentinel")
    try:
        yield setup.start()
    finally:
        setup.stop()


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(shared_cluster: LocalCluster) -> LocalCluster:
    """The session's Redis Cluster, emptied for this test (slots may have moved, and primaries
    changed places with their replicas, in tests before)."""
    shared_cluster.flush()
    return shared_cluster


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A Redis Cluster for this test alone, for tests that kill its nodes."""
    cluster = LocalCluster(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def throttle_redis(request: pytest.FixtureRequest) -> Topology:
    """The throttle's Redis: scrapy-redis's (by default), or one of redis_topologies'."""
    fixtures = {"scrapy-redis's": "redis_server", "Sentinel": "sentinel_setup"}
    topology: Topology = request.getfixturevalue(
        fixtures.get(getattr(request, "param", "scrapy-redis's"), "redis_cluster")
    )
    return topology
