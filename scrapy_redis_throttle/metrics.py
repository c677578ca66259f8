"""What a worker counts for its metrics, by domain, in bounded memory.

:class:`ThrottleMetrics` records each request's result and wait, the pauses and Redis errors as
they happen; :meth:`ThrottleMetrics.snapshot` gives them to the exporters: the ``/metrics``
endpoint (:mod:`.metrics_endpoint`) and OpenTelemetry (:mod:`.otel`). Their names, a contract,
are listed in ``docs/reference/metrics.rst``.

A crawl may meet 100,000 hosts; a metric labelled with each would grow without bound, in the
worker and in Prometheus. So only the domains with the most traffic keep their own ``domain``
label (:class:`DomainLabels`); the rest are summed under ``_other``.
"""

from __future__ import annotations

import bisect
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .stats import redis_errors

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from scrapy.statscollectors import StatsCollector

    from .breaker import CircuitBreaker
    from .fleet import Fleet

# A request's result, the ``result`` label of scrapy_redis_throttle_requests_total.
ACQUIRED = "acquired"
"""It left for the site once its budget allowed."""
UNTHROTTLED = "unthrottled"
"""Its domain has no limit, it has ``dont_redis_throttle``, or the ``"open"`` policy let it go."""
REJECTED = "rejected"
"""The throttle failed it (a bad meta value, a domain its scope could not name, ...)."""
CANCELED = "canceled"
"""It was dropped while it waited, at a close."""
RESULTS = (ACQUIRED, UNTHROTTLED, REJECTED, CANCELED)

# The ``reason`` of a pause that is no HTTP status: a Retry-After header, a domain paused live.
RETRY_AFTER = "retry_after"
PAUSED_LIVE = "live"

OTHER = "_other"
"""The ``domain`` label of the domains that have none of their own."""
DEFAULT_MAX_DOMAINS = 100

# The upper bounds of the wait histogram's buckets, in seconds: 1 ms to 10 min.
WAIT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

_NOTHING = nullcontext()

# A domain takes the label of the labelled domain with the least traffic once it has had this
# many times as much: labels do not flap between domains of like traffic, and each label slot
# changes hands at most log2(requests) times, which bounds the series an exporter ever saw.
OVERTAKE = 2


class DomainLabels:
    """Which domains keep their own label: at most *limit*, those with the most traffic.

    The labelled domains' traffic is counted exactly; the others' in a table as large, by the
    Space-Saving algorithm (a newcomer takes the place of the least counted, and its count, so
    a count never understates). When an unlabelled domain's count reaches ``OVERTAKE`` times
    the least labelled one's, it takes that domain's label, and *on_demoted* is called with
    the domain that lost it."""

    def __init__(self, limit: int, on_demoted: Callable[[str], None]) -> None:
        self._limit = limit
        self._on_demoted = on_demoted
        self._labelled: dict[str, int] = {}
        self._candidates: dict[str, int] = {}
        # The labelled domain with the least traffic, None when to be found again.
        self._least: str | None = None

    def __contains__(self, domain: str) -> bool:
        return domain in self._labelled

    def label(self, domain: str) -> str:
        """*domain*'s label now, without counting traffic."""
        return domain if domain in self._labelled else OTHER

    def count(self, domain: str, requests: int = 1) -> str:
        """Count *requests* of *domain*; return its label."""
        labelled = self._labelled
        if domain in labelled:
            labelled[domain] += requests
            if domain == self._least:
                self._least = None
            return domain
        if len(labelled) < self._limit:
            labelled[domain] = self._candidates.pop(domain, 0) + requests
            self._least = None
            return domain
        candidates = self._candidates
        count = candidates.pop(domain, None)
        if count is None:
            count = 0
            if len(candidates) >= self._limit:
                least = min(candidates, key=candidates.__getitem__)
                count = candidates.pop(least)
        count += requests
        if self._least is None:
            self._least = min(labelled, key=labelled.__getitem__)
        if count < OVERTAKE * labelled[self._least]:
            candidates[domain] = count
            return OTHER
        demoted = self._least
        candidates[demoted] = labelled.pop(demoted)
        labelled[domain] = count
        self._least = None
        self._on_demoted(demoted)
        return domain


@dataclass
class DomainSeries:
    """What one ``domain`` label counted."""

    requests: dict[str, int] = field(default_factory=dict)
    """By result (see :data:`RESULTS`)."""
    wait_buckets: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    """Waits per bucket of :data:`WAIT_BUCKETS` (not cumulative; the last: longer ones)."""
    wait_sum: float = 0.0
    pauses: dict[str, int] = field(default_factory=dict)
    """By reason: an HTTP status, :data:`RETRY_AFTER` or :data:`PAUSED_LIVE`."""

    def add(self, other: DomainSeries) -> None:
        for result, count in other.requests.items():
            self.requests[result] = self.requests.get(result, 0) + count
        self.wait_buckets = [
            mine + theirs
            for mine, theirs in zip(self.wait_buckets, other.wait_buckets, strict=True)
        ]
        self.wait_sum += other.wait_sum
        for reason, count in other.pauses.items():
            self.pauses[reason] = self.pauses.get(reason, 0) + count

    def copy(self) -> DomainSeries:
        return DomainSeries(
            dict(self.requests), list(self.wait_buckets), self.wait_sum, dict(self.pauses)
        )


