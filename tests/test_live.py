"""Limits changed live in Redis: the script, the command line tool, running crawls that follow."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import EXAMPLE_PROJECT
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer
from metrics_scrape import Samples, fetch, samples, value
from processes import TOOL
from scrapy.crawler import CrawlerRunner
from scrapy.utils.defer import maybe_deferred_to_future
from spiders import UrlListSpider
from support import (
    assert_never_early,
    assert_paced,
    assert_released_paced,
    async_test,
    crawl_settings,
    finish_crawl_workers,
    one_domain_jobs,
    pages,
    released,
    run_crawl,
    start_crawl_workers,
    tool,
    wait_until,
    wait_until_async,
)

from scrapy_redis_throttle.cli import EXIT_BAD_INPUT, EXIT_REDIS_FAILED
from scrapy_redis_throttle.cli import main as cli_main
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.live_limits import LiveLimit
from scrapy_redis_throttle.pauses import parse_message
from scrapy_redis_throttle.redis_schema import (
    bucket_key,
    penalty_channel,
    penalty_key,
    rate_key,
    void_key,
)
from scrapy_redis_throttle.scripts import load_script

A, B, _ = HOSTS
KEY = bucket_key("ns", "shop.example")
PENALTY = penalty_key("ns", "shop.example")
VOID = void_key("ns", "shop.example")
TEN_PER_SECOND = ["100000", "1", "1", "10000000"]  # interval µs, burst, cost, reserve µs


class Scripts:
    """The scripts as the workers and the tool call them, on a synchronous client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.control = LiveControl(client, "ns")
        self.acquire_script = client.register_script(load_script("token_bucket.lua"))
        self.penalty = client.register_script(load_script("penalty.lua"))
        self.slow_down = client.register_script(load_script("slow_down.lua"))

    def value(self) -> bytes:
        """The bucket's value in Redis."""
        value = self.client.get(KEY)
        assert isinstance(value, bytes)
        return value

    def acquire(self, args: list[str] = TEN_PER_SECOND) -> tuple[int, float]:
        """(status, seconds to wait) for the domain at 10/s (burst 1) unless set live."""
        status, wait_us, *_ = self.acquire_script(keys=[KEY], args=args)
        return status, wait_us / 1e6


@pytest.fixture
def scripts(redis_server: RedisServer) -> Iterator[Scripts]:
    with redis_server.client() as client:
        yield Scripts(client)


def test_a_live_limit_overrides_the_workers_own_and_lives_on(scripts: Scripts) -> None:
    change = scripts.control.set("shop.example", 2, None)
    assert change.live == LiveLimit(rate=2, burst=None, paused=False)
    assert scripts.acquire() == (1, 0)
    status, wait = scripts.acquire()
    assert status == 2
    assert 0.4 < wait <= 0.5, "2/s: 0.5 s apart, not the workers' 0.1 s"
    assert scripts.value().endswith(b" 2.0 - 0")
    assert scripts.client.ttl(KEY) == -1, "the limit lives until it is deleted"
    assert scripts.control.live_limits() == {"shop.example": change.live}


def test_a_live_burst_caps_the_cost_of_a_request(scripts: Scripts) -> None:
    scripts.control.set("shop.example", None, 2)
    # A request that costs 3 tokens could never go with a burst of 2: it takes 2.
    assert scripts.acquire(["100000", "5", "3", "10000000"]) == (1, 0)
    assert scripts.acquire(["100000", "5", "3", "10000000"])[0] == 2


def test_a_paused_domain_takes_no_token_until_resumed(scripts: Scripts) -> None:
    scripts.control.pause("shop.example")
    before = scripts.value()
    assert scripts.acquire()[0] == 3
    assert scripts.value() == before, "nothing taken"
    change = scripts.control.resume("shop.example")
    assert change.live is None, "nothing else was set live: the value is the bucket's again"
    assert scripts.acquire() == (1, 0)
    assert scripts.control.live_limits() == {}


