"""``scrapy-redis-throttle exporter``: the fleet's state in Redis, for Prometheus, read at each
scrape. One scrape target per fleet, beside each worker's own ``/metrics`` (see
:mod:`.metrics_endpoint`); the names are listed in ``docs/reference/metrics.rst``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from redis.exceptions import RedisClusterException, RedisError

from .metrics_endpoint import PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from prometheus_client.metrics_core import Metric

    from .control import LiveControl


class FleetCollector:
    """The fleet's gauges, read by *control* at each scrape, for the *top* domains with the
    most requests in the last minute (and those with a limit set live, as many); the values
    Redis holds that cannot be read go to *unreadable*."""

    def __init__(self, control: LiveControl, top: int, unreadable: Callable[[str], None]) -> None:
        self._control = control
        self._top = top
        self._unreadable = unreadable

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        control = self._control
        up = GaugeMetricFamily(
            f"{PREFIX}_exporter_redis_up", "1 when the last read of the fleet's Redis worked"
        )
        try:
            workers = control.fleet_workers()
            activity = control.activity()
            busiest = sorted(activity, key=lambda domain: -activity[domain].went)
            live = sorted(control.live_limits())[: self._top]
            domains = sorted({*busiest[: self._top], *live})
            states = control.states(domains)
        except (RedisError, RedisClusterException):
            up.add_metric([], 0)
            yield up
            return
        finally:
            for problem in control.problems:
                self._unreadable(problem)
            control.problems.clear()
        up.add_metric([], 1)
        yield up
        yield GaugeMetricFamily(
            f"{PREFIX}_fleet_workers", "Workers live in the fleet", value=workers
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_exporter_domains_left_out",
            "Active domains beyond --top, without series of their own",
            value=max(0, len(activity) - self._top),
        )
        gauges = {
            name: GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=["domain"])
            for name, text in (
                (
                    "achieved_rate",
                    "Requests per second the fleet sent, over the last minute (or the time the "
                    "fleet has run, if shorter)",
                ),
                ("parked_requests", "Requests parked in the fleet's parking set"),
                ("live_rate", "A rate set live (scrapy-redis-throttle set)"),
                ("paused_live", "1 while the domain is paused live"),
                ("pause_seconds", "Seconds left of a pause after a 429 or 503"),
                ("adaptive_rate", "The rate the adaptive rate lowered the domain to"),
            )
        }
        for state in states:
            domain = state.domain
            if domain in activity:
                gauges["achieved_rate"].add_metric([domain], activity[domain].achieved_rate)
                gauges["parked_requests"].add_metric([domain], activity[domain].parked)
            if state.live is not None:
                if state.live.rate is not None:
                    gauges["live_rate"].add_metric([domain], state.live.rate)
                gauges["paused_live"].add_metric([domain], int(state.live.paused))
            if state.penalty_pause:
                gauges["pause_seconds"].add_metric([domain], state.penalty_pause)
            if state.adaptive_rate is not None:
                gauges["adaptive_rate"].add_metric([domain], state.adaptive_rate)
        yield from gauges.values()
