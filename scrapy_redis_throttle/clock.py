"""Time as the throttle reads it and waits for it: one :class:`Clock`, passed to everything that
waits or schedules (the turns of requests, the parking area, the pauses, the breaker's probe,
the fleet's reports, the leases), so that tests drive their decisions with a clock of their own
and never sleep.

Two clocks count:

* **wall time** (:func:`time.time`), comparable between processes (up to their machines'
  skew): when a reservation was made, when a pause was heard of, when a request was first seen;
* **monotonic time**, the event loop's clock (``loop.time()``): moments, dues and timeouts in
  this process. :class:`.ServerClock` places Redis's replies on it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.reactor import is_reactor_installed
from twisted.internet.task import deferLater

if TYPE_CHECKING:
    from collections.abc import Awaitable


class Clock:
    """The real clock. Its sleeps are Twisted's ``deferLater`` under Scrapy's reactor, and
    asyncio's without one (``TWISTED_REACTOR_ENABLED = False``, Scrapy 2.15 and later, where
    importing the reactor is forbidden). Either way they block nothing, and a cancelled sleep
    cancels its timer."""

    def wall(self) -> float:
        """Seconds since the epoch, as :func:`time.time`."""
        return time.time()

    def monotonic(self) -> float:
        """The running event loop's time (seconds, monotonic)."""
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        """Wait *seconds* (none when not positive)."""
        seconds = max(seconds, 0.0)
        if not is_reactor_installed():
            await asyncio.sleep(seconds)
            return
        # Imported here: importing it at module level would install the default reactor before
        # Scrapy installs the one of TWISTED_REACTOR.
        from twisted.internet import reactor

        await maybe_deferred_to_future(deferLater(reactor, seconds, lambda: None))


async def sleep_or_wake(clock: Clock, seconds: float, wake: Awaitable[object]) -> None:
    """Wait *seconds* by *clock*, or until *wake* is done, whichever comes first (a
    cancellation ends both)."""
    sleep = asyncio.ensure_future(clock.sleep(seconds))
    woken = asyncio.ensure_future(wake)
    try:
        await asyncio.wait([sleep, woken], return_when=asyncio.FIRST_COMPLETED)
        if sleep.done():
            sleep.result()  # a sleep that failed fails its caller
    finally:
        sleep.cancel()
        woken.cancel()
