"""Ending background tasks at the close: a lost cancellation is sent again; a task that never
ends does not hold the close."""

from __future__ import annotations

import asyncio
import logging

import pytest
from support import async_test

from scrapy_redis_throttle import tasks
from scrapy_redis_throttle.tasks import cancel_and_wait


async def loop_that_ignores(cancellations: list[int], ignore: int, stop: asyncio.Event) -> None:
    """A background loop that goes on after the first *ignore* cancellations (as one whose
    cancellation a Python < 3.12 ``asyncio.wait_for`` lost), counting them, until *stop*."""
    while not stop.is_set():
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancellations.append(1)
            if len(cancellations) > ignore:
                raise


@async_test
async def test_a_lost_cancellation_is_sent_again_until_the_task_ends() -> None:
    cancellations: list[int] = []
    task = asyncio.ensure_future(loop_that_ignores(cancellations, 2, asyncio.Event()))
    await asyncio.sleep(0)  # started
    await cancel_and_wait(task, "a loop")
    assert task.cancelled()
    assert len(cancellations) == 3


@async_test
async def test_a_task_that_never_ends_does_not_hold_the_close(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tasks, "CANCEL_TRIES", 3)
    cancellations: list[int] = []
    stop = asyncio.Event()
    task = asyncio.ensure_future(loop_that_ignores(cancellations, 1_000, stop))
    await asyncio.sleep(0)
    await cancel_and_wait(task, "a stubborn loop")
    assert not task.done()
    assert len(cancellations) == 3
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "Redis throttle: a stubborn loop did not end when cancelled 3 times; the close goes on "
        "without it"
    ]
    stop.set()
    await task
