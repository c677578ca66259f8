"""One crawler process for the multi-process tests and the benchmarks:
``python crawl_worker.py '<json>'``, or the JSON on standard input (for long URL lists).

The JSON object holds ``settings``, ``requests`` and ``spider_attributes`` (see
:class:`support.UrlListSpider`). The crawl's stats are printed as a last line ``STATS <json>``,
with what the benchmarks measure added: ``worker/download_seconds`` and
``worker/download_cpu_seconds``, the time and this process's CPU time from the first response
to the last (start-up and imports left out), and ``worker/gc_freeze_count``, the objects left
frozen out of the garbage collector at the end. With ``"loop_probe": true`` in the JSON, also
``worker/loop_stalls`` and ``worker/loop_stall_max_ms`` (see :class:`LoopProbe`); with
``"scrape_metrics": true``, ``worker/metrics``, the text of its ``/metrics`` at its last idle. The settings
are the test's (from ``spiders.BASE_SETTINGS``, or with ``releases.EXTENSION`` among them):
``test/released`` and ``test/missed`` tell what the throttle did per domain.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time

from metrics_scrape import scrape
from scrapy import signals
from scrapy.crawler import AsyncCrawlerProcess, CrawlerProcess
from spiders import UrlListSpider

# A wake-up of the probe this late is a stall: a request sent then left that much late.
STALL = 0.02
PROBE_PERIOD = 0.005


class LoopProbe:
    """How late the event loop wakes a task that sleeps PROBE_PERIOD at a time, from the
    crawl's first response to its close."""

    def __init__(self) -> None:
        self.lateness: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(PROBE_PERIOD)
            self.lateness.append(loop.time() - before - PROBE_PERIOD)

    def stats(self) -> dict[str, float]:
        return {
            "worker/loop_stalls": sum(late > STALL for late in self.lateness),
            "worker/loop_stall_max_ms": max(self.lateness, default=0.0) * 1000,
        }


def main() -> None:
    job = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    # Without a reactor (TWISTED_REACTOR_ENABLED = False), only the asyncio process can run.
    reactorless = job["settings"].get("TWISTED_REACTOR_ENABLED") is False
    process = (AsyncCrawlerProcess if reactorless else CrawlerProcess)(job["settings"])
    crawler = process.create_crawler(UrlListSpider)
    process.crawl(crawler, requests=job["requests"], **job.get("spider_attributes", {}))
    responses: list[tuple[float, float]] = []

    def received() -> None:  # a named function: signals hold their receivers weakly
        responses.append((time.perf_counter(), time.process_time()))

    crawler.signals.connect(received, signal=signals.response_received)
    scrapes: list[str] = []
    if job.get("scrape_metrics"):

        def idle() -> None:
            scrapes.append(scrape(crawler))

        crawler.signals.connect(idle, signal=signals.spider_idle)
    probe = LoopProbe() if job.get("loop_probe") else None
    if probe is not None:
        crawler.signals.connect(probe.start, signal=signals.response_received)
        crawler.signals.connect(probe.stop, signal=signals.spider_closed)
    process.start()
    first, last = (responses[0], responses[-1]) if responses else ((0.0, 0.0), (0.0, 0.0))
    stats = {
        **crawler.stats.get_stats(),
        "worker/download_seconds": last[0] - first[0],
        "worker/download_cpu_seconds": last[1] - first[1],
        "worker/gc_freeze_count": gc.get_freeze_count(),
        **(probe.stats() if probe is not None else {}),
        **({"worker/metrics": scrapes[-1]} if scrapes else {}),
    }
    print("STATS " + json.dumps(stats, default=str), flush=True)


if __name__ == "__main__":
    main()
