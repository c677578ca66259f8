"""Scrapes of a crawl's ``/metrics`` endpoint, read into samples."""

from __future__ import annotations

import urllib.request
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from scrapy_redis_throttle import RedisThrottleMiddleware

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
REQUESTS = "scrapy_redis_throttle_requests_total"
WAITS = "scrapy_redis_throttle_wait_seconds_count"


def scrape(crawler: Crawler) -> str:
    """The text of *crawler*'s ``/metrics`` now. Blocking, which the reactor's thread may do:
    the endpoint answers from a thread of its own."""
    return fetch(endpoint_url(crawler))


def endpoint_url(crawler: Crawler) -> str:
    """The URL of *crawler*'s ``/metrics``."""
    assert crawler.engine is not None
    (middleware,) = [
        m
        for m in crawler.engine.downloader.middleware.middlewares
        if isinstance(m, RedisThrottleMiddleware)
    ]
    endpoint = middleware.throttle.metrics_endpoint
    assert endpoint is not None, "the crawl serves no /metrics"
    return f"http://{endpoint.host}:{endpoint.port}/metrics"


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def samples(text: str) -> Samples:
    """Each sample of the exposition *text*, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    """The sample *name* with *labels*; 0 when absent (a counter that counted nothing)."""
    return found.get((name, frozenset(labels.items())), 0.0)
