"""The WARNING for a domain that Scrapy's slot settings hold below its shared budget."""

from __future__ import annotations

import logging

import pytest
from fakes import Fleet
from scrapy.settings import Settings

from scrapy_redis_throttle.config import CrawlSettings
from scrapy_redis_throttle.rates import parse_limit
from scrapy_redis_throttle.slot_caps import SlotCaps

FIVE = parse_limit("5/s", default_burst=1, source="test")


def caps(workers: int | None, **settings: object) -> SlotCaps:
    return SlotCaps(CrawlSettings.from_settings(Settings(settings)), Fleet(workers), dict)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_concurrency_that_holds_a_domain_below_its_budget_is_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert FIVE is not None
    slot_caps = caps(2, CONCURRENT_REQUESTS_PER_DOMAIN=1)
    for _ in range(3):
        slot_caps.check("a.example", FIVE, 0.5)  # 2 workers x 1 / 0.5 s: 4/s
    slot_caps.check("b.example", FIVE, 0.1)  # 20/s: not held down
    slot_caps.check("c.example", FIVE, None)  # no latency known
    assert warnings(caplog) == [
        "Redis throttle: CONCURRENT_REQUESTS_PER_DOMAIN = 1 lets each worker send 'a.example' "
        "1 request(s) at a time, each answered in 0.50 s: with 2 worker(s), at most 4/s, below "
        "its shared limit 5/s (burst 1); remove it, or enable the add-on (ADDONS), which lifts "
        "it for the domains the throttle paces (logged once per domain)"
    ]


@pytest.mark.filterwarnings("ignore:The CONCURRENT_REQUESTS_PER_IP setting is deprecated")
def test_the_lowest_cap_is_named_and_per_ip_counts_instead_of_per_domain(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert FIVE is not None
    caps(None, DOWNLOAD_DELAY=2, CONCURRENT_REQUESTS_PER_IP=1).check("a.example", FIVE, 0.5)
    [warning] = warnings(caplog)
    assert warning.startswith(
        "Redis throttle: DOWNLOAD_DELAY = 2 lets each worker send 'a.example' one request "
        "every 2 s: with 1 worker(s), at most 1/2s"
    ), warning
    caplog.clear()
    caps(1, CONCURRENT_REQUESTS_PER_IP=1).check("a.example", FIVE, 0.4)
    assert "CONCURRENT_REQUESTS_PER_IP = 1 lets" in warnings(caplog)[0]
