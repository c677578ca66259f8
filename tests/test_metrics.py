"""The ``/metrics`` endpoint of a real crawl of a real local site, scraped while it crawls."""

from __future__ import annotations

import json
import logging
import re
import socket
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from metrics_scrape import REQUESTS, WAITS, endpoint_url, fetch, samples, scrape, value
from opentelemetry import metrics as otel_metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scrapy import signals
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.test import get_crawler
from support import async_test, crawl_settings, pages, run_crawl

from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.fleet_exporter import FleetCollector
from scrapy_redis_throttle.metrics import WAIT_BUCKETS, ThrottleMetrics, WorkerState
from scrapy_redis_throttle.metrics_endpoint import WorkerCollector
from scrapy_redis_throttle.stats import redis_error_stat

A, B, C = HOSTS


@async_test
async def test_the_metrics_count_what_the_site_saw(own_redis: RedisServer, site: DemoSite) -> None:
    """A at 10/s and B at 5/s (their waits past REDIS_THROTTLE_MAX_HOLD parked), C unlimited,
    two requests with dont_redis_throttle and one with an invalid cost: the counts scraped at
    the end are the site's arrivals, exactly."""
    requests = [
        *pages(site, A, 15),
        *pages(site, B, 8),
        *pages(site, C, 4),
        *pages(site, C, 2, first=100, dont_redis_throttle=True),
        *pages(site, B, 1, first=100, redis_throttle_cost=-1),
    ]
    scrapes: list[str] = []
    addresses: list[str] = []

    def during(response: Any, request: Any, spider: Any) -> None:
        if len(scrapes) == 0 and len(site.arrivals()) >= 10:
            scrapes.append(scrape(spider.crawler))

    def idle(spider: Any) -> None:
        scrapes.append(scrape(spider.crawler))
        addresses.append(endpoint_url(spider.crawler))

    await run_crawl(
        crawl_settings(own_redis.url, REDIS_THROTTLE_METRICS_PORT=0, REDIS_THROTTLE_MAX_HOLD=0.3),
        requests,
        {signals.response_received: during, signals.spider_idle: idle},
        redis_throttle_rates={A: "10/s", B: "5/s", C: None},
    )

    assert len(scrapes) >= 2, "scraped while crawling and at the end"
    first, last = samples(scrapes[0]), samples(scrapes[-1])
    for host, count in ((A, 15), (B, 8)):
        assert len(site.arrivals(host)) == count
        assert value(last, REQUESTS, domain=host, result="acquired") == count, host
        assert value(last, WAITS, domain=host) == count, host
        assert value(first, REQUESTS, domain=host, result="acquired") <= count, host
        assert value(last, "scrapy_redis_throttle_waiting_requests", domain=host) == 0
    assert value(last, "scrapy_redis_throttle_wait_seconds_sum", domain=A) > 0
    assert len(site.arrivals(C)) == 6
    assert value(last, REQUESTS, domain=C, result="unthrottled") == 6
    assert value(last, REQUESTS, domain=B, result="rejected") == 1
    # Their reservations' steps: Redis's rates in force.
    assert value(last, "scrapy_redis_throttle_rate", domain=A) == 10
    assert value(last, "scrapy_redis_throttle_rate", domain=B) == 5
    assert value(last, "scrapy_redis_throttle_fallback_active") == 0
    assert value(last, "scrapy_redis_throttle_fleet_workers") == 1
    # The endpoint closed with the crawl.
    with pytest.raises(urllib.error.URLError):
        fetch(addresses[0])


@pytest.fixture(scope="module")
def otel_reader() -> InMemoryMetricReader:
    """The SDK's in-memory reader, behind the global MeterProvider (set once per process)."""
    reader = InMemoryMetricReader()
    otel_metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return reader


