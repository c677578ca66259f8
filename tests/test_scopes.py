"""What a limit is kept per (REDIS_THROTTLE_SCOPE): each host, each registrable domain, or what
a function of the project's says; with real crawls of host names under a real public suffix
that a test resolver sends to the demo site."""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from loopback_names import LoopbackNames, name_resolver, resolving
from scrapy import Request, signals
from scrapy.settings import Settings
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.test import get_crawler
from support import (
    ARRIVAL_JITTER,
    achieved_rate,
    assert_never_early,
    assert_paced,
    async_test,
    crawl_settings,
    finish_crawl_workers,
    missed_moments,
    released,
    run_crawl,
    shared_jobs,
    start_crawl_workers,
)
from twisted.internet.address import IPv4Address

from scrapy_redis_throttle import ThrottleConfig, ThrottleConfigError
from scrapy_redis_throttle.domains import Domains, ServerAddresses
from scrapy_redis_throttle.rates import build_table
from scrapy_redis_throttle.scopes import (
    HOST,
    IP,
    REGISTRABLE_DOMAIN,
    parse_scope,
    registrable_domain,
)

A, B, C = HOSTS
HAS_ROBOTS_SIGNAL = hasattr(signals, "robots_parsed")
# Three host names of one registrable domain (.com is a public suffix), at the demo site's
# three addresses.
NAMES = {"www.shop.com": A, "img.shop.com": B, "api.shop.com": C}


def config(**settings: Any) -> ThrottleConfig:
    return ThrottleConfig.from_settings(Settings(settings))


@pytest.mark.parametrize(
    ("host", "domain"),
    [
        ("www.shop.com", "shop.com"),
        ("a.b.shop.com", "shop.com"),
        ("shop.com", "shop.com"),
        ("www.shop.co.uk", "shop.co.uk"),  # a suffix of two labels
        ("user.github.io", "github.io"),  # a private suffix: one operator's hosts, one budget
        ("xn--bcher-kva.de", "xn--bcher-kva.de"),  # IDNA, as Scrapy's requests carry it
        ("co.uk", "co.uk"),  # a public suffix itself: its own
        ("127.0.0.2", "127.0.0.2"),  # no registrable domain: the host's own
        ("localhost", "localhost"),
        ("intranet.corp", "intranet.corp"),  # under no known suffix
    ],
)
def test_the_registrable_domain_of_a_host(host: str, domain: str) -> None:
    assert registrable_domain(host) == domain


