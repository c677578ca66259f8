"""What a request draws on (:class:`.Budgets`): its domain and limit, its other scopes'
budgets, its cost, each checked once; and what a failure of it counts against."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import stats
from scrapy import Request
from scrapy.settings import Settings
from scrapy.utils.test import get_crawler
from support import async_test

from scrapy_redis_throttle import InvalidThrottleMeta
from scrapy_redis_throttle.budgets import Budget, Budgets
from scrapy_redis_throttle.config import ThrottleConfig
from scrapy_redis_throttle.crawl_delay import CrawlDelays
from scrapy_redis_throttle.domains import Domains
from scrapy_redis_throttle.rejections import Rejections

RATES = {"a.example": "2/s", "b.example": {"rate": "1/s", "burst": 3}}


def budgets(**settings: Any) -> tuple[Budgets, Any]:
    config = ThrottleConfig.from_settings(Settings({"REDIS_THROTTLE_RATES": RATES} | settings))
    collector = stats()
    domains = Domains(config.scope, collector, 1.0, config.other_scopes)
    crawl_delays = CrawlDelays(get_crawler(), config, Rejections(collector, dict), dict, domains)
    return Budgets(config, domains, crawl_delays), collector


@async_test
async def test_a_request_draws_on_its_hosts_budget() -> None:
    resolver, _ = budgets()
    budget = await resolver.of(Request("http://a.example/1"))
    assert budget is not None
    assert (budget.domain, budget.limit.rate, budget.others, budget.cost) == ("a.example", 2, (), 1)


@pytest.mark.parametrize("url", ["data:,hello", "file:///etc/hostname"])
@async_test
async def test_a_request_without_a_host_is_not_throttled(url: str) -> None:
    resolver, _ = budgets()
    assert await resolver.of(Request(url)) is None


@async_test
async def test_an_unlimited_domain_is_not_throttled() -> None:
    resolver, _ = budgets(REDIS_THROTTLE_DEFAULT_RATE="unlimited")
    assert await resolver.of(Request("http://other.example/")) is None


@async_test
async def test_the_proxys_budget_is_drawn_on_too() -> None:
    resolver, _ = budgets(
        REDIS_THROTTLE_SCOPE=["host", "proxy"],
        REDIS_THROTTLE_RATES={**RATES, "proxy.example:8080": "5/s"},
    )
    request = Request("http://a.example/1", meta={"proxy": "http://proxy.example:8080"})
    budget = await resolver.of(request)
    assert budget is not None
    assert [name for name, _ in budget.others] == ["proxy.example:8080"]
    assert isinstance(budget.others[0], Budget)
    assert budget.other_names == ["proxy.example:8080"]


@pytest.mark.parametrize("cost", [2, 2.5, 3])
@async_test
async def test_a_cost_up_to_the_burst_is_taken(cost: float) -> None:
    resolver, _ = budgets()
    request = Request("http://b.example/1", meta={"redis_throttle_cost": cost})
    budget = await resolver.of(request)
    assert budget is not None
    assert budget.cost == cost


@pytest.mark.parametrize("cost", [0, -1, True, float("nan"), float("inf"), "2", None, 4])
@async_test
async def test_a_cost_it_could_never_pay_fails_that_request_alone(cost: object) -> None:
    resolver, collector = budgets()
    request = Request("http://b.example/1", meta={"redis_throttle_cost": cost})
    with pytest.raises(InvalidThrottleMeta, match="redis_throttle_cost"):
        await resolver.of(request)
    assert collector.get_value("redis_throttle/invalid_meta") == 1
    assert await resolver.of(Request("http://b.example/2")) is not None, "the next one goes"


@async_test
async def test_a_failure_counts_against_the_domain_its_request_went_under() -> None:
    resolver, _ = budgets()
    request = Request("http://a.example/1")
    await resolver.of(request)
    domain, limit = await resolver.failed(request)
    assert domain == "a.example"
    assert limit is not None
    assert limit.rate == 2


@pytest.mark.parametrize("meta", [{"dont_redis_throttle": True}, {"redis_throttle_penalty": False}])
@async_test
async def test_a_failure_of_an_opted_out_request_counts_against_none(meta: dict[str, Any]) -> None:
    resolver, _ = budgets()
    request = Request("http://a.example/1", meta=meta)
    assert await resolver.failed(request) == ("", None)
