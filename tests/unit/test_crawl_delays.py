"""robots.txt ``Crawl-delay`` as a domain's limit (:class:`.CrawlDelays`): each robots.txt goes
the way Scrapy takes it, through the RobotsTxtMiddleware of a real crawler's engine (its parser,
its ``robots_parsed`` signal, its cache of parsers), served from memory instead of the network:
the limit it sets, bounded by the settings, the values refused, and the hosts forgotten past
MAX_HOSTS."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from scrapy import Request, signals
from scrapy.downloadermiddlewares.robotstxt import RobotsTxtMiddleware
from scrapy.http import Response, TextResponse
from scrapy.robotstxt import ProtegoRobotParser
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.test import get_crawler
from support import async_test
from twisted.internet.defer import Deferred

from scrapy_redis_throttle import crawl_delay
from scrapy_redis_throttle.config import ThrottleConfig
from scrapy_redis_throttle.crawl_delay import MIN_CRAWL_DELAY, CrawlDelays
from scrapy_redis_throttle.domains import Domains
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.rejections import Rejections

# Crawl-delay comes from RobotsTxtMiddleware's robots_parsed signal (Scrapy 2.18+).
pytestmark = pytest.mark.skipif(
    not hasattr(signals, "robots_parsed"), reason="Scrapy < 2.18 has no robots_parsed signal"
)

A, B, C = "a.example", "b.example", "c.example"


def robots(delay: str, agent: str = "*") -> str:
    return f"User-agent: {agent}\nCrawl-delay: {delay}\nAllow: /\n"


class RawCrawlDelayParser(ProtegoRobotParser):
    """A project's ROBOTSTXT_PARSER that hands on its Crawl-delay line as it reads it: a float
    when it is one (NaN and negative ones too), else the text."""

    def crawl_delay(self, user_agent: str | bytes) -> Any:
        for line in self.rp_body.splitlines():
            name, _, value = line.partition(":")
            if name.strip().lower() == "crawl-delay":
                try:
                    return float(value)
                except ValueError:
                    return value.strip()
        return None

    def __init__(self, robotstxt_body: bytes, spider: Any) -> None:
        super().__init__(robotstxt_body, spider)
        self.rp_body = robotstxt_body.decode()


class Worker:
    """A crawler with *settings* (ROBOTSTXT_OBEY unless they say otherwise), its engine's
    downloader middlewares built (RobotsTxtMiddleware's cache is the one CrawlDelays forgets
    hosts from), and the throttle's CrawlDelays on it. Each robots.txt is served from
    :attr:`site` (netloc -> body)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> None:
        self.crawler = get_crawler(settings_dict={"ROBOTSTXT_OBEY": True, **settings})
        self.crawler.engine = engine = self.crawler._create_engine()
        self.config = ThrottleConfig.from_settings(self.crawler.settings)
        assert self.crawler.stats is not None
        rejections = Rejections(self.crawler.stats, dict)
        domains = Domains(
            self.config.scope,
            self.crawler.stats,
            self.config.crawl.dns_timeout,
            self.config.other_scopes,
        )
        self.delays = CrawlDelays(self.crawler, self.config, rejections, dict, domains)
        self.site: dict[str, str] = {}
        self.fetched: list[str] = []
        monkeypatch.setattr(engine, "download_async", self._serve)
        found = [
            each
            for each in engine.downloader.middleware.middlewares
            if isinstance(each, RobotsTxtMiddleware)
        ]
        self._robots_txt: RobotsTxtMiddleware | None = None
        if found:
            self._robots_txt = found[0]
        elif self.crawler.settings.getbool("ROBOTSTXT_OBEY"):
            # A robots.txt middleware outside the engine: a project's own.
            self._robots_txt = RobotsTxtMiddleware(self.crawler)

    @property
    def robots_txt(self) -> RobotsTxtMiddleware:
        assert self._robots_txt is not None, "ROBOTSTXT_OBEY is off"
        return self._robots_txt

    async def _serve(self, request: Request) -> Response:
        """The site: robots.txt of its host, else a 404."""
        netloc = urlparse_cached(request).netloc
        self.fetched.append(netloc)
        if netloc not in self.site:
            return Response(request.url, status=404, request=request)
        return TextResponse(request.url, body=self.site[netloc].encode(), request=request)

    async def visit(self, url: str, **headers: str) -> None:
        """A request of *url* through RobotsTxtMiddleware, as the downloader sends it there:
        its host's robots.txt is fetched and parsed first, once."""
        await self.robots_txt.process_request(Request(url, headers=headers))

    def parsed(self, url: str, body: str) -> None:
        """*url*'s robots.txt parsed, as Scrapy tells it (``robots_parsed``) when it obeys."""
        self.crawler.signals.send_catch_log(
            signal=signals.robots_parsed,
            robotparser=ProtegoRobotParser(body.encode(), None),
            request=Request(url),
        )

    def stat(self, name: str) -> Any:
        assert self.crawler.stats is not None
        return self.crawler.stats.get_value(f"redis_throttle/{name}")

    def limit(self, domain: str) -> Limit | None:
        """*domain*'s limit, by the configured one and its robots.txt."""
        configured = self.config.limits.lookup(domain)
        return self.delays.limit(domain, configured)