def domain_of_the_request(request: Request) -> str:
    return "group"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (HOST, HOST),
        (REGISTRABLE_DOMAIN, REGISTRABLE_DOMAIN),
        (f"{__name__}.domain_of_the_request", f"{__name__}.domain_of_the_request"),
        (domain_of_the_request, "domain_of_the_request"),
    ],
)
def test_the_scope_setting_takes_a_name_or_a_function(value: object, expected: str) -> None:
    assert str(config(REDIS_THROTTLE_SCOPE=value).scope) == expected
    assert str(config().scope) == HOST, "the default"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "domain",
            "REDIS_THROTTLE_SCOPE must be 'host', 'registrable_domain', 'ip', 'proxy', or a function",
        ),
        ("no_such_module.domain_of", "REDIS_THROTTLE_SCOPE: cannot import 'no_such_module.d"),
        (f"{__name__}.no_such_function", "REDIS_THROTTLE_SCOPE: cannot import"),
        (
            5,
            "REDIS_THROTTLE_SCOPE must be 'host', 'registrable_domain', 'ip', 'proxy', or a function",
        ),
        (
            Request,
            "REDIS_THROTTLE_SCOPE must be 'host', 'registrable_domain', 'ip', 'proxy', or a function",
        ),
        (
            lambda: "x",
            "REDIS_THROTTLE_SCOPE must be 'host', 'registrable_domain', 'ip', 'proxy', or a function",
        ),
        ("..", "REDIS_THROTTLE_SCOPE: cannot import '..'"),
        ("broken_at_import.domain_of", "REDIS_THROTTLE_SCOPE: cannot import 'broken_at_import."),
    ],
)
def test_a_bad_scope_fails_at_start_up_naming_the_setting(
    value: object, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('broken')\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(ThrottleConfigError, match="^" + re.escape(message)):
        config(REDIS_THROTTLE_SCOPE=value)


def test_the_spider_attribute_sets_the_scope_over_the_setting() -> None:
    settings = Settings({"REDIS_THROTTLE_SCOPE": HOST})
    cfg = ThrottleConfig.from_settings(settings, spider_scope=REGISTRABLE_DOMAIN)
    assert str(cfg.scope) == REGISTRABLE_DOMAIN
    with pytest.raises(ThrottleConfigError, match=r"^spider attribute redis_throttle_scope must"):
        ThrottleConfig.from_settings(settings, spider_scope="everything")


def test_a_wildcard_covers_a_registrable_domain_itself() -> None:
    table = build_table([("rates", {"*.shop.com": "5/s", "*.com": "1/s"})], None, 1)
    shop = table.lookup("shop.com", itself=True)
    assert shop is not None
    assert shop.rate == 5
    host = table.lookup("shop.com")  # a host named shop.com: only *.com names it
    assert host is not None
    assert host.rate == 1


def test_a_fleet_keeps_one_budget_for_every_host_of_a_registrable_domain(
    redis_server: RedisServer,
) -> None:
    """Three worker processes crawl three hosts of shop.com, whose server allows 5/s for them
    all together (a 429 above): with REDIS_THROTTLE_SCOPE = "registrable_domain" and the
    wildcard's one limit, none is refused and the budget is used."""
    rate = 5
    with DemoSite(HOSTS, pages=10, overload={"*": (int(1 + rate * 1.1), 1)}) as site:
        requests = [
            {"url": f"http://{name}:{site.port}/page/{n}"} for n in range(10) for name in NAMES
        ]
        settings = crawl_settings(
            redis_server.url, REDIS_THROTTLE_SCOPE=REGISTRABLE_DOMAIN, **resolving(NAMES)
        )
        jobs = shared_jobs(settings, requests, {"*.shop.com": f"{rate}/s"})
        all_stats = finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 90)
        arrivals = site.arrivals()
    assert sorted((a.host, a.path) for a in arrivals) == sorted(
        (host, f"/page/{n}") for host in HOSTS for n in range(10)
    ), "every page of every host, once, none refused"
    assert [a for a in arrivals if a.status != 200] == []
    went = released(all_stats, *NAMES)
    assert_paced(went, rate, 1, "shop.com, as released")
    assert_never_early([a.wall_time for a in arrivals], went, "shop.com")
    missed = missed_moments(all_stats, "shop.com")
    utilisation = achieved_rate([a.time for a in arrivals], 1, missed) / rate
    print(f"shop.com: utilisation {utilisation:.2f}, missed moments {missed}")
    assert utilisation >= 0.9


def test_a_fleet_keeps_one_budget_for_every_host_of_a_server(redis_server: RedisServer) -> None:
    """Three worker processes crawl three sites of three registrable domains that one server
    (127.0.0.2) serves, and limits to 5/s for them all (a 429 above): with REDIS_THROTTLE_SCOPE
    = "ip", the server's address is the domain, none is refused and the budget is used."""
    rate = 5
    names = dict.fromkeys(("www.shop.com", "www.other.org", "www.third.net"), A)
    with DemoSite([A], pages=10, overload={A: (int(1 + rate * 1.1), 1)}) as site:
        requests = [
            {"url": f"http://{name}:{site.port}/page/{n}"} for n in range(10) for name in names
        ]
        settings = crawl_settings(redis_server.url, REDIS_THROTTLE_SCOPE=IP, **resolving(names))
        jobs = shared_jobs(settings, requests, {A: f"{rate}/s"})
        all_stats = finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 90)
        arrivals = site.arrivals()
    assert [a for a in arrivals if a.status != 200] == []
    assert len(arrivals) == 30, "every page of every site, once (the server sees its paths)"
    went = released(all_stats, *names)
    assert_paced(went, rate, 1, f"{A}, as released")
    assert_never_early([a.wall_time for a in arrivals], went, A)
    missed = missed_moments(all_stats, A)
    utilisation = achieved_rate([a.time for a in arrivals], 1, missed) / rate
    print(f"{A}: utilisation {utilisation:.2f}, missed moments {missed}")
    assert utilisation >= 0.9