def test_each_acquire_in_the_domain_s_own_bucket_tells_its_limit_set_live(
    scripts: Scripts,
) -> None:
    """Last in the reply, as set_limit.lua returns it: the worker learns of a change or a
    pause in the call it makes anyway. Another scope's bucket, asked alone, tells none."""

    def live(alone: str = "0") -> object:
        return scripts.acquire_script(keys=[KEY], args=[*TEN_PER_SECOND, "0", "0", alone])[-1]

    assert live() == b""
    scripts.control.set("shop.example", 2, 3)
    assert live() == b"2.0 3 0"
    scripts.control.pause("shop.example")
    assert live() == b"2.0 3 1"
    assert isinstance(live(alone="1"), int), "alone: no limit set live in the reply"
    scripts.control.delete("shop.example")
    assert live() == b""


def test_delete_returns_the_domain_to_the_workers_own_limit(scripts: Scripts) -> None:
    scripts.control.set("shop.example", 1, 1)
    scripts.acquire()
    assert scripts.control.delete("shop.example").live is None
    assert scripts.acquire() == (1, 0), "its reservation at 1/s was voided"
    status, wait = scripts.acquire()
    assert status == 2
    assert wait <= 0.1
    assert 0 < scripts.client.pttl(KEY) <= 200, "expires again when the bucket is full"


def test_a_change_voids_the_moments_reserved_and_publishes_it(scripts: Scripts) -> None:
    for _ in range(5):
        scripts.acquire()  # moments reserved over the next 0.4 s
    with scripts.client.pubsub() as pubsub:  # type: ignore[no-untyped-call]
        pubsub.subscribe(penalty_channel("ns"))
        change = scripts.control.set("shop.example", 5, 1)
        messages = [pubsub.get_message(timeout=5) for _ in range(2)]
    assert 0.35 < change.void <= 0.5
    assert messages[1] is not None
    message = parse_message(messages[1]["data"])
    assert message is not None
    assert (message.domain, message.void_us) == ("shop.example", round(change.void * 1e6))
    assert not message.holds, "a change of rate: the requests ask again at once, no pause"
    assert 0 < message.at_us < 10**15, "when, by Redis's clock"
    assert scripts.acquire() == (1, 0), "the bucket forgot them: the new limit starts now"


def test_a_change_keeps_a_pause_after_a_429(scripts: Scripts) -> None:
    # A 429 with Retry-After: 5 paused the domain (penalty.lua, at 10/s, burst 1).
    scripts.penalty(
        keys=[KEY, PENALTY, VOID],
        args=["100000", "1", "5000000", "2000000", "600000000", "60000000", "ch", "shop.example"],
    )
    scripts.control.set("shop.example", 20, 1)
    status, wait = scripts.acquire()
    assert status == 2
    assert 4.9 < wait <= 5


def test_pauses_and_slowdowns_keep_the_live_limit(scripts: Scripts) -> None:
    scripts.control.set("shop.example", 4, 1)
    scripts.penalty(
        keys=[KEY, PENALTY, VOID],
        args=["100000", "1", "1000000", "2000000", "600000000", "60000000", "ch", "shop.example"],
    )
    assert scripts.value().endswith(b" 4.0 1 0")
    assert scripts.client.ttl(KEY) == -1
    # The adaptive rate halves the live rate (4/s), not the workers' own (10/s).
    lowered, rate, *_ = scripts.slow_down(
        keys=[KEY, rate_key("ns", "shop.example"), VOID],
        args=["10", "1", "0.5", "3600000000", "0", "0", "1", "ch", "shop.example"],
    )
    assert (lowered, float(rate)) == (1, 2.0)
    assert scripts.value().endswith(b" 4.0 1 0")


@pytest.mark.parametrize(
    "args",
    [
        ["stop", "-", "-", "ch", "d"],
        ["set", "0", "-", "ch", "d"],
        ["set", "fast", "-", "ch", "d"],
        ["set", "-", "1.5", "ch", "d"],
        ["set", "-", "0", "ch", "d"],
        ["set", "inf", "-", "ch", "d"],
        ["set", "1", "1", "ch"],
    ],
)
def test_set_limit_script_validates_its_arguments(scripts: Scripts, args: list[str]) -> None:
    script = scripts.client.register_script(load_script("set_limit.lua"))
    with pytest.raises(redis.ResponseError, match="set_limit takes an action"):
        script(keys=[KEY, PENALTY], args=args)
    assert scripts.client.keys("*") == []


