"""What a worker's metrics count, and that their ``domain`` label stays bounded."""

from __future__ import annotations

import asyncio
import tracemalloc

from fakes import FakeClock, Fleet, stats
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import async_test

from scrapy_redis_throttle.breaker import CircuitBreaker
from scrapy_redis_throttle.clock import Clock
from scrapy_redis_throttle.metrics import (
    ACQUIRED,
    CANCELED,
    OTHER,
    PAUSED_LIVE,
    REJECTED,
    RETRY_AFTER,
    WAIT_BUCKETS,
    DomainLabels,
    ThrottleMetrics,
    WorkerState,
)
from scrapy_redis_throttle.metrics_endpoint import WorkerCollector
from scrapy_redis_throttle.stats import redis_error_stat

# The names docs/reference/metrics.rst lists: a contract.
CONTRACT = {
    "scrapy_redis_throttle_requests": "counter",
    "scrapy_redis_throttle_wait_seconds": "histogram",
    "scrapy_redis_throttle_waiting_requests": "gauge",
    "scrapy_redis_throttle_rate": "gauge",
    "scrapy_redis_throttle_pauses": "counter",
    "scrapy_redis_throttle_redis_errors": "counter",
    "scrapy_redis_throttle_fallback_active": "gauge",
    "scrapy_redis_throttle_fleet_workers": "gauge",
}


def exposition(metrics: ThrottleMetrics) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(metrics.snapshot))
    return generate_latest(registry).decode()


def domain_labels(text: str) -> set[str]:
    return {
        sample.labels["domain"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "domain" in sample.labels
    }


def requests_total(text: str, result: str = ACQUIRED) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "scrapy_redis_throttle_requests_total"
        and sample.labels["result"] == result
    )


def test_the_exposition_has_the_contract_s_names_and_types() -> None:
    breaker = CircuitBreaker(0.5, 5.0, FakeClock())
    breaker.failed()  # open: the fallback decides
    collector = stats()
    collector.inc_value(redis_error_stat("ConnectionError"), 2)
    metrics = ThrottleMetrics(True, worker=WorkerState(breaker, Fleet(3), collector))
    metrics.went("a.example", ACQUIRED, 0.2, 5.0, None)
    metrics.request("a.example", REJECTED)
    metrics.paused("a.example", "429")
    metrics.paused("a.example", RETRY_AFTER)
    with metrics.holding("a.example"):
        text = exposition(metrics)

    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {name: family.type for name, family in families.items()} == CONTRACT
    found = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    a = ("domain", "a.example")
    assert found["scrapy_redis_throttle_requests_total", (a, ("result", "acquired"))] == 1
    assert found["scrapy_redis_throttle_requests_total", (a, ("result", "rejected"))] == 1
    assert found["scrapy_redis_throttle_requests_total", (a, ("result", "canceled"))] == 0
    assert found["scrapy_redis_throttle_wait_seconds_bucket", (a, ("le", "0.1"))] == 0
    assert found["scrapy_redis_throttle_wait_seconds_bucket", (a, ("le", "0.25"))] == 1
    assert found["scrapy_redis_throttle_wait_seconds_count", (a,)] == 1
    assert found["scrapy_redis_throttle_wait_seconds_sum", (a,)] == 0.2
    assert found["scrapy_redis_throttle_waiting_requests", (a,)] == 1
    assert found["scrapy_redis_throttle_rate", (a,)] == 5
    assert found["scrapy_redis_throttle_pauses_total", (a, ("reason", "429"))] == 1
    assert found["scrapy_redis_throttle_pauses_total", (a, ("reason", "retry_after"))] == 1
    assert found["scrapy_redis_throttle_redis_errors_total", (("kind", "ConnectionError"),)] == 2
    assert found["scrapy_redis_throttle_fallback_active", ()] == 1
    assert found["scrapy_redis_throttle_fleet_workers", ()] == 3
    bounds = [
        sample.labels["le"]
        for sample in families["scrapy_redis_throttle_wait_seconds"].samples
        if sample.name.endswith("_bucket")
    ]
    assert bounds == [*map(repr, WAIT_BUCKETS), "+Inf"], "1 ms to 10 min"


def test_the_rate_is_redis_s_once_a_reservation_told_it() -> None:
    metrics = ThrottleMetrics(True)
    metrics.went("a.example", ACQUIRED, 0.0, 5.0, None)
    assert metrics.snapshot().rates == {"a.example": 5.0}, "the limit's, until Redis tells"
    metrics.went("a.example", ACQUIRED, 0.3, 5.0, 2.5)  # a live limit, or the adaptive rate
    metrics.went("a.example", ACQUIRED, 0.0, 5.0, None)  # one that went at once
    assert metrics.snapshot().rates == {"a.example": 2.5}


