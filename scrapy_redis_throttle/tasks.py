"""Ending the throttle's background tasks (lease renewal, activity reports, the pauses'
listener, the breaker's probe, the script sender) at the spider's close."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

# A cancelled task is cancelled again this often until it ends, for at most CANCEL_TRIES times
# (5 s): a task that would not end must not hold the spider's close.
CANCEL_AGAIN_AFTER = 0.1
CANCEL_TRIES = 50


async def cancel_and_wait(task: asyncio.Task[Any], what: str) -> None:
    """Cancel *task* (*what* it does, for the log) and wait for its end, cancelling it again
    until it ends: before Python 3.12 a cancellation can be lost. ``asyncio.wait_for`` returns
    its inner result when the cancel comes just as that finishes (redis-py's
    ``send_packed_command`` runs in one when ``socket_timeout`` is set), and a loop that catches
    ``RedisError`` then goes on: awaited, such a task hung the close; not awaited, it went on
    after it."""
    for _ in range(CANCEL_TRIES):
        if task.done():
            break
        task.cancel()
        await asyncio.wait([task], timeout=CANCEL_AGAIN_AFTER)
    if not task.done():
        logger.warning(
            "Redis throttle: %s did not end when cancelled %d times; the close goes on without it",
            what,
            CANCEL_TRIES,
        )
    elif not task.cancelled():
        task.exception()  # retrieved: it ends as it may