@dataclass(frozen=True)
class Snapshot:
    """The metrics at one time, for an exporter."""

    series: dict[str, DomainSeries]
    """By ``domain`` label (:data:`OTHER` included once it counted anything)."""
    waiting: dict[str, int]
    """Requests held in the middleware now, by ``domain`` label."""
    rates: dict[str, float]
    """Requests per second in force, by ``domain`` label (:data:`OTHER` has none)."""
    redis_errors: dict[str, int]
    """By redis-py exception name."""
    fallback_active: bool
    fleet_workers: int | None


@dataclass(frozen=True)
class WorkerState:
    """What the metrics read of the worker at each snapshot (None: nothing to read)."""

    breaker: CircuitBreaker | None = None
    """Open while Redis fails: the fallback policy decides."""
    fleet: Fleet | None = None
    stats: StatsCollector | None = None
    """Where the failed Redis calls are counted."""


class ThrottleMetrics:
    """This worker's metrics, recorded when *on* (else each call returns at once), with
    *max_domains* domain labels, and the *worker*'s state read at each snapshot."""

    def __init__(
        self,
        on: bool,
        max_domains: int = DEFAULT_MAX_DOMAINS,
        worker: WorkerState = WorkerState(),
    ) -> None:
        self.on = on
        self._labels = DomainLabels(max_domains, self._demoted)
        self._series: dict[str, DomainSeries] = {}
        self._held: dict[str, int] = {}
        self._rates: dict[str, float] = {}
        # The labels whose rate was given by Redis (a reservation's step), not the limit's.
        self._rates_told: set[str] = set()
        self._worker = worker
        self.on_wait: Callable[[str, float], None] | None = None
        """Called with each wait recorded and its domain label (OpenTelemetry's histogram)."""

    def request(self, domain: str, result: str) -> None:
        """Count a request of *domain* that ended with *result* without a turn."""
        if self.on:
            self._count(domain, result)

    def went(
        self, domain: str, result: str, waited: float, limit_rate: float, told: float | None
    ) -> None:
        """Count a request of *domain* that left after its turn, *waited* seconds after its
        first ask. The domain's rate in force (requests per second) is the one Redis *told*
        with the request's reservation (a live limit, the adaptive rate), else the last one it
        told, else its limit's, *limit_rate*."""
        if not self.on:
            return
        label = self._count(domain, result)
        series = self._series[label]
        series.wait_buckets[bisect.bisect_left(WAIT_BUCKETS, waited)] += 1
        series.wait_sum += waited
        if label != OTHER:
            if told is not None:
                self._rates[label] = told
                self._rates_told.add(label)
            elif label not in self._rates_told:
                self._rates[label] = limit_rate
        if self.on_wait is not None:
            self.on_wait(label, waited)

    def canceled(self, by_domain: Mapping[str, int]) -> None:
        """Count requests dropped while they waited (at a close), by domain."""
        if not self.on:
            return
        for domain, count in by_domain.items():
            self._count(domain, CANCELED, count)

    def holding(self, domain: str) -> AbstractContextManager[None]:
        """A request of *domain* waits in the middleware meanwhile."""
        return self._holding(domain) if self.on else _NOTHING

    @contextmanager
    def _holding(self, domain: str) -> Iterator[None]:
        held = self._held
        held[domain] = held.get(domain, 0) + 1
        try:
            yield
        finally:
            if held[domain] == 1:
                del held[domain]
            else:
                held[domain] -= 1

    def paused(self, domain: str, reason: str) -> None:
        """Count a pause of *domain* for *reason*."""
        if not self.on:
            return
        pauses = self._series_of(self._labels.label(domain)).pauses
        pauses[reason] = pauses.get(reason, 0) + 1

    def snapshot(self) -> Snapshot:
        """The metrics now. Safe from another thread: what it reads is copied at once."""
        waiting: dict[str, int] = {}
        for domain, held in list(self._held.items()):
            label = self._labels.label(domain)
            waiting[label] = waiting.get(label, 0) + held
        worker = self._worker
        return Snapshot(
            {label: series.copy() for label, series in list(self._series.items())},
            waiting,
            dict(self._rates),
            {} if worker.stats is None else redis_errors(worker.stats),
            worker.breaker is not None and worker.breaker.is_open,
            None if worker.fleet is None else worker.fleet.fleet_size,
        )

    def _count(self, domain: str, result: str, count: int = 1) -> str:
        label = self._labels.count(domain, count)
        requests = self._series_of(label).requests
        requests[result] = requests.get(result, 0) + count
        return label

    def _series_of(self, label: str) -> DomainSeries:
        series = self._series.get(label)
        if series is None:
            series = self._series[label] = DomainSeries()
        return series

    def _demoted(self, domain: str) -> None:
        """*domain* lost its label: what it counted goes to :data:`OTHER`'s."""
        series = self._series.pop(domain, None)
        if series is not None:
            self._series_of(OTHER).add(series)
        self._rates.pop(domain, None)
        self._rates_told.discard(domain)