def rate_and_burst(each: Limit | None) -> tuple[float, int] | None:
    return None if each is None else (each.rate, each.burst)


@async_test
async def test_a_crawl_delay_becomes_its_domain_s_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Crawl-delay makes its host's limit one request per delay, burst 1; others keep theirs."""
    worker = Worker(monkeypatch, REDIS_THROTTLE_DEFAULT_RATE="5/s", REDIS_THROTTLE_DEFAULT_BURST=3)
    worker.site[A] = robots("4")
    await worker.visit(f"http://{A}/page")
    assert rate_and_burst(worker.limit(A)) == (0.25, 1)
    assert rate_and_burst(worker.limit(B)) == (5.0, 3)
    assert worker.stat("crawl_delay/applied") == 1


@async_test
async def test_a_stricter_configured_limit_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configured limit slower than the Crawl-delay keeps its rate: a delay never speeds up."""
    worker = Worker(monkeypatch, REDIS_THROTTLE_RATES={A: "1/10s"})
    worker.site[A] = robots("2")
    await worker.visit(f"http://{A}/page")
    assert rate_and_burst(worker.limit(A)) == (0.1, 1)


@async_test
async def test_the_crawl_delay_is_that_of_the_throttle_s_user_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The delay read is ROBOTSTXT_USER_AGENT's, else the request's User-Agent's."""
    body = robots("3", agent="politebot") + "\n" + robots("1")
    by_setting = Worker(monkeypatch, ROBOTSTXT_USER_AGENT="politebot")
    by_setting.site[A] = body
    await by_setting.visit(f"http://{A}/page")
    assert rate_and_burst(by_setting.limit(A)) == (1 / 3, 1)
    by_header = Worker(monkeypatch)
    by_header.site[A] = by_header.site[B] = body
    await by_header.visit(f"http://{A}/page", **{"User-Agent": "politebot/2.0"})
    await by_header.visit(f"http://{B}/page", **{"User-Agent": "otherbot/1.0"})
    assert rate_and_burst(by_header.limit(A)) == (1 / 3, 1)
    assert rate_and_burst(by_header.limit(B)) == (1.0, 1)


@async_test
async def test_a_crawl_delay_over_the_maximum_is_capped_and_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A delay over MAX_CRAWL_DELAY is capped, counted, logged; one under MIN_CRAWL_DELAY raised."""
    worker = Worker(
        monkeypatch, REDIS_THROTTLE_MAX_CRAWL_DELAY=10, REDIS_THROTTLE_DEFAULT_RATE=None
    )
    worker.site[A] = robots("3600")
    worker.site[B] = robots("0.0000001")
    await worker.visit(f"http://{A}/page")
    await worker.visit(f"http://{B}/page")
    assert rate_and_burst(worker.limit(A)) == (0.1, 1)
    assert rate_and_burst(worker.limit(B)) == (1 / MIN_CRAWL_DELAY, 1)
    assert worker.stat("crawl_delay/capped") == 1
    assert any("Crawl-delay of 3600 s; honouring 10 s" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("delay", ["nan", "-2", "soon"])
@async_test
async def test_a_crawl_delay_that_is_no_number_of_seconds_is_refused_and_counted(
    monkeypatch: pytest.MonkeyPatch, delay: str
) -> None:
    """A Crawl-delay that is NaN, negative or no number is rejected, counted; the limit stays."""
    parser = f"{__name__}.{RawCrawlDelayParser.__name__}"
    worker = Worker(monkeypatch, ROBOTSTXT_PARSER=parser)
    worker.site[A] = robots(delay)
    await worker.visit(f"http://{A}/page")
    assert worker.stat("rejected/crawl_delay") == 1
    assert worker.stat("crawl_delay/applied") is None
    assert rate_and_burst(worker.limit(A)) == (1.0, 1), "REDIS_THROTTLE_DEFAULT_RATE's"


@async_test
async def test_robots_txt_without_a_crawl_delay_or_of_zero_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No Crawl-delay, one of 0, or no robots.txt at all leaves the configured limit itself."""
    worker = Worker(monkeypatch)
    worker.site[A] = "User-agent: *\nDisallow: /private\n"
    worker.site[B] = robots("0")
    await worker.visit(f"http://{A}/page")
    await worker.visit(f"http://{B}/page")
    # C has no robots.txt at all (404)
    await worker.visit(f"http://{C}/page")
    for host in (A, B, C):
        assert worker.delays.limit(host, worker.config.limits.default) is (
            worker.config.limits.default
        )
    assert worker.stat("crawl_delay/applied") is None


