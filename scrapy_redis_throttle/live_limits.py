"""The limits set live (``scrapy-redis-throttle set``, ``pause``): a domain's, as Redis keeps it
after its bucket's time (``lua/set_limit.lua``), and what of them reached this worker.

Each acquire in a domain's own bucket tells the domain's limit set live in the same call
(``lua/token_bucket.lua``): :class:`LiveLimits` logs one INFO line when a limit set live, a
change of it or a pause reaches this worker, and one when the domain is back to its own limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .rates import TOKEN_BUCKET, Limit, Quota, format_rate
from .redis_schema import ALGORITHM_CODES
from .redis_values import positive, text, whole

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

# Domains with a limit set live this worker remembers, at the most (a hostile Redis may set one
# on every domain): one forgotten is told again at its next answer.
KEPT = 10_000


@dataclass(frozen=True)
class LiveLimit:
    """A domain's limit as set live; None fields are the workers' own configuration."""

    rate: float | None
    """Requests per second."""
    burst: int | None
    paused: bool
    quotas: tuple[Quota, ...] = ()
    """With a rate: the domain's quotas (those of the workers do not apply)."""

    @classmethod
    def parse(cls, text: str) -> LiveLimit | None:
        """From ``"<rate|-> <burst|-> <paused 0|1>[ <quotas>]"`` (see ``lua/set_limit.lua``);
        None for none (no text); ValueError for anything else."""
        if not text:
            return None
        fields = text.split()
        if len(fields) not in (3, 4) or fields[2] not in ("0", "1"):
            raise ValueError(f"not a live limit: {text[:100]!r}")
        rate, burst, paused, *quotas = fields
        return cls(
            rate=None if rate == "-" else positive(rate),
            burst=None if burst == "-" else whole(burst),
            paused=paused == "1",
            quotas=tuple(map(_quota, quotas[0].split(","))) if quotas else (),
        )

    def over(self, code: Limit | None) -> Limit | None:
        """The limit the workers apply, this one's fields over *code*'s (their own; None: not
        known here), as ``lua/token_bucket.lua`` merges them; None when a field is not known."""
        rate = self.rate if self.rate is not None else (code.rate if code else None)
        burst = self.burst if self.burst is not None else (code.burst if code else None)
        if rate is None or burst is None:
            return None
        quotas = self.quotas if self.rate is not None else (code.quotas if code else ())
        return Limit(rate, burst, format_rate(rate), quotas)

    def __str__(self) -> str:
        rate = "workers' rate" if self.rate is None else format_rate(self.rate)
        burst = "workers' burst" if self.burst is None else f"burst {self.burst}"
        quotas = "".join(f" and {quota}" for quota in self.quotas)
        return f"{rate} ({burst}){quotas}" + (", PAUSED" if self.paused else "")


NOTHING_LIVE = LiveLimit(rate=None, burst=None, paused=False)
"""No limit set live: the workers' own applies."""


def _quota(text: str) -> Quota:
    """A quota from its text in a live limit: ``"f1000/3600000000"`` (see
    :attr:`.rates.Quota.script_text`)."""
    count, period = (positive(number) for number in text[1:].split("/"))
    algorithm = {code: name for name, code in ALGORITHM_CODES.items()}[text[:1]]
    period /= 1e6
    if algorithm == TOKEN_BUCKET:
        return Quota(algorithm, count, period, format_rate(1 / period))
    return Quota(algorithm, count, period, f"{count:g}/{period:g}s")


def from_reply(value: bytes | str) -> LiveLimit | None:
    """A domain's limit set live as an acquire's reply tells it: :data:`NOTHING_LIVE` for
    none; None for a value that is none (written by hand: the script ignored what is no limit
    in it, and said so with its status)."""
    try:
        return LiveLimit.parse(text(value)) or NOTHING_LIVE
    except (ValueError, KeyError):
        return None


class LiveLimits:
    """What of the limits set live reached this worker, as Redis's answers told it."""

    def __init__(self, log_extra: Callable[[], dict[str, Any]]) -> None:
        self._log_extra = log_extra
        self._known: dict[str, LiveLimit] = {}
        """The domains with a limit set live, the first told first."""

    def of(self, domain: str) -> LiveLimit | None:
        """*domain*'s limit set live, as last told (None: none, or not told)."""
        return self._known.get(domain)

    def over(self, domain: str, own: Limit) -> Limit:
        """*domain*'s limit in force: its limit set live over its *own*, as last told."""
        live = self._known.get(domain)
        return (live.over(own) if live is not None else None) or own

    def told(self, domain: str, live: LiveLimit | None, own: Limit) -> None:
        """An answer for *domain* (whose workers' *own* limit is that) told its limit set
        *live* (None: it did not tell)."""
        known = self._known.get(domain)
        if live is None or live == (known or NOTHING_LIVE):
            return
        if live == NOTHING_LIVE:
            del self._known[domain]
            self._log("%(domain)r is back to its own limit, %(own)s", domain, own=own)
            return
        if known is None and len(self._known) >= KEPT:
            del self._known[next(iter(self._known))]
        self._known[domain] = live
        if live.paused:
            self._log(
                "%(domain)r is paused live for the fleet: no request to it until it is "
                "resumed (scrapy-redis-throttle resume %(domain)s)",
                domain,
            )
        else:
            self._log(
                "%(domain)r follows a limit set live for the fleet: %(live)s (its own: %(own)s)",
                domain,
                live=live.over(own),
                own=own,
            )

    def _log(self, message: str, domain: str, **values: object) -> None:
        logger.info(
            f"Redis throttle: {message}", {"domain": domain, **values}, extra=self._log_extra()
        )
