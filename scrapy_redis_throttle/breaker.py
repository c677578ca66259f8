"""Whether the throttle's Redis is usable: a circuit breaker, opened by a failed call and closed
by the first success, with the probe's growing delays (see :mod:`.resilience`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .clock import Clock


class CircuitBreaker:
    """Whether Redis is usable. Closed: requests call it. Open (after a failure): requests do not;
    a probe tries it after a delay that doubles from *first_delay* up to *max_delay*."""

    def __init__(
        self,
        first_delay: float,
        max_delay: float,
        clock: Clock,
    ) -> None:
        self._first_delay = min(first_delay, max_delay)
        self._max_delay = max_delay
        self._clock = clock
        self.open_since: float | None = None
        self._delay = self._first_delay
        self._closed: list[asyncio.Future[None]] = []

    @property
    def is_open(self) -> bool:
        """Whether requests do not call Redis now. Safe from another thread (the metrics
        endpoint's), where the clock, the loop's, cannot be read."""
        return self.open_since is not None

    def open_for(self) -> float | None:
        """Seconds since the breaker opened; ``None`` while it is closed."""
        return None if self.open_since is None else self._clock.monotonic() - self.open_since

    def failed(self) -> bool:
        """Record a failed call; return whether it opened the breaker (a call that started
        before it opened changes nothing)."""
        if self.open_since is not None:
            return False
        self.open_since = self._clock.monotonic()
        self._delay = self._first_delay
        return True

    def next_probe_in(self) -> float:
        """Seconds to wait before the next probe; each call doubles the one after."""
        delay = self._delay
        self._delay = min(self._delay * 2, self._max_delay)
        return delay

    def succeeded(self) -> float | None:
        """Record a successful call; return how long the breaker was open, if it was."""
        if self.open_since is None:
            return None
        outage = self._clock.monotonic() - self.open_since
        self.open_since = None
        self.stop_waiting()
        return outage

    def stop_waiting(self) -> None:
        """End the waits of :meth:`wait_closed` under way (the breaker stays as it is)."""
        for waiter in self._closed:
            if not waiter.done():
                waiter.set_result(None)
        self._closed.clear()

    async def wait_closed(self) -> None:
        if self.open_since is not None:
            waiter = asyncio.get_running_loop().create_future()
            self._closed.append(waiter)
            await waiter