def test_the_command_line_tool(redis_server: RedisServer, tmp_path: Path) -> None:
    url = ["--redis-url", redis_server.url]
    steps = [
        (["set", "Shop.Example", "2/s", "--burst", "3"], "shop.example: 2/s (burst 3)\n"),
        (["list"], "shop.example: 2/s (burst 3)\n"),
        (["pause", "shop.example"], "shop.example: 2/s (burst 3), PAUSED\n"),
        (["resume", "shop.example"], "shop.example: 2/s (burst 3)\n"),
        (["delete", "shop.example"], "shop.example: the workers' own limit\n"),
        (["list"], "No domain has a limit set live.\n"),
        (["status"], "0 workers live\nNo active domain.\n"),
    ]
    for args, output in steps:
        done = tool(*url, *args, cwd=tmp_path)  # outside any Scrapy project
        assert (done.returncode, done.stdout, done.stderr) == (0, output, ""), args


@pytest.mark.parametrize("spider", [["--spider", "shop"], []], ids=["--spider", "its-one-spider"])
def test_status_shows_the_active_domains_with_the_project_limits(
    redis_server: RedisServer, spider: list[str]
) -> None:
    """Without --spider, the project's one spider gives the limits (its burst of 3 here)."""
    with redis_server.client() as client:
        control = LiveControl(client, "redis_throttle")
        control.set("127.0.0.3", 1, None)
        control.pause("127.0.0.4")
    done = tool("--redis-url", redis_server.url, *spider, "status", cwd=EXAMPLE_PROJECT)
    assert done.returncode == 0, done.stderr
    live, *lines = [line.split("  ") for line in done.stdout.splitlines()]
    assert live == ["0 workers live"]
    cells = [[cell.strip() for cell in line if cell.strip()] for line in lines]
    assert cells == [
        [
            "domain",
            "limit",
            "set",
            "tokens left",
            "full in",
            "last minute",
            "achieved",
            "waiting",
            "penalty pause",
            "adaptive",
        ],
        ["127.0.0.3", "1/s (workers' burst)", "live", "3.0", "0.0 s", "0", "-", "0", "-", "-"],
        [
            "127.0.0.4",
            "workers' rate (workers' burst), PAUSED",
            "live",
            "1.0",
            "0.0 s",
            "0",
            "-",
            "0",
            "-",
            "-",
        ],
    ], "the burst and rates of the example spider's redis_throttle_rates"