def test_metrics_off_count_nothing() -> None:
    metrics = ThrottleMetrics(False)
    metrics.went("a.example", ACQUIRED, 0.2, 5.0, None)
    metrics.request("a.example", REJECTED)
    metrics.paused("a.example", PAUSED_LIVE)
    metrics.canceled({"a.example": 3})
    with metrics.holding("a.example"):
        snapshot = metrics.snapshot()
    assert (snapshot.series, snapshot.waiting, snapshot.rates) == ({}, {}, {})


def test_the_domain_label_is_bounded_with_10_000_hosts() -> None:
    """10,000 hosts of one request each, then five that crawl much more: at most 100 domain
    labels plus _other, the busy five among them, and nothing counted lost."""
    metrics = ThrottleMetrics(True, max_domains=100)
    for n in range(10_000):
        metrics.went(f"host{n}.example", ACQUIRED, 0.01, 1.0, None)
    busy = [f"busy{n}.example" for n in range(5)]
    for _ in range(50):
        for host in busy:
            metrics.went(host, ACQUIRED, 0.01, 1.0, None)
    metrics.canceled({"host3.example": 2, "nowhere.example": 1})
    text = exposition(metrics)

    labels = domain_labels(text)
    assert len(labels) <= 101
    assert OTHER in labels
    assert set(busy) <= labels, "the domains with the most traffic keep their labels"
    assert requests_total(text) == 10_000 + 250, "every request counted, under some label"
    assert requests_total(text, CANCELED) == 3
    assert len(text.splitlines()) < 101 * 40


def test_a_crawl_of_many_hosts_does_not_grow_the_worker_s_memory() -> None:
    """After 10,000 hosts, 50,000 more leave the metrics as large: only bounded tables."""
    metrics = ThrottleMetrics(True, max_domains=100)

    def crawl(first: int, hosts: int) -> None:
        for n in range(first, first + hosts):
            metrics.went(f"host{n}.example", ACQUIRED, 0.01, 1.0, 2.0)
            metrics.paused(f"host{n}.example", "429")
            with metrics.holding(f"host{n}.example"):
                pass

    crawl(0, 10_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        crawl(10_000, 50_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Kept, 50,000 host names alone would take some 3.5 MB.
    assert grown < 100_000, f"{grown} bytes more"
    assert len(exposition(metrics).splitlines()) < 101 * 40


def test_a_domain_takes_a_label_once_it_has_twice_the_least_labelled_one_s_traffic() -> None:
    demoted: list[str] = []
    labels = DomainLabels(2, demoted.append)
    counted = [labels.count(domain) for domain in ("a", "b", "a", "a", "c")]
    assert counted == ["a", "b", "a", "a", OTHER]
    assert labels.count("c") == "c", "2 requests: twice b's 1"
    assert demoted == ["b"]
    assert labels.label("b") == OTHER
    # b, counted again in the table, needs twice c's 2 requests: 4, from its 1 before.
    assert [labels.count("b") for _ in range(3)] == [OTHER, OTHER, "b"]
    assert demoted == ["b", "c"]


def test_domains_of_like_traffic_do_not_flap_between_labels() -> None:
    demoted: list[str] = []
    labels = DomainLabels(1, demoted.append)
    for _ in range(1000):
        labels.count("a")
        labels.count("b")
    assert demoted == []
    assert labels.label("a") == "a"


def test_a_demoted_domain_s_counts_go_to_other() -> None:
    metrics = ThrottleMetrics(True, max_domains=1)
    metrics.went("a.example", ACQUIRED, 0.5, 1.0, None)
    metrics.paused("a.example", "503")
    metrics.went("b.example", ACQUIRED, 0.5, 1.0, None)
    metrics.went("b.example", ACQUIRED, 0.5, 1.0, None)
    series = metrics.snapshot().series
    assert set(series) == {"b.example", OTHER}
    assert series[OTHER].requests == {ACQUIRED: 2}, "a's, and b's first"
    assert series[OTHER].pauses == {"503": 1}
    assert series["b.example"].requests == {ACQUIRED: 1}
    assert metrics.snapshot().rates == {"b.example": 1.0}


@async_test
async def test_the_metrics_read_an_open_breaker_from_the_endpoint_s_thread() -> None:
    """The endpoint serves in a thread of its own, where the loop's clock cannot be read: the
    snapshot of a worker whose Redis fails (its breaker open) does not read it."""
    breaker = CircuitBreaker(0.5, 5.0, Clock())
    breaker.failed()
    metrics = ThrottleMetrics(True, worker=WorkerState(breaker, Fleet(2), stats()))
    snapshot = await asyncio.to_thread(metrics.snapshot)
    assert snapshot.fallback_active
