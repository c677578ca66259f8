"""Live control of the limits in Redis: what the ``scrapy-redis-throttle`` command does.

A limit set live is kept after the bucket's time in the bucket's own value (``lua/set_limit.lua``):
every worker's next acquire reads it in the same call, with no call of its own. The domains that
have one are also listed in the set ``<prefix>:live``, for :meth:`LiveControl.live_limits`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from .activity import RECENT
from .live_limits import LiveLimit
from .redis_schema import (
    PENALTY_SUFFIX,
    RATE_SUFFIX,
    bucket_key,
    fleet_key,
    key_tag,
    live_key,
    parked_counts_key,
    penalty_channel,
    penalty_key,
    report_pattern,
    server_micros,
    tagged_key,
    void_key,
)
from .redis_values import finite, text, whole
from .scripts import load_script

if TYPE_CHECKING:
    from collections.abc import Callable

    import redis
    import redis.cluster

    from .rates import Quota

_T = TypeVar("_T")

# How many bucket keys one SCAN call looks at.
SCAN_COUNT = 1000
# Unreadable values in Redis the tool reports, at the most (the rest are ignored unsaid).
PROBLEMS_KEPT = 20
# What a parse of a value read from Redis may raise: the value is unreadable.
UNREADABLE = (ValueError, TypeError, KeyError, IndexError, OverflowError)


@dataclass(frozen=True)
class Change:
    live: LiveLimit | None
    """The domain's live limit after the change (None: the workers' own configuration)."""
    void: float
    """Seconds of moments reserved before the change, which their requests ask for again."""


class FleetActivity(NamedTuple):
    """A domain's activity in the fleet, from the workers' reports (see :mod:`.activity`)."""

    went: int
    """Requests that went in the last minute."""
    held: int
    """Requests held in the workers' middlewares now."""
    parked: int
    """Requests parked now."""
    counted: float = RECENT
    """Seconds the workers counted what went over (their "last minute": shorter in the fleet's
    first minute)."""

    @property
    def waiting(self) -> int:
        return self.held + self.parked

    @property
    def achieved_rate(self) -> float:
        """Requests per second over the last minute, or over the time the fleet has run if
        that is shorter."""
        return self.went / self.counted if self.counted else 0.0


@dataclass(frozen=True)
class DomainState:
    """What Redis holds about a domain's limit, read at one moment."""

    domain: str
    """The domain's name, or ``#`` and its SHA-256 for a name that is not plain (see
    :func:`.redis_schema.key_tag`)."""
    live: LiveLimit | None
    full_in: float
    """Seconds until the bucket is full again (0: full, or no bucket)."""
    penalty_pause: float
    """Seconds left of a pause after a 429/503 (0: none)."""
    strikes: int
    """Penalties in a row (the backoff's doubling)."""
    adaptive_rate: float | None
    """The rate the adaptive rate lowered it to, now (None: not lowered)."""
    live_invalid: bool = False
    """A limit set live is there but has a field that is no limit: the workers ignore that
    field (their own configuration applies for it), and :attr:`live` is None."""


