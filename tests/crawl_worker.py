"""One crawler process for the multi-process tests and the benchmarks:
``python crawl_worker.py '<json>'``, or the JSON on standard input (for long URL lists).

The JSON object holds ``settings``, ``requests`` and ``spider_attributes`` (see
:class:`support.UrlListSpider`). The crawl's stats are printed as a last line ``STATS <json>``,
with what the benchmarks measure added: ``worker/download_seconds`` and
``worker/download_cpu_seconds``, the time and this process's CPU time from the first response
to the last (start-up and imports left out), and ``worker/gc_freeze_count``, the objects left
frozen out of the garbage collector at the end.
"""

from __future__ import annotations

import gc
import json
import sys
import time

from scrapy import signals
from scrapy.crawler import CrawlerProcess
from spiders import UrlListSpider


def main() -> None:
    job = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    process = CrawlerProcess(job["settings"])
    crawler = process.create_crawler(UrlListSpider)
    process.crawl(crawler, requests=job["requests"], **job.get("spider_attributes", {}))
    responses: list[tuple[float, float]] = []

    def received() -> None:  # a named function: signals hold their receivers weakly
        responses.append((time.perf_counter(), time.process_time()))

    crawler.signals.connect(received, signal=signals.response_received)
    process.start()
    first, last = (responses[0], responses[-1]) if responses else ((0.0, 0.0), (0.0, 0.0))
    stats = {
        **crawler.stats.get_stats(),
        "worker/download_seconds": last[0] - first[0],
        "worker/download_cpu_seconds": last[1] - first[1],
        "worker/gc_freeze_count": gc.get_freeze_count(),
    }
    print("STATS " + json.dumps(stats, default=str), flush=True)


if __name__ == "__main__":
    main()
