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


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


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
    server.stop()


@pytest.fixture
def site() -> Iterator[DemoSite]:
    with DemoSite(HOSTS, pages=50) as demo_site:
        yield demo_site
