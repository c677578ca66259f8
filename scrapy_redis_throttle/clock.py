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
from typing import Any

from scrapy.utils.reactor import is_reactor_installed
from twisted.internet.task import deferLater


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

    def sleep(self, seconds: float) -> asyncio.Future[None]:
        """A future done in *seconds* (at once when not positive), to await; cancelling it
        cancels its timer."""
        seconds = max(seconds, 0.0)
        if not is_reactor_installed():
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            timer = loop.call_later(seconds, _set_done, done)
            done.add_done_callback(lambda _: timer.cancel())
            return done
        # Imported here: importing it at module level would install the default reactor before
        # Scrapy installs the one of TWISTED_REACTOR.
        from twisted.internet import reactor

        return deferLater(reactor, seconds, lambda: None).asFuture(asyncio.get_running_loop())


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def sleep_or_wake(clock: Clock, seconds: float, wake: asyncio.Event) -> None:
    """Wait *seconds* by *clock*, or until *wake* is set, whichever comes first (a cancellation
    ends both)."""
    sleep = clock.sleep(seconds)
    woken: asyncio.Future[bool] = asyncio.ensure_future(wake.wait())
    waits: list[asyncio.Future[Any]] = [sleep, woken]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if sleep.done():
            sleep.result()  # a sleep that failed fails its caller
    finally:
        sleep.cancel()
        woken.cancel()