@async_test
async def test_a_function_names_the_domain_and_a_failure_fails_only_its_request(
    redis_server: RedisServer, site: DemoSite
) -> None:
    class Unusual(BaseException):
        pass

    def scope(request: Request) -> object:
        page = request.url.rsplit("/", 1)[1]
        if page == "9":
            raise RuntimeError("no domain for this one")
        if page == "7":
            raise Unusual("not even an Exception")
        return {"8": "", "6": "b\udcff"}.get(page, "Group")

    crawler = await run_crawl(
        crawl_settings(redis_server.url, REDIS_THROTTLE_SCOPE=scope),
        [{"url": site.url(host, f"/page/{n}")} for host in (A, B) for n in (0, 1, 6, 7, 8, 9)],
        redis_throttle_rates={"group": "4/s"},
    )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 4
    assert stats["redis_throttle/invalid_domains"] == 8
    assert stats["test/failures/InvalidThrottleDomain"] == 8
    name = scope.__qualname__
    assert sorted(crawler.spider.failure_messages) == [  # type: ignore[union-attr]
        f"REDIS_THROTTLE_SCOPE: {name} {what} (<GET {site.url(host, path)}>)"
        for what, path in (
            ("failed: RuntimeError('no domain for this one')", "/page/9"),
            ("failed: Unusual('not even an Exception')", "/page/7"),
            ("gave '', not a domain", "/page/8"),
            ("gave 'b\\udcff', no name IDNA takes", "/page/6"),
        )
        for host in (A, B)
    ]
    # One budget for both hosts: as two, their first requests would go together.
    assert_paced(released(stats, A, B), 4, 1, "group, as released")


@async_test
async def test_a_request_chooses_its_scope_by_name_in_its_meta(
    redis_server: RedisServer, site: DemoSite
) -> None:
    requests = [
        {"url": site.url(A, "/page/0"), "meta": {"redis_throttle_scope": REGISTRABLE_DOMAIN}},
        {"url": site.url(A, "/page/1"), "meta": {"redis_throttle_scope": "builtins.print"}},
    ]
    crawler = await run_crawl(crawl_settings(redis_server.url), requests)
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 1
    assert stats["redis_throttle/invalid_meta"] == 1
    assert crawler.spider.failure_messages == [  # type: ignore[union-attr]
        "redis_throttle_scope must be 'host', 'registrable_domain', 'ip' or 'proxy', got "
        "'builtins.print' "
        f"(<GET {site.url(A, '/page/1')}>)"
    ]


def crawl_shop(
    redis_url: str, site: DemoSite, pages_each: int, **settings: Any
) -> list[dict[str, Any]]:
    """One worker process crawls *pages_each* pages of www.shop.com and img.shop.com, in turn,
    with REDIS_THROTTLE_SCOPE = "registrable_domain" and shop.com at 10/s."""
    names = {"www.shop.com": A, "img.shop.com": B}
    job = {
        "settings": crawl_settings(
            redis_url, REDIS_THROTTLE_SCOPE=REGISTRABLE_DOMAIN, **resolving(names), **settings
        ),
        "requests": [
            {"url": f"http://{name}:{site.port}/page/{n}"}
            for n in range(pages_each)
            for name in names
        ],
        "spider_attributes": {"redis_throttle_rates": {"*.shop.com": "10/s"}},
    }
    return finish_crawl_workers(start_crawl_workers(redis_url, [job]), 90)