@async_test
async def test_of_several_robots_txt_of_one_domain_the_longest_delay_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of a domain's several robots.txt (one per port) the longest Crawl-delay counts, any order."""
    worker = Worker(monkeypatch, REDIS_THROTTLE_DEFAULT_RATE=None)
    worker.site[f"{A}:8080"] = robots("5")
    worker.site[A] = robots("2")
    worker.site[f"{B}:8080"] = robots("2")
    worker.site[B] = robots("5")
    for url in (f"http://{A}:8080/", f"http://{A}/", f"http://{B}:8080/", f"http://{B}/"):
        await worker.visit(url)
    assert rate_and_burst(worker.limit(A)) == (0.2, 1)
    assert rate_and_burst(worker.limit(B)) == (0.2, 1)


@pytest.mark.parametrize(
    "settings",
    [{"REDIS_THROTTLE_CRAWL_DELAY_ENABLED": False}, {"ROBOTSTXT_OBEY": False}],
)
def test_crawl_delay_is_ignored_when_switched_off_or_robots_txt_is_not_obeyed(
    monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any]
) -> None:
    """Without CRAWL_DELAY_ENABLED or ROBOTSTXT_OBEY the throttle does not listen to robots.txt."""
    worker = Worker(monkeypatch, **settings)
    worker.parsed(f"http://{A}/page", robots("4"))
    assert not worker.delays.active
    assert worker.delays.describe() is None
    assert rate_and_burst(worker.limit(A)) == (1.0, 1)


def test_an_active_crawl_delay_says_so_and_hears_robots_txt_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Active, it names its maximum at start-up, and robots_parsed sets its host's limit."""
    worker = Worker(monkeypatch, REDIS_THROTTLE_MAX_CRAWL_DELAY=20)
    worker.parsed(f"http://{A}/page", robots("4"))
    assert worker.delays.active
    assert "up to 20 s" in (worker.delays.describe() or "")
    assert rate_and_burst(worker.limit(A)) == (0.25, 1)


@async_test
async def test_past_max_hosts_the_least_recently_requested_host_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_HOSTS the least recent host is forgotten with its robots.txt, which comes back."""
    monkeypatch.setattr(crawl_delay, "MAX_HOSTS", 2)
    worker = Worker(monkeypatch, REDIS_THROTTLE_DEFAULT_RATE=None)
    worker.site.update({A: robots("2"), B: robots("2"), C: robots("2")})
    await worker.visit(f"http://{A}/page")
    await worker.visit(f"http://{B}/page")
    assert worker.limit(A) is not None  # A requested again: B is the least recent
    await worker.visit(f"http://{C}/page")
    assert worker.limit(B) is None
    assert worker.limit(A) is not None
    assert worker.limit(C) is not None
    assert B not in worker.robots_txt._parsers
    assert worker.stat("crawl_delay/forgotten") == 1
    await worker.visit(f"http://{B}/page")
    assert worker.fetched == [A, B, C, B], "fetched again"
    assert rate_and_burst(worker.limit(B)) == (0.5, 1)


@async_test
async def test_a_host_whose_robots_txt_scrapy_has_not_stored_yet_is_not_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host whose robots.txt Scrapy has not stored yet (still a Deferred) is not forgotten."""
    monkeypatch.setattr(crawl_delay, "MAX_HOSTS", 1)
    worker = Worker(monkeypatch, REDIS_THROTTLE_DEFAULT_RATE=None)
    worker.site.update({A: robots("2"), B: robots("2")})
    held, release = asyncio.Event(), asyncio.Event()

    async def hold_a(robotparser: object, request: Request) -> None:
        if urlparse_cached(request).hostname == A:
            held.set()
            await release.wait()

    worker.crawler.signals.connect(hold_a, signal=signals.robots_parsed)
    visit_a = asyncio.ensure_future(worker.visit(f"http://{A}/page"))
    await held.wait()
    assert isinstance(worker.robots_txt._parsers[A], Deferred), "not stored yet"
    await worker.visit(f"http://{B}/page")
    release.set()
    await visit_a
    assert worker.stat("crawl_delay/forgotten") is None
    assert rate_and_burst(worker.limit(A)) == (0.5, 1)
    assert rate_and_burst(worker.limit(B)) == (0.5, 1)
    assert set(worker.robots_txt._parsers) == {A, B}


@async_test
async def test_without_scrapy_s_robots_txt_cache_every_delay_is_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without Scrapy's RobotsTxtMiddleware no delay is forgotten; one WARNING, nothing fails."""
    monkeypatch.setattr(crawl_delay, "MAX_HOSTS", 1)
    worker = Worker(
        monkeypatch,
        REDIS_THROTTLE_DEFAULT_RATE=None,
        DOWNLOADER_MIDDLEWARES={RobotsTxtMiddleware: None},
    )
    worker.site.update({A: robots("2"), B: robots("2"), C: robots("2")})
    for host in (A, B, C):
        await worker.visit(f"http://{host}/page")
    assert [rate_and_burst(worker.limit(host)) for host in (A, B, C)] == [(0.5, 1)] * 3
    assert worker.stat("crawl_delay/forgotten") is None
    warnings = [r for r in caplog.records if "found no RobotsTxtMiddleware" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