class LiveControl:
    """Set, read and list the limits of a fleet that shares *key_prefix* in Redis."""

    def __init__(self, client: redis.Redis | redis.cluster.RedisCluster, key_prefix: str) -> None:
        self._client = client
        self._prefix = key_prefix
        self._set_limit = client.register_script(load_script("set_limit.lua"))
        self.problems: list[str] = []
        """Values read from Redis that could not be (another version's, or written by hand):
        each one was taken as absent. At most PROBLEMS_KEPT."""

    def set(
        self, domain: str, rate: float | None, burst: int | None, quotas: tuple[Quota, ...] = ()
    ) -> Change:
        """*domain*'s rate (requests per second) and burst, None: the workers' own; with a
        rate, its *quotas* replace the workers' (none: none)."""
        return self._change(domain, "set", rate, burst, quotas)

    def delete(self, domain: str) -> Change:
        """Back to the workers' own configuration (a pause set live ends too)."""
        return self._change(domain, "delete")

    def pause(self, domain: str) -> Change:
        """Stop every request to *domain*, from every worker, until :meth:`resume`."""
        return self._change(domain, "pause")

    def resume(self, domain: str) -> Change:
        """End a pause set live (the limit set live, if any, stays)."""
        return self._change(domain, "resume")

    def _change(
        self,
        domain: str,
        action: str,
        rate: float | None = None,
        burst: int | None = None,
        quotas: tuple[Quota, ...] = (),
    ) -> Change:
        live, void_us = self._set_limit(
            keys=[
                bucket_key(self._prefix, domain),
                penalty_key(self._prefix, domain),
                void_key(self._prefix, domain),
            ],
            args=[
                action,
                "-" if rate is None else repr(float(rate)),
                "-" if burst is None else str(burst),
                penalty_channel(self._prefix),
                domain,
                ",".join(quota.script_text for quota in quotas),
            ],
        )
        limit = LiveLimit.parse(text(live))
        if limit is None:
            self._client.srem(live_key(self._prefix), domain)
        else:
            self._client.sadd(live_key(self._prefix), domain)
        return Change(limit, void_us / 1e6)

    def live_limits(self) -> dict[str, LiveLimit]:
        """Every domain with a limit set live."""
        domains = sorted(text(member) for member in self._client.smembers(live_key(self._prefix)))
        states = self.states([key_tag(domain) for domain in domains])
        return {
            domain: state.live
            for domain, state in zip(domains, states, strict=True)
            if state.live is not None
        }

    def state(self, domain: str) -> DomainState:
        [state] = self.states([key_tag(domain)])
        return state

    def active_domains(self) -> list[str]:
        """The :func:`.redis_schema.key_tag` of every domain with a bucket in Redis: requested
        lately, or with a limit set live."""
        start = len(tagged_key(self._prefix, "")) - 1
        return sorted(
            key.decode()[start:-1]
            for key in self._client.scan_iter(tagged_key(self._prefix, "*"), count=SCAN_COUNT)
        )

    def fleet_workers(self) -> int:
        """The workers live in the fleet now (see ``lua/fleet.lua``)."""
        seconds, micros = self._client.time()
        now = server_micros(seconds, micros)
        return int(self._client.zcount(fleet_key(self._prefix), f"({now:.0f}", "+inf"))

    def activity(self) -> dict[str, FleetActivity]:
        """Per domain (by its :func:`.redis_schema.key_tag`), the fleet's activity, from the
        workers' reports (see :mod:`.activity`)."""
        reports = list(self._client.scan_iter(report_pattern(self._prefix), count=SCAN_COUNT))
        pipeline = self._client.pipeline(transaction=False)
        pipeline.hgetall(parked_counts_key(self._prefix))
        for report in reports:
            pipeline.get(report)
        parked, *replies = pipeline.execute()
        totals: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
        for domain, count in parked.items():
            # A parked request taken back before its park was reported counts -1 for a while.
            waiting = self._read(f"parked count {count!r:.60}", whole, count, absent=0, least=0)
            totals[key_tag(text(domain))][2] += max(0, waiting)
        for report, reply in zip(reports, replies, strict=True):
            what = f"worker report {text(report)!r:.100}"
            entries: list[tuple[str, int, int, float]] = self._read(what, _report, reply, absent=[])
            for domain, went, held, counted in entries:
                total = totals[key_tag(domain)]
                total[0] += went
                total[1] += held
                # The fleet has run as long as its longest-running worker.
                total[3] = max(total[3], counted)
        return {
            tag: FleetActivity(int(went), int(held), int(parked), counted or RECENT)
            for tag, (went, held, parked, counted) in totals.items()
        }

    def _read(
        self, what: str, parse: Callable[..., _T], value: Any, absent: _T, **options: Any
    ) -> _T:
        """*parse(value, **options)*, a value read from Redis; if it cannot be, note *what*
        could not be read and take *absent*."""
        try:
            return parse(value, **options)
        except UNREADABLE as exc:
            if len(self.problems) < PROBLEMS_KEPT:
                self.problems.append(f"{what}: {exc}"[:300])
            return absent

    def states(self, tags: list[str]) -> list[DomainState]:
        """The state of each domain (by its :func:`.redis_schema.key_tag`), read in one pipeline
        (after Redis's time: a cluster's pipelines do not take TIME)."""
        seconds, micros = self._client.time()
        now = server_micros(seconds, micros)
        pipeline = self._client.pipeline(transaction=False)
        for tag in tags:
            key = tagged_key(self._prefix, tag)
            pipeline.get(key)
            pipeline.hmget(key + PENALTY_SUFFIX, "strikes", "until")
            pipeline.get(key + RATE_SUFFIX)
        replies = pipeline.execute()
        return [self._state(tag, now, *replies[3 * n : 3 * n + 3]) for n, tag in enumerate(tags)]

    def _state(
        self,
        domain: str,
        now: float,
        bucket: bytes | None,
        penalty: list[bytes | None],
        adaptive: bytes | None,
    ) -> DomainState:
        tat, _, live = text(bucket or b"").partition(" ")
        strikes, until = penalty
        where = f"{domain!r}"
        live_limit = self._read(f"{where} live limit", LiveLimit.parse, live, absent=None)
        return DomainState(
            domain=domain,
            live=live_limit,
            live_invalid=bool(live) and live_limit is None,
            full_in=self._read(f"{where} bucket", _seconds_to, tat or "0", absent=0.0, now=now),
            penalty_pause=self._read(
                f"{where} pause", _seconds_to, until or "0", absent=0.0, now=now
            ),
            strikes=self._read(f"{where} strikes", whole, strikes or "0", absent=0, least=0),
            adaptive_rate=self._read(
                f"{where} adaptive rate", _adaptive_rate, adaptive, absent=None, now=now
            ),
        )


def _seconds_to(moment_us: bytes | str, now: float) -> float:
    """Seconds from *now* (µs of Redis's time, as the scripts count) to a moment; 0 if past."""
    return max(0.0, (finite(moment_us) - now) / 1e6)


def _adaptive_rate(value: bytes | None, now: float) -> float | None:
    """The rate now, from ``"<rate> <since µs> <slope> <configured>"`` (``lua/slow_down.lua``)."""
    if value is None:
        return None
    rate, since, slope, _ = (finite(field) for field in value.split())
    return rate + slope * max(0.0, now - since)


def _report(value: bytes | None) -> list[tuple[str, int, int, float]]:
    """A worker's report (see :meth:`.activity.Activity.report`): ``{domain: [went, held,
    counted_ms]}`` (a worker of an earlier version sends no counted_ms: a minute); None:
    expired since it was listed."""
    if value is None:
        return []
    entries = json.loads(value)
    if not isinstance(entries, dict):
        raise ValueError("not a JSON object")
    return [_entry(domain, counts) for domain, counts in entries.items()]


def _entry(domain: str, counts: object) -> tuple[str, int, int, float]:
    if not isinstance(counts, list) or len(counts) not in (2, 3):
        raise ValueError(f"{counts!r:.60} is not [went, held] or [went, held, counted_ms]")
    went, held = whole(counts[0], least=0), whole(counts[1], least=0)
    counted_ms = whole(counts[2], least=0) if len(counts) == 3 else RECENT * 1000
    return domain, went, held, min(RECENT, counted_ms / 1000)
