"""What the log says while the fleet runs, the way Scrapy's LogStats does: every
``REDIS_THROTTLE_LOG_INTERVAL`` seconds (0: never), one INFO line on this worker's busiest
domains: the limit in force, whether it is set live or paused, the requests sent over the last
minute, those waiting now and the longest wait since the last line. Its length is bounded
whatever the number of domains: the busiest :data:`DOMAINS_SHOWN`, and the others added up."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from collections.abc import Callable

    from .activity import Activity
    from .budgets import Budgets
    from .clock import Clock
    from .live_limits import LiveLimit, LiveLimits
    from .pauses import Pauses

logger = logging.getLogger(__name__)

# The domains one line names, the busiest first; the others are added up.
DOMAINS_SHOWN = 10


@dataclass(frozen=True)
class DomainLine:
    """What the summary says of one domain."""

    domain: str
    limit: str
    """The limit the last request went under (see :func:`.rates.limit_in_force`)."""
    live: LiveLimit | None
    """Its limit set live, as this worker was last told (None: none)."""
    paused: float
    """Seconds its pause (after a 429 or 503) has to run (0: not paused)."""
    sent: int
    """Requests sent over the last minute."""
    waiting: int
    """Requests waiting for their turn in this worker now."""
    longest: float
    """The longest wait of a request sent since the last line (seconds)."""

    def __str__(self) -> str:
        live = ""
        if self.live is not None:
            live = ", paused live" if self.live.paused else ", set live"
        paused = f", paused {self.paused:.0f} s" if self.paused else ""
        return (
            f"{self.domain} {self.limit}{live}{paused}: {self.sent} sent, {self.waiting} waiting, "
            f"longest wait {self.longest:.1f} s"
        )


def summary_line(lines: list[DomainLine]) -> str:
    """One log line of *lines*: the :data:`DOMAINS_SHOWN` busiest, and the others added up."""
    busiest = sorted(lines, key=lambda line: (-line.sent, -line.waiting, line.domain))
    shown, rest = busiest[:DOMAINS_SHOWN], busiest[DOMAINS_SHOWN:]
    text = "; ".join(map(str, shown))
    if rest:
        text += (
            f"; and {len(rest)} more domains: {sum(line.sent for line in rest)} sent, "
            f"{sum(line.waiting for line in rest)} waiting"
        )
    return text


class LogSummary:
    """Logs this worker's domains (as *activity* counts them) every *interval* seconds."""

    def __init__(
        self,
        interval: float,
        activity: Activity,
        budgets: Budgets,
        pauses: Pauses,
        live_limits: LiveLimits,
        log_extra: Callable[[], dict[str, Any]],
        clock: Clock,
    ) -> None:
        self._interval = interval
        self._activity = activity
        self._budgets = budgets
        self._pauses = pauses
        self._live_limits = live_limits
        self._log_extra = log_extra
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._interval:
            self._task = asyncio.ensure_future(self._every_interval())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task, "the log's summary")

    async def _every_interval(self) -> None:
        while True:
            await self._clock.sleep(self._interval)
            self.log()

    def lines(self) -> list[DomainLine]:
        """What each domain this worker sent or holds requests of comes to now."""
        lines = []
        for domain, (sent, waiting, longest, limit) in self._activity.summary().items():
            if limit is None:  # none went since the last line: the configured one
                limit = str(self._budgets.limit(domain) or "unlimited")
            lines.append(
                DomainLine(
                    domain,
                    limit,
                    self._live_limits.of(domain),
                    self._pauses.paused_for(domain),
                    sent,
                    waiting,
                    longest,
                )
            )
        return lines

    def log(self) -> None:
        lines = self.lines()
        if lines:
            logger.info(
                "Redis throttle: %(summary)s",
                {"summary": summary_line(lines)},
                extra=self._log_extra(),
            )
