"""A worker's ``/metrics`` endpoint: its :class:`.ThrottleMetrics` in Prometheus's text format,
served by prometheus_client in a thread of its own (with the reactor or without it), from the
spider's opening to its close."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .metrics import OTHER, RESULTS, WAIT_BUCKETS

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Iterator
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

    from .config import MetricsSettings
    from .metrics import Snapshot

logger = logging.getLogger(__name__)

PREFIX = "scrapy_redis_throttle"


class WorkerCollector:
    """The metrics of one worker, read from its snapshots at each scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        now = self._snapshot()
        requests = CounterMetricFamily(
            f"{PREFIX}_requests",
            "Requests by the throttle's result for them",
            labels=["domain", "result"],
        )
        waits = HistogramMetricFamily(
            f"{PREFIX}_wait_seconds",
            "Seconds from a request's first ask to its release, parked time included",
            labels=["domain"],
        )
        pauses = CounterMetricFamily(
            f"{PREFIX}_pauses", "Pauses of a domain, by reason", labels=["domain", "reason"]
        )
        for domain, series in sorted(now.series.items()):
            for result in RESULTS:
                requests.add_metric([domain, result], series.requests.get(result, 0))
            cumulative, buckets = 0, []
            bounds = (*WAIT_BUCKETS, float("inf"))
            for bound, count in zip(bounds, series.wait_buckets, strict=True):
                cumulative += count
                buckets.append((_bound(bound), cumulative))
            waits.add_metric([domain], buckets, series.wait_sum)
            for reason, count in sorted(series.pauses.items()):
                pauses.add_metric([domain, reason], count)
        yield requests
        yield waits
        yield pauses
        waiting = GaugeMetricFamily(
            f"{PREFIX}_waiting_requests",
            "Requests this worker's middleware holds now, waiting for their turn",
            labels=["domain"],
        )
        for domain in sorted({*now.series, *now.waiting}):
            waiting.add_metric([domain], now.waiting.get(domain, 0))
        yield waiting
        rate = GaugeMetricFamily(
            f"{PREFIX}_rate",
            "Requests per second in force for a domain, as Redis last gave it",
            labels=["domain"],
        )
        for domain, value in sorted(now.rates.items()):
            if domain != OTHER:
                rate.add_metric([domain], value)
        yield rate
        errors = CounterMetricFamily(
            f"{PREFIX}_redis_errors", "Failed Redis calls, by exception", labels=["kind"]
        )
        for kind, count in sorted(now.redis_errors.items()):
            errors.add_metric([kind], count)
        yield errors
        yield GaugeMetricFamily(
            f"{PREFIX}_fallback_active",
            "1 while this worker paces alone, Redis failing",
            value=int(now.fallback_active),
        )
        if now.fleet_workers is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_fleet_workers",
                "Workers live in the fleet, as this worker last read it",
                value=now.fleet_workers,
            )


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class MetricsEndpoint:
    """``/metrics`` of *collector* (see :meth:`start`), until :meth:`close`."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        host, port = server.server_address[:2]
        self.host: str = host if isinstance(host, str) else host.decode()
        self.port: int = port

    @classmethod
    def start(cls, collector: Collector, host: str, ports: tuple[int, int]) -> MetricsEndpoint:
        """Serve on *host* at the first free port from ``ports[0]`` to ``ports[1]``; an
        :exc:`OSError` when none is."""
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        low, high = ports
        for port in range(low, high):
            try:
                return cls(*start_http_server(port, host, registry))
            except OSError:
                continue
        return cls(*start_http_server(high, host, registry))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve(
    settings: MetricsSettings,
    snapshot: Callable[[], Snapshot],
    log_extra: Callable[[], dict[str, Any]],
) -> MetricsEndpoint | None:
    """Start the ``/metrics`` endpoint of *snapshot*, if ``REDIS_THROTTLE_METRICS_PORT`` is set
    (None: it is not); without a free port the crawl goes on without it (an ERROR says so)."""
    if settings.ports is None:
        return None
    try:
        endpoint = MetricsEndpoint.start(WorkerCollector(snapshot), settings.host, settings.ports)
    except OSError as error:
        low, high = settings.ports
        logger.error(
            "Redis throttle: no metrics endpoint: REDIS_THROTTLE_METRICS_PORT %(ports)s has "
            "no free port on %(host)r (%(error)s)",
            {
                "ports": low if low == high else f"{low}-{high}",
                "host": settings.host,
                "error": error,
            },
            extra=log_extra(),
        )
        return None
    logger.info(
        "Redis throttle: metrics at http://%(host)s:%(port)d/metrics",
        {"host": endpoint.host, "port": endpoint.port},
        extra=log_extra(),
    )
    return endpoint