def test_a_429_from_one_host_pauses_every_host_of_the_domain(redis_server: RedisServer) -> None:
    """The site counts shop.com's hosts together: a 429 (Retry-After: 2) from www.shop.com
    pauses img.shop.com too (under the default scope, img.shop.com would go on at 10/s)."""
    with DemoSite(HOSTS, pages=10, errors={(A, "/page/2"): [(429, {"Retry-After": "2"})]}) as site:
        [stats] = crawl_shop(redis_server.url, site, 6)
        [refused] = [a.wall_time for a in site.arrivals(A) if a.status == 429]
    assert stats["test/responses"] == 12
    assert stats["redis_throttle/pauses"] == 1
    went = released(stats, "www.shop.com", "img.shop.com")
    after = [t for t in went if t > refused]
    assert len(after) >= 6, "the rest of both hosts' pages, after the pause"
    # Requests may have left before the worker read the 429; then none for the pause.
    gap = max(later - earlier for earlier, later in itertools.pairwise(went))
    assert gap > 1.8, f"the longest gap between requests to shop.com: {gap:.2f} s"


@pytest.mark.skipif(not HAS_ROBOTS_SIGNAL, reason="Scrapy < 2.18 has no robots_parsed signal")
def test_a_crawl_delay_of_a_host_paces_every_host_of_the_domain(
    redis_server: RedisServer,
) -> None:
    """Both hosts' robots.txt ask for a Crawl-delay of 0.5 s: shop.com's budget keeps it
    between all their pages (under the default scope, each host would have 0.5 s of its own,
    and their pages would interleave 0.25 s apart)."""
    robots = dict.fromkeys((A, B), "User-agent: *\nCrawl-delay: 0.5\nAllow: /\n")
    with DemoSite(HOSTS, pages=10, robots=robots) as site:
        [stats] = crawl_shop(redis_server.url, site, 3, ROBOTSTXT_OBEY=True)
    assert stats["test/responses"] == 6
    assert stats["redis_throttle/crawl_delay/applied"] == 1, "the domain's, once"
    went = released(stats, "www.shop.com", "img.shop.com")
    gaps = [later - earlier for earlier, later in itertools.pairwise(went)]
    assert min(gaps) >= 0.5 - ARRIVAL_JITTER, f"gaps between the pages: {gaps}"


@pytest.fixture
def shop_names() -> Iterator[None]:
    """www.shop.com and img.shop.com resolve to the demo site in this process too."""
    from twisted.internet import reactor

    with name_resolver(LoopbackNames(reactor, {"www.shop.com": A, "img.shop.com": B})):
        yield


