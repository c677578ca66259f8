"""The worker's metrics through OpenTelemetry's global MeterProvider
(``REDIS_THROTTLE_METRICS_OTEL``), with the ``opentelemetry-api`` package.

The instruments are named so that an OpenTelemetry Collector exporting them to Prometheus gives
the names of the ``/metrics`` endpoint: ``scrapy_redis_throttle.requests`` becomes
``scrapy_redis_throttle_requests_total``, ``scrapy_redis_throttle.wait`` (in seconds)
``scrapy_redis_throttle_wait_seconds``. Their attributes are the endpoint's labels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import version
from typing import TYPE_CHECKING
from weakref import WeakSet

from .metrics import RESULTS, WAIT_BUCKETS

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Observation

    from .metrics import Snapshot, ThrottleMetrics

METER = "scrapy_redis_throttle"


def instrument(metrics: ThrottleMetrics) -> None:
    """Report *metrics* through the global MeterProvider's instruments, while they live."""
    instruments = _instruments()
    instruments.live.add(metrics)
    metrics.on_wait = lambda domain, seconds: instruments.wait.record(seconds, {"domain": domain})


Read = Callable[["Snapshot"], "Iterable[tuple[float, dict[str, str]]]"]


class _Instruments:
    """The instruments, created once per process: they report the metrics of every crawler
    *live* in it (a process may run several), summed (the gauges of a fleet: the largest)."""

    def __init__(self) -> None:
        from opentelemetry.metrics import get_meter

        self.live: WeakSet[ThrottleMetrics] = WeakSet()
        meter = get_meter(METER, version("scrapy-redis-throttle"))
        self.wait = meter.create_histogram(
            f"{METER}.wait",
            unit="s",
            description="Time from a request's first ask to its release, parked time included",
            explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
        )
        meter.create_observable_counter(
            f"{METER}.requests",
            self._observe(
                lambda now: [
                    (series.requests.get(result, 0), {"domain": domain, "result": result})
                    for domain, series in now.series.items()
                    for result in RESULTS
                ]
            ),
            unit="{request}",
            description="Requests by the throttle's result for them",
        )
        meter.create_observable_counter(
            f"{METER}.pauses",
            self._observe(
                lambda now: [
                    (count, {"domain": domain, "reason": reason})
                    for domain, series in now.series.items()
                    for reason, count in series.pauses.items()
                ]
            ),
            unit="{pause}",
            description="Pauses of a domain, by reason",
        )
        meter.create_observable_counter(
            f"{METER}.redis_errors",
            self._observe(
                lambda now: [(count, {"kind": kind}) for kind, count in now.redis_errors.items()]
            ),
            unit="{error}",
            description="Failed Redis calls, by exception",
        )
        meter.create_observable_up_down_counter(
            f"{METER}.waiting_requests",
            self._observe(_by_domain(lambda now: now.waiting)),
            unit="{request}",
            description="Requests this worker's middleware holds now, waiting for their turn",
        )
        meter.create_observable_gauge(
            f"{METER}.rate",
            self._observe(_by_domain(lambda now: now.rates), max),
            unit="{request}/s",
            description="Requests per second in force for a domain, as Redis last gave it",
        )
        meter.create_observable_gauge(
            f"{METER}.fallback_active",
            self._observe(lambda now: [(int(now.fallback_active), {})], max),
            description="1 while this worker paces alone, Redis failing",
        )
        meter.create_observable_gauge(
            f"{METER}.fleet_workers",
            self._observe(
                lambda now: [] if now.fleet_workers is None else [(now.fleet_workers, {})], max
            ),
            unit="{worker}",
            description="Workers live in the fleet, as this worker last read it",
        )

    def _observe(
        self, read: Read, combine: Callable[[Iterable[float]], float] = sum
    ) -> list[Callable[[CallbackOptions], Iterable[Observation]]]:
        """The callbacks of an observable instrument: the values *read* of each live crawler's
        snapshot, *combine*d by attributes."""
        from opentelemetry.metrics import Observation

        def callback(_: CallbackOptions) -> list[Observation]:
            values: dict[tuple[tuple[str, str], ...], list[float]] = {}
            for metrics in list(self.live):
                for value, attributes in read(metrics.snapshot()):
                    values.setdefault(tuple(sorted(attributes.items())), []).append(value)
            return [Observation(combine(each), dict(key)) for key, each in values.items()]

        return [callback]


def _by_domain(values: Callable[[Snapshot], Mapping[str, float]]) -> Read:
    """The reading of a snapshot's *values* by domain."""
    return lambda now: [(value, {"domain": domain}) for domain, value in values(now).items()]


@functools.cache
def _instruments() -> _Instruments:
    return _Instruments()