@async_test
async def test_opentelemetry_counts_what_the_site_saw(
    own_redis: RedisServer, site: DemoSite, otel_reader: InMemoryMetricReader
) -> None:
    await run_crawl(
        crawl_settings(own_redis.url, REDIS_THROTTLE_METRICS_OTEL=True),
        [*pages(site, A, 6), *pages(site, C, 2)],
        redis_throttle_rates={A: "10/s", C: None},
    )

    data = otel_reader.get_metrics_data()
    assert data is not None
    found: dict[str, dict[tuple[tuple[str, Any], ...], Any]] = {
        metric.name: {
            tuple(sorted((point.attributes or {}).items())): point
            for point in metric.data.data_points
        }
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        if scope.scope.name == "scrapy_redis_throttle"
        for metric in scope.metrics
    }
    requests = found["scrapy_redis_throttle.requests"]
    assert len(site.arrivals(A)) == 6
    assert requests[("domain", A), ("result", "acquired")].value == 6
    assert requests[("domain", C), ("result", "unthrottled")].value == 2
    wait = found["scrapy_redis_throttle.wait"][(("domain", A),)]
    assert wait.count == 6
    assert tuple(wait.explicit_bounds) == WAIT_BUCKETS
    assert found["scrapy_redis_throttle.rate"][(("domain", A),)].value == 10
    assert found["scrapy_redis_throttle.fallback_active"][()].value == 0
    assert found["scrapy_redis_throttle.fleet_workers"][()].value == 1


DASHBOARD = (
    Path(__file__).resolve().parent.parent / "docs" / "grafana" / "scrapy-redis-throttle.json"
)
METRICS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "metrics.rst"
NAME = re.compile(r"\bscrapy_redis_throttle_[a-z_]+\b")


class _OneWorker:
    fleet_size = 1


def _exported(redis_server: RedisServer) -> set[str]:
    """The names of the families and samples a worker's /metrics and the exporter serve."""
    collector = MemoryStatsCollector(get_crawler())
    collector.inc_value(redis_error_stat("TimeoutError"))
    metrics = ThrottleMetrics(True, worker=WorkerState(fleet=_OneWorker(), stats=collector))
    metrics.went(A, "acquired", 0.1, 1.0, None)
    metrics.paused(A, "429")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(metrics.snapshot))
    with redis_server.client() as client:
        registry.register(FleetCollector(LiveControl(client, "redis_throttle"), 10, print))
        text = generate_latest(registry).decode()
    # A gauge's family name is its samples' (the exporter's may have none here).
    return {
        name
        for family in text_string_to_metric_families(text)
        for name in (
            *(sample.name for sample in family.samples),
            *([family.name] if family.type in ("gauge", "histogram") else []),
        )
    }


def test_the_dashboard_and_the_docs_name_only_exported_metrics(redis_server: RedisServer) -> None:
    exported = _exported(redis_server)
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel["targets"]
    ] + [variable["definition"] for variable in dashboard["templating"]["list"]]
    assert len(expressions) >= 10
    for expression in expressions:
        names = NAME.findall(expression)
        assert names, f"no metric in {expression!r}"
        assert set(names) <= exported, f"{expression!r} names what nobody exports"
    documented = set(NAME.findall(METRICS_PAGE.read_text(encoding="utf-8")))
    served = {name for name in exported if not name.endswith(("_bucket", "_count", "_sum"))}
    assert documented - exported == set(), "documented, not exported"
    assert served - documented == set(), "exported, not documented"


def _two_free_ports() -> tuple[socket.socket, int]:
    """A socket listening on a port whose next port is free too (for now)."""
    while True:
        taken = socket.create_server(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        try:
            socket.create_server(("127.0.0.1", port + 1)).close()
        except OSError:
            taken.close()
            continue
        return taken, port


@async_test
async def test_the_endpoint_takes_the_first_free_port_of_its_range(
    own_redis: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """A range whose first port is taken: the next. A port taken alone: the crawl goes on
    without the endpoint, and an ERROR names the setting."""
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    taken, port = _two_free_ports()
    served: list[str] = []
    with taken:

        def opened(spider: Any) -> None:
            served.append(endpoint_url(spider.crawler))

        for ports in ([port, port + 1], port):
            await run_crawl(
                crawl_settings(own_redis.url, REDIS_THROTTLE_METRICS_PORT=ports),
                pages(site, A, 1, first=len(served)),
                {signals.spider_idle: opened} if ports != port else {},
                redis_throttle_rates={A: "10/s"},
            )
    assert served == [f"http://127.0.0.1:{port + 1}/metrics"]
    assert len(site.arrivals(A)) == 2, "both crawls crawled"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"Redis throttle: no metrics endpoint: REDIS_THROTTLE_METRICS_PORT {port} has no free "
        f"port on '127.0.0.1' ([Errno 98] Address already in use)"
    ]