@async_test
async def test_a_redirected_request_is_under_the_domain_of_its_new_url(
    redis_server: RedisServer, shop_names: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Scrapy's downloader sets meta["download_slot"] (the host name), and a redirect carries
    it to the next URL: it is not the project's own slot, and the 429 of the new URL pauses the
    domain the scope gives it, named with the host that answered."""
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    with DemoSite(HOSTS, pages=10) as site:
        location = f"http://img.shop.com:{site.port}/page/1"
        site.add_errors((A, "/page/0"), [(302, {"Location": location})])
        site.add_errors((B, "/page/1"), [(429, {"Retry-After": "1"})])
        crawler = await run_crawl(
            crawl_settings(redis_server.url, REDIS_THROTTLE_SCOPE=REGISTRABLE_DOMAIN),
            [{"url": f"http://www.shop.com:{site.port}/page/0"}],
            redis_throttle_rates={"*.shop.com": "5/s"},
        )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 1
    assert stats["redis_throttle/pauses"] == 1
    messages = [r.getMessage() for r in caplog.records if "429 from" in r.getMessage()]
    assert messages == [
        "Redis throttle: 429 from 'img.shop.com' (domain 'shop.com') (Retry-After: 1 s): no "
        "request to it for 1.0 s, from any worker"
    ]


@pytest.mark.skipif(not HAS_ROBOTS_SIGNAL, reason="Scrapy < 2.18 has no robots_parsed signal")
@async_test
async def test_a_crawl_delay_is_the_hosts_whatever_the_meta_of_its_first_request(
    redis_server: RedisServer,
) -> None:
    """Scrapy tells of a robots.txt with the request that made it fetch it: that request's
    meta (here an invalid redis_throttle_key, which fails it alone) does not decide the domain
    of the Crawl-delay."""
    robots = {A: "User-agent: *\nCrawl-delay: 1\nAllow: /\n"}
    with DemoSite(HOSTS, pages=10, robots=robots) as site:
        crawler = await run_crawl(
            crawl_settings(redis_server.url, ROBOTSTXT_OBEY=True, CONCURRENT_REQUESTS=1),
            [{"url": site.url(A, "/page/0"), "meta": {"redis_throttle_key": 5}}]
            + [{"url": site.url(A, f"/page/{n}")} for n in range(1, 4)],
            redis_throttle_rates={A: "50/s"},
        )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 3
    assert stats["redis_throttle/invalid_meta"] == 1
    assert stats["redis_throttle/crawl_delay/applied"] == 1
    went = released(stats, A)
    gaps = [later - earlier for earlier, later in itertools.pairwise(went)]
    assert min(gaps) >= 1 - ARRIVAL_JITTER, f"gaps between the pages: {gaps}"


def domains(scope: str = HOST, dns_timeout: float = 60) -> Domains:
    return Domains(
        parse_scope(scope, source="test"), MemoryStatsCollector(get_crawler()), dns_timeout
    )


@async_test
async def test_the_projects_own_slot_is_the_one_a_request_came_with() -> None:
    """Scrapy's downloader sets meta["download_slot"] to the host name; retries, redirects and
    requests made with a copy of the meta carry it on. Only a slot the project gave a request
    of that URL is the project's own."""
    of = domains(REGISTRABLE_DOMAIN).of
    first = Request("http://www.shop.com/1")
    assert await of(first) == "shop.com"
    first.meta["download_slot"] = "www.shop.com"  # as Scrapy's downloader does
    assert await of(first.copy()) == "shop.com", "a retry"
    hops = ["http://www.shop.com/1", "http://img.other.org/2", "http://a.third.net/3"]
    request = first
    for hop, url in enumerate(hops[1:]):
        meta = {**request.meta, "redirect_urls": hops[: hop + 1]}
        request = Request(url, meta=meta)
        assert await of(request) == registrable_domain(urlparse_cached(request).hostname or "")
        request.meta["download_slot"] = urlparse_cached(request).hostname
    own = Request("http://img.shop.com/4", meta={**first.meta, "download_slot": "mine"})
    assert await of(own) == "mine", "a slot the project gave, with a copy of the meta"
    assert await of(own.copy()) == "mine"


class Resolver:
    """A name resolver that never answers, or answers twice."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers

    def resolveHostName(self, receiver: Any, host: str, *args: Any, **kwargs: Any) -> None:
        if self.answers:
            receiver.addressResolved(IPv4Address("TCP", "127.0.0.9", 0))
            receiver.resolutionComplete()
            receiver.resolutionComplete()


@pytest.mark.parametrize("answers", [False, True], ids=["never-answers", "answers-twice"])
@async_test
async def test_an_address_lookup_is_bounded_and_taken_once(answers: bool) -> None:
    with name_resolver(Resolver(answers)):
        addresses = ServerAddresses(timeout=0.2)
        address = await addresses.of("www.shop.com")
        addresses.close()
    assert address == ("127.0.0.9" if answers else "www.shop.com")
