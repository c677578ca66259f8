"""One crawler process for the multi-process tests: ``python crawl_worker.py '<json>'``.

The JSON object holds ``settings``, ``requests`` and ``spider_attributes`` (see
:class:`support.UrlListSpider`). The crawl's stats are printed as a last line ``STATS <json>``.
"""

from __future__ import annotations

import json
import sys

from scrapy.crawler import CrawlerProcess
from spiders import UrlListSpider


def main() -> None:
    job = json.loads(sys.argv[1])
    process = CrawlerProcess(job["settings"])
    crawler = process.create_crawler(UrlListSpider)
    process.crawl(crawler, requests=job["requests"], **job.get("spider_attributes", {}))
    process.start()
    print("STATS " + json.dumps(crawler.stats.get_stats(), default=str), flush=True)


if __name__ == "__main__":
    main()