def test_the_tool_prints_json_for_machines(redis_server: RedisServer) -> None:
    """``get``, ``list`` and ``status`` with ``--json``: the same state as the tables, typed
    (seconds, requests per second; null where the tool does not know), one object per call."""
    with redis_server.client() as client:
        control = LiveControl(client, "redis_throttle")
        control.set("127.0.0.3", 1, 2)
        control.pause("127.0.0.4")
    url = ["--redis-url", redis_server.url, "--spider", "shop"]

    def printed(*args: str) -> Any:
        done = tool(*url, *args, "--json", cwd=EXAMPLE_PROJECT)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    live = printed("list")
    assert live == {
        "live": {
            "127.0.0.3": {"limit": "1/s (burst 2)", "rate": 1.0, "burst": 2, "paused": False},
            "127.0.0.4": {
                "limit": "workers' rate (workers' burst), PAUSED",
                "rate": None,
                "burst": None,
                "paused": True,
            },
        }
    }
    [got] = printed("get", "127.0.0.3")["domains"]
    assert got == {
        "domain": "127.0.0.3",
        "limit": "1/s (burst 2)",
        "set": "live",
        "paused": False,
        "rate": 1.0,
        "burst": 2,
        "tokens_left": 2.0,
        "full_in": 0.0,
        "last_minute": 0,
        "achieved_rate": 0.0,
        "waiting": 0,
        "penalty_pause": 0.0,
        "strikes": 0,
        "adaptive_rate": None,
    }
    status = printed("status", "--top", "1")
    assert [row["domain"] for row in status["domains"]] == ["127.0.0.3"]
    assert status["more"] == 1
    assert status["workers"] == 0
    assert status["unreadable"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["set", "shop.example", "fast"], "LIMIT[0]: invalid rate 'fast'"),
        (["set", "shop.example", "--", "-5/s"], "LIMIT[0]: invalid rate '-5/s'; expected e.g. '5/s'"),
        (["set", "shop.example", "1/s", "--burst", "0"], "--burst: burst must be an integer"),
        (["get"], "the following arguments are required: DOMAIN"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["--spider", "nope", "list"], "--spider: no spider named 'nope'"),
        (["list", "--spider", "nope"], "--spider: no spider named 'nope'"),
        (["status", "--top", "0"], "argument --top: expected an integer of at least 1, got '0'"),
        (["status", "--top", "many"], "argument --top: expected an integer of at least 1, got 'many'"),
        (["status", "--watch", "0"], "argument --watch: expected a number of seconds from 0.1 to 86400, got '0'"),
        (["status", "--watch", "nan"], "argument --watch: expected a number of seconds from 0.1 to 86400, got 'nan'"),
        (["exporter", "--port", "70000"], "argument --port: expected a port, 0 to 65535, got '70000'"),
        (["exporter"], "the following arguments are required: --port"),
        (["set", "shop.example:8080", "3/s"], "DOMAIN: 'shop.example:8080' has a port, but the workers keep a site's limit under its host alone ('shop.example'); a host:port names a proxy, in a project whose REDIS_THROTTLE_SCOPE counts proxies"),
        (["get", "https://shop.example/"], "DOMAIN: expected a host name (or a redis_throttle_key, or a proxy's host:port), not a URL: 'https://shop.example/'"),
        (["get", "shop.example/a"], "not a URL: 'shop.example/a'"),
    ],
)  # fmt: skip
def test_the_tool_refuses_bad_input(
    redis_server: RedisServer,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In this process (a refusal ends before Redis is called), in the example project: what
    the tool reads of the project is set back after it."""
    monkeypatch.chdir(EXAMPLE_PROJECT)
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "shop.settings")
    monkeypatch.syspath_prepend(str(EXAMPLE_PROJECT))
    with pytest.raises(SystemExit) as exited:
        cli_main(["--redis-url", redis_server.url, *args])
    assert exited.value.code == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_the_tool_takes_its_options_before_or_after_the_command(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    before = tool("--redis-url", redis_server.url, "set", "shop.example", "2/s", cwd=tmp_path)
    after = tool("list", "--redis-url", redis_server.url, cwd=tmp_path)
    assert (before.returncode, after.returncode) == (0, 0), before.stderr + after.stderr
    assert after.stdout == "shop.example: 2/s (workers' burst)\n"
    # Given twice, the one after the command wins.
    both = tool("--redis-url", "redis://127.0.0.1:1/0", "list", "--redis-url", redis_server.url)
    assert both.stdout == after.stdout, both.stderr
    version = tool("--version")
    assert version.stdout == f"scrapy-redis-throttle {metadata.version('scrapy-redis-throttle')}\n"


def test_the_tool_names_a_proxy_by_host_and_port_where_the_scopes_count_proxies(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = proxied_settings\n")
    (tmp_path / "proxied_settings.py").write_text(
        f"REDIS_URL = {redis_server.url!r}\nREDIS_THROTTLE_SCOPE = ['host', 'proxy']\n"
    )
    done = tool("set", "Proxy.Example:3128", "10/s", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "proxy.example:3128: 10/s (workers' burst)\n")


def test_the_tool_says_when_redis_fails(tmp_path: Path) -> None:
    done = tool("--redis-url", "redis://:secret@127.0.0.1:1/0", "list", cwd=tmp_path)
    assert done.returncode == EXIT_REDIS_FAILED
    assert "Redis at redis://:***@127.0.0.1:1/0 failed: ConnectionError" in done.stderr


def run_tool_until(args: list[str], changed: Callable[[], object]) -> float:
    """Run the tool with ``--redis-url`` *args*; return the moment Redis shows the change."""
    process = subprocess.Popen(
        [*TOOL, "--redis-url", *args],
        stdout=subprocess.DEVNULL,
    )
    wait_until(changed, 60, f"the change of {args[1:]}")
    moment = time.time()
    assert process.wait(timeout=60) == 0
    return moment


def test_a_running_fleet_follows_a_limit_changed_live(redis_server: RedisServer) -> None:
    """Three worker processes crawl A at 10/s. The tool sets 2/s, then 10/s again: from one
    request interval after each change, the site sees the new rate."""
    with DemoSite(HOSTS, pages=200) as site:
        jobs = one_domain_jobs(site, A, crawl_settings(redis_server.url), {A: "10/s"}, 3, 40)
        workers = start_crawl_workers(redis_server.url, jobs)
        wait_until(lambda: len(site.arrivals(A)) >= 10, 60, "10 arrivals at 10/s")
        key = bucket_key("redis_throttle", A)
        with redis.Redis.from_url(redis_server.url) as client:
            slowed = run_tool_until(
                [redis_server.url, "set", A, "2/s"], lambda: b" 2.0 " in (client.get(key) or b"")
            )
            wait_until(
                lambda: sum(a.wall_time > slowed for a in site.arrivals(A)) >= 8, 60, "8 at 2/s"
            )
            restored = run_tool_until(
                [redis_server.url, "delete", A], lambda: b" " not in (client.get(key) or b"")
            )
        all_stats = finish_crawl_workers(workers, 120)
        arrivals = site.arrivals(A)

    assert len(arrivals) == 120
    went = released(all_stats, A)
    assert_never_early([a.wall_time for a in arrivals], went, A)
    # A request whose moment came as the limit changed may still go: from one interval on, 2/s,
    # until the change back (seen here up to a poll late: the workers may see it first).
    slow = [t for t in went if slowed + 0.5 < t < restored - 0.1]
    assert len(slow) >= 6
    assert_paced(slow, rate=2, burst=1, what="2/s, as released")
    # Back to 10/s: far more than 2/s allows in the next 2 s.
    assert sum(restored < a.wall_time < restored + 2 for a in arrivals) >= 10


@async_test
async def test_a_crawl_waits_while_its_domain_is_paused_live(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """...and its log says when the pause reaches it, and when the resume does."""
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    with redis.Redis.from_url(redis_server.url) as client:
        control = LiveControl(client, "redis_throttle")
        control.pause(A)
        runner = CrawlerRunner(crawl_settings(redis_server.url))
        crawler = runner.create_crawler(UrlListSpider)
        crawl = runner.crawl(
            crawler,
            requests=pages(site, A, 5) + pages(site, B, 3),
            redis_throttle_rates={A: "10/s", B: "10/s"},
        )
        await wait_until_async(lambda: len(site.arrivals(B)) == 3, "B's pages, A paused")
        stats = crawler.stats
        await wait_until_async(
            lambda: stats.get_value("redis_throttle/paused_live", 0) >= 10,
            "each of A's requests asked twice",
        )
        assert site.arrivals(A) == []
        resumed = time.time()
        control.resume(A)
        await maybe_deferred_to_future(crawl)
    arrivals = site.arrivals(A)
    assert len(arrivals) == 5
    assert min(released(stats.get_stats(), A)) > resumed
    assert_released_paced(stats.get_stats(), arrivals, 10, 1, A)
    told = [record.getMessage() for record in caplog.records if f"{A!r} is" in record.getMessage()]
    assert told == [
        f"Redis throttle: {A!r} is paused live for the fleet: no request to it until it is "
        f"resumed (scrapy-redis-throttle resume {A})",
        f"Redis throttle: {A!r} is back to its own limit, 10/s (burst 1)",
    ]


def test_the_exporter_and_status_show_a_running_fleet(
    redis_server: RedisServer, site: DemoSite
) -> None:
    """Two workers crawl A at 5/s while ``exporter`` serves the fleet's state and ``status``
    reads it: both count the two workers live and A's achieved rate, and the exporter a limit
    set live on B. The workers have 40 s of pages, and stop once both have been seen: a
    ``status`` run takes seconds on a busy machine, and the fleet must still be there."""
    with redis_server.client() as client:
        LiveControl(client, "redis_throttle").set(B, 3, None)
    exporter = subprocess.Popen(
        [*TOOL, "--redis-url", redis_server.url, "exporter", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A SIGABRT then dumps every thread's stack (see below).
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    try:
        assert exporter.stdout is not None
        url = exporter.stdout.readline().split(" at ")[-1].strip()  # serving from then on
        assert url.endswith("/metrics"), url
        settings = crawl_settings(redis_server.url, REDIS_THROTTLE_REPORT_INTERVAL=0.5)
        workers = start_crawl_workers(
            redis_server.url, one_domain_jobs(site, A, settings, {A: "5/s"}, 2, 100)
        )
        scraped: list[Samples] = []
        statuses: list[dict[str, Any]] = []

        def fleet_seen() -> bool:
            scraped.append(samples(fetch(url)))
            done = tool("--redis-url", redis_server.url, "status", "--json")
            assert done.returncode == 0, done.stderr
            statuses.append(json.loads(done.stdout))
            rows = [row for row in statuses[-1]["domains"] if row["domain"] == A]
            return (
                value(scraped[-1], "scrapy_redis_throttle_fleet_workers") == 2
                and value(scraped[-1], "scrapy_redis_throttle_achieved_rate", domain=A) > 0
                and statuses[-1]["workers"] == 2
                and bool(rows)
                and rows[0]["achieved_rate"] > 0
            )

        wait_until(fleet_seen, 30, "the exporter's and status's view of two workers sending to A")
        last = scraped[-1]
        assert value(last, "scrapy_redis_throttle_exporter_redis_up") == 1
        assert value(last, "scrapy_redis_throttle_live_rate", domain=B) == 3
        assert value(last, "scrapy_redis_throttle_paused_live", domain=B) == 0
        [a] = [row for row in statuses[-1]["domains"] if row["domain"] == A]
        # Over the time the fleet has run, under a minute here: not the last minute's count / 60.
        assert a["achieved_rate"] > a["last_minute"] / 60 > 0
        for worker in workers:
            worker.send_signal(signal.SIGINT)
        finish_crawl_workers(workers, 60)
    finally:
        exporter.send_signal(signal.SIGINT)
        try:
            _, errors = exporter.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # Its threads' stacks say where an exporter that does not end on Ctrl-C waits.
            exporter.send_signal(signal.SIGABRT)
            _, errors = exporter.communicate(timeout=30)
            raise AssertionError(
                f"the exporter did not end within 30 s of SIGINT; its stacks:\n{errors}"
            ) from None
    assert exporter.returncode == 0, errors


@async_test
async def test_a_live_limit_with_a_field_that_is_no_limit_is_counted_named_and_shown(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """A live limit written by hand with a negative rate and a fractional burst: the workers
    ignore both (their own 10/s applies), count each request that met it, and say so once for
    the domain; ``get`` shows it as invalid and names it."""
    caplog.set_level(logging.WARNING, logger="scrapy_redis_throttle")
    with redis_server.client() as client:
        client.set(bucket_key("redis_throttle", A), b"0 -5 2.5 0")
    crawler = await run_crawl(
        crawl_settings(redis_server.url), pages(site, A, 4), redis_throttle_rates={A: "10/s"}
    )
    stats = crawler.stats.get_stats()
    assert stats["redis_throttle/rejected/live_limit"] >= 4
    warnings = [r.getMessage() for r in caplog.records if "limit set live" in r.getMessage()]
    assert warnings == [
        f"Redis throttle: ignored a limit set live with a field that is no limit "
        f"(scrapy-redis-throttle get names it) from '{A}': that field is ignored, the workers' "
        f"own limit applies for it (logged once per domain, counted in "
        f"redis_throttle/rejected/live_limit)"
    ]
    assert_paced([a.time for a in site.arrivals(A)], 10, 1, A)
    done = tool("--redis-url", redis_server.url, "get", A, "--json")
    [row] = json.loads(done.stdout)["domains"]
    assert (row["set"], row["limit"]) == ("invalid live", None)
    assert f"'{A}' live limit: -5.0 is not positive" in done.stderr
