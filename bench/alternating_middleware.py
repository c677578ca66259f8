"""The throttle's middleware, switched on and off in turns within one crawl (for
bench/crawl_overhead.py).

The requests are taken in chunks of ``BENCH_CHUNK`` (in the order they reach the middleware):
in an "on" chunk each request goes through the throttle; in an "off" chunk it goes on at once,
as if the middleware were not there (a coroutine that returns without waiting: a few µs). With
``BENCH_ALTERNATE = "metrics"``, every request goes through the throttle, and what is switched
is the recording of its metrics (:attr:`.ThrottleMetrics.on`). The first chunk is on when
``BENCH_FIRST_ON`` is true. At the close, each chunk's figures are in the
stats as ``bench/chunks``: ``[on, CPU µs per request, requests per second]``, measured from the
chunk's first request to the next chunk's first.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from scrapy import signals

from scrapy_redis_throttle import RedisThrottleMiddleware

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler


class AlternatingThrottleMiddleware(RedisThrottleMiddleware):
    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        self._chunk = crawler.settings.getint("BENCH_CHUNK")
        self._first_on = crawler.settings.getbool("BENCH_FIRST_ON")
        self._metrics_only = crawler.settings.get("BENCH_ALTERNATE") == "metrics"
        self._seen = 0
        # (on, CPU time, time) at the first request of each chunk
        self._starts: list[tuple[bool, float, float]] = []
        crawler.signals.connect(self._report, signal=signals.spider_closed)

    async def process_request(self, request: Request) -> Request | None:
        chunk, position = divmod(self._seen, self._chunk)
        self._seen += 1
        on = (chunk % 2 == 0) == self._first_on
        if position == 0:
            self._starts.append((on, time.process_time(), time.perf_counter()))
        if self._metrics_only:
            self.throttle.metrics.on = on
        elif not on:
            return None
        return await super().process_request(request)

    def _report(self, spider: Spider) -> None:
        self.throttle.stats.set_value(
            "bench/chunks",
            [
                [on, (cpu_end - cpu) / self._chunk * 1e6, self._chunk / (end - start)]
                for (on, cpu, start), (_, cpu_end, end) in zip(
                    self._starts, self._starts[1:], strict=False
                )
            ],
        )
