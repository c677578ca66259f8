"""Several scopes per request (#23): the request's domain's bucket and its other scopes' buckets
decide in one call of lua/token_bucket.lua, run in a real redis-server; all of them must allow
it, and a refusal takes nothing from any of them.

As in test_token_bucket.py, the bounds hold whatever the machine's load: the script moves only
with Redis's clock, and a bucket refills at most ``rate x elapsed`` between two calls.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

import pytest
import redis.asyncio
from demo_site import HOSTS, DemoSite
from forward_proxy import ForwardProxy
from local_redis import RedisServer
from loopback_names import resolving
from redis.exceptions import ResponseError
from redis_topologies import LocalCluster, Topology, throttle_settings
from scrapy import Request, signals
from scrapy.settings import Settings
from support import (
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

from scrapy_redis_throttle import ThrottleConfig, ThrottleConfigError
from scrapy_redis_throttle.bucket import TokenBucket
from scrapy_redis_throttle.control import LiveControl
from scrapy_redis_throttle.rates import Limit
from scrapy_redis_throttle.redis_schema import bucket_key
from scrapy_redis_throttle.scopes import HOST as HOST_SCOPE
from scrapy_redis_throttle.scopes import MAX_SCOPES, REGISTRABLE_DOMAIN, proxy_name
from scrapy_redis_throttle.scopes import PROXY as PROXY_SCOPE
from scrapy_redis_throttle.scripts import load_script

A = HOSTS[0]
PREFIX = "redis_throttle"
UNUSED = "http://127.0.0.1:1"  # a proxy no request reaches
SITE, HOST, PROXY = "shop.com", "img.shop.com", "proxy.example:8080"
# Three host names of one registrable domain, at the demo site's three addresses.
NAMES = dict(zip(("www.shop.com", "img.shop.com", "api.shop.com"), HOSTS, strict=True))
FAST = Limit(rate=100, burst=10, text="100/s, burst 10")
# Slow to refill: the waits asserted keep their bounds however slow the machine is between calls.
SLOW = Limit(rate=0.1, burst=1, text="1 every 10 s")


@async_test
async def test_every_scope_must_allow_a_request_and_a_refusal_takes_nothing(
    redis_server: RedisServer,
) -> None:
    client = redis.asyncio.Redis(port=redis_server.port)
    bucket = TokenBucket(client, PREFIX)
    # Slow to refill, so that the buckets hold their state however slow the machine.
    site = Limit(rate=0.1, burst=10, text="1 every 10 s, burst 10")
    host = Limit(rate=0.1, burst=1, text="1 every 10 s")
    try:
        first = await bucket.acquire(SITE, site, others=[(HOST, host, 0)])
        assert first.allowed
        site_after_first = await client.get(bucket_key(PREFIX, SITE))
        # The host's bucket is empty for 10 s: refused, though the site's has 9 tokens.
        second = await bucket.acquire(SITE, site, others=[(HOST, host, 0)])
        assert not second.allowed
        assert not second.reserved
        assert 9 < second.retry_after <= 10, second
        assert await client.get(bucket_key(PREFIX, SITE)) == site_after_first, "nothing taken"
        # Another host of the site goes: its own bucket is full.
        other_host = await bucket.acquire(SITE, site, others=[("www.shop.com", host, 0)])
        assert other_host.allowed
        # Each bucket expires once full again, the host's after its 10 s.
        ttl = await client.pttl(bucket_key(PREFIX, HOST))
        assert 0 < ttl <= 10_000, ttl
    finally:
        await client.aclose()


@async_test
async def test_a_reserved_moment_is_the_latest_any_scope_allows(
    redis_server: RedisServer,
) -> None:
    """The host's bucket puts the moment 10 s ahead: every bucket counts the request then (the
    site's next request may go 10 ms after that moment, not 10 ms from now), and the next
    request of that host takes the moment after it, in its turn."""
    client = redis.asyncio.Redis(port=redis_server.port)
    bucket = TokenBucket(client, PREFIX)
    others = [(HOST, SLOW, 0.0), (PROXY, FAST, 0.0)]
    try:
        await bucket.acquire(SITE, FAST, others=others)
        reserved = await bucket.acquire(SITE, FAST, reserve=25, others=others)
        assert reserved.reserved
        assert reserved.moment_us is not None
        assert 9 < reserved.retry_after <= 10, reserved
        for name, limit in ((SITE, FAST), (PROXY, FAST), (HOST, SLOW)):
            tat = int(await client.get(bucket_key(PREFIX, name)) or 0)
            expected = reserved.moment_us + limit.interval_us
            assert expected <= tat <= expected + 1, (name, tat - reserved.moment_us)
        after = await bucket.acquire(SITE, FAST, reserve=25, others=others)
        assert 19 < after.retry_after <= 20, after
    finally:
        await client.aclose()


@async_test
async def test_another_scope_s_live_limit_and_pause_apply(redis_server: RedisServer) -> None:
    """A limit set live for the proxy (the CLI's ``set``, ``pause``) is the proxy's wherever
    it is another scope: a pause pauses every request through it."""
    client = redis.asyncio.Redis(port=redis_server.port)
    bucket = TokenBucket(client, PREFIX)
    with redis_server.client() as sync_client:
        control = LiveControl(sync_client, PREFIX)
        try:
            control.set(PROXY, 0.1, 1)  # below the workers' 100/s
            assert (await bucket.acquire(SITE, FAST, others=[(PROXY, FAST, 0)])).allowed
            refused = await bucket.acquire(SITE, FAST, others=[(PROXY, FAST, 0)])
            assert not refused.allowed
            assert 9 < refused.retry_after <= 10, refused
            control.pause(PROXY)
            paused = await bucket.acquire("other.example", FAST, others=[(PROXY, FAST, 0)])
            assert paused.paused
            assert (await bucket.acquire("other.example", FAST)).allowed, "direct: not paused"
        finally:
            await client.aclose()


@async_test
async def test_a_key_of_another_type_in_another_scope_s_bucket_is_none(
    redis_server: RedisServer,
) -> None:
    """A hash written by hand where a proxy's bucket is: garbage, as a bad value in it would be
    (every domain through that proxy would fail else); the call writes a bucket there."""
    client = redis.asyncio.Redis(port=redis_server.port)
    bucket = TokenBucket(client, PREFIX)
    try:
        await client.hset(bucket_key(PREFIX, PROXY), "x", "y")
        assert (await bucket.acquire(SITE, FAST, others=[(PROXY, SLOW, 0)])).allowed
        assert await client.type(bucket_key(PREFIX, PROXY)) == b"string"
        assert not (await bucket.acquire("b.example", FAST, others=[(PROXY, SLOW, 0)])).allowed
    finally:
        await client.aclose()


@async_test
async def test_bad_limits_of_other_scopes_are_refused_by_name(redis_server: RedisServer) -> None:
    client = redis.asyncio.Redis(port=redis_server.port)
    bucket = TokenBucket(client, PREFIX)
    try:
        too_many = [(f"proxy-{n}.example:1", FAST, 0.0) for n in range(MAX_SCOPES)]
        with pytest.raises(ResponseError, match=f"at most {MAX_SCOPES - 1} other scopes"):
            await bucket.acquire(SITE, FAST, others=too_many)
        with pytest.raises(ResponseError, match=r"cost 2\.0 exceeds scope 2's burst 1"):
            await bucket.acquire(SITE, FAST, cost=2, others=[(HOST, SLOW, 0)])
        # The domain's four keys, then the host's bucket; ARGV: the domain's 7, then its three.
        keys = [bucket_key(PREFIX, name) for name in (SITE, "rate", "quota", "log", HOST)]
        sha = await client.script_load(load_script("token_bucket.lua"))
        domain_args = ["1e4", "10", "1", "0", "0", "0", "0"]
        # Too few arguments for the other scope's three, or a more limit cut short.
        short = (domain_args[:-1], [*domain_args, "1e6", "1"])
        for args in (*short, [*domain_args, "t", "1e6", "1", "0"]):
            with pytest.raises(ResponseError, match="1 other scopes take 7 arguments"):
                await client.evalsha(sha, len(keys), *keys, *args)
        bad = (("0", "1", "0"), ("nan", "1", "0"), ("1e6", "0", "0"), ("1e15", "1", "0"))
        for other_args in (*bad, ("1e6", "1", "-1"), ("1e6", "1", "inf"), ("1e6", "1", "1e20")):
            args = [*domain_args, *other_args]
            with pytest.raises(ResponseError, match="scope 2's interval, burst and busy_until"):
                await client.evalsha(sha, len(keys), *keys, *args)
    finally:
        await client.aclose()


@pytest.mark.parametrize("throttle_redis", ["scrapy-redis's", "Cluster"], indirect=True)
def test_a_fleet_keeps_to_a_domain_s_budget_and_each_host_s_at_once(
    redis_server: RedisServer, throttle_redis: Topology
) -> None:
    """Three worker processes crawl three hosts of shop.com, whose server allows 5/s for them
    all together and 4/s for each host (a 429 above either): with the scopes
    ["registrable_domain", "host"] and a limit for each, none is refused. Each worker's host
    has a queue of requests, which reserve their moments at the host's pace and the domain's
    with them: the domain's budget is used at least at one host's pace (see docs, "Several
    scopes at once"; 0.81 of it in this set-up when measured, 0.43 with hosts at 2/s). On a
    Redis Cluster, the buckets are on different nodes (see across_nodes.py)."""
    domain_rate, host_rate = 5, 4
    overload = {
        "*": (int(1 + domain_rate * 1.1), 1),
        **{host: (int(1 + host_rate * 1.1), 1) for host in HOSTS},
    }
    with DemoSite(HOSTS, pages=10, overload=overload) as site:
        requests = [
            {"url": f"http://{name}:{site.port}/page/{n}"} for n in range(10) for name in NAMES
        ]
        settings = crawl_settings(
            redis_server.url,
            REDIS_THROTTLE_SCOPE=[REGISTRABLE_DOMAIN, HOST_SCOPE],
            **resolving(NAMES),
            **throttle_settings(throttle_redis),
        )
        rates = {"shop.com": f"{domain_rate}/s", "*.shop.com": f"{host_rate}/s"}
        assert_spread(throttle_redis, ["shop.com", *NAMES])
        jobs = shared_jobs(settings, requests, rates)
        all_stats = finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 90)
        arrivals = site.arrivals()
    assert [a for a in arrivals if a.status != 200] == []
    assert len(arrivals) == 30, "every page of every host, once"
    went = released(all_stats, *NAMES)
    assert_paced(went, domain_rate, 1, "shop.com, as released")
    for name in NAMES:
        assert_paced(released(all_stats, name), host_rate, 1, f"{name}, as released")
    assert_never_early([a.wall_time for a in arrivals], went, "shop.com")
    missed = missed_moments(all_stats, "shop.com")
    utilisation = achieved_rate([a.time for a in arrivals], 1, missed) / domain_rate
    print(f"shop.com: utilisation {utilisation:.2f}, missed moments {missed}")
    assert utilisation >= 0.9 * host_rate / domain_rate


@pytest.mark.parametrize("throttle_redis", ["scrapy-redis's", "Cluster"], indirect=True)
def test_a_fleet_keeps_to_a_proxy_s_budget_and_each_site_s_at_once(
    redis_server: RedisServer, throttle_redis: Topology
) -> None:
    """Three worker processes crawl three sites through one real forward proxy (with
    credentials), which may send 4/s in all (the sites' server refuses more, with a 429), each
    site allowing 5/s: with the scopes ["host", "proxy"], none is refused and the proxy's
    budget, the one that binds, is used. Its credentials are in no log and no Redis key."""
    proxy_rate, site_rate, secret = 4, 5, "s3cret-of-the-proxy"
    overload = {
        "*": (int(1 + proxy_rate * 1.1), 1),
        **{host: (int(1 + site_rate * 1.1), 1) for host in HOSTS},
    }
    with (
        ForwardProxy(auth=f"fleet:{secret}") as proxy,
        DemoSite(HOSTS, pages=10, overload=overload) as site,
    ):
        address = proxy.address  # its budget's name
        requests = [
            {"url": site.url(host, f"/page/{n}"), "meta": {"proxy": proxy.url}}
            for n in range(10)
            for host in HOSTS
        ]
        settings = crawl_settings(
            redis_server.url,
            REDIS_THROTTLE_SCOPE=[HOST_SCOPE, PROXY_SCOPE],
            LOG_LEVEL="DEBUG",
            **throttle_settings(throttle_redis),
        )
        rates = {**dict.fromkeys(HOSTS, f"{site_rate}/s"), address: f"{proxy_rate}/s"}
        assert_spread(throttle_redis, [address, *HOSTS])
        jobs = shared_jobs(settings, requests, rates)
        logs: list[str] = []
        all_stats = finish_crawl_workers(start_crawl_workers(redis_server.url, jobs), 90, logs)
        arrivals = site.arrivals()
        with redis_server.client() as client, throttle_redis.client() as throttle_client:
            keys = [key.decode() for key in client.scan_iter(count=1000)]
            keys += [key.decode() for key in throttle_client.scan_iter(count=1000)]
    assert [a for a in arrivals if a.status != 200] == []
    assert len(arrivals) == 30, "every page of every site, once"
    went = released(all_stats, *HOSTS)
    assert_paced(went, proxy_rate, 1, f"proxy {address}, as released")
    for host in HOSTS:
        assert_paced(released(all_stats, host), site_rate, 1, f"{host}, as released")
    assert_never_early([a.wall_time for a in arrivals], went, address)
    missed = sum(missed_moments(all_stats, host) for host in HOSTS)
    utilisation = achieved_rate([a.time for a in arrivals], 1, missed) / proxy_rate
    print(f"proxy: utilisation {utilisation:.2f}, missed moments {missed}")
    assert utilisation >= 0.9
    waits = [line for log in logs for line in log.splitlines() if " waits " in line]
    assert waits, "the workers' debug log says why requests wait"
    assert all(f"and '{address}' ({proxy_rate}/s" in line for line in waits), waits[:3]
    assert not [line for log in logs for line in log.splitlines() if secret in line]
    assert not [key for key in keys if secret in key]


def assert_spread(topology: Topology, names: list[str]) -> None:
    """On a Redis Cluster, the buckets of *names* are on more than one primary: the requests'
    budgets are decided across nodes (see across_nodes.py)."""
    if isinstance(topology, LocalCluster):
        owners = {topology.owner(topology.slot(bucket_key(PREFIX, name))).port for name in names}
        assert len(owners) > 1, f"{names} on one primary"


def config(**settings: Any) -> ThrottleConfig:
    return ThrottleConfig.from_settings(Settings(settings))


def test_the_scope_setting_takes_a_list_the_domain_s_first() -> None:
    cfg = config(REDIS_THROTTLE_SCOPE=[REGISTRABLE_DOMAIN, HOST_SCOPE, PROXY_SCOPE])
    assert str(cfg.scope) == REGISTRABLE_DOMAIN
    assert [str(scope) for scope in cfg.other_scopes] == [HOST_SCOPE, PROXY_SCOPE]
    assert config(REDIS_THROTTLE_SCOPE=(PROXY_SCOPE,)).other_scopes == ()
    spider = ThrottleConfig.from_settings(Settings(), spider_scope=[HOST_SCOPE, PROXY_SCOPE])
    assert [str(scope) for scope in spider.other_scopes] == [PROXY_SCOPE]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "REDIS_THROTTLE_SCOPE must list 1 to 4 scopes, got 0: []"),
        ([HOST_SCOPE] * 5, "REDIS_THROTTLE_SCOPE must list 1 to 4 scopes, got 5"),
        ([HOST_SCOPE, "hosts"], "REDIS_THROTTLE_SCOPE[1] must be 'host', 'registrable_domain'"),
        ([HOST_SCOPE, PROXY_SCOPE, HOST_SCOPE], "REDIS_THROTTLE_SCOPE lists a scope twice"),
    ],
)
def test_a_bad_list_of_scopes_fails_at_start_up_naming_the_setting(
    value: object, message: str
) -> None:
    with pytest.raises(ThrottleConfigError, match="^" + re.escape(message)):
        config(REDIS_THROTTLE_SCOPE=value)


@pytest.mark.parametrize(
    ("proxy", "name"),
    [
        ("http://user:secret@Proxy.Example:8080", "proxy.example:8080"),
        ("proxy.example:3128", "proxy.example:3128"),
        ("https://proxy.example", "proxy.example:443"),
        ("http://proxy.example", "proxy.example:80"),
        ("http://[::1]:8080", "[::1]:8080"),
        ("http://bücher.example:1", "xn--bcher-kva.example:1"),
        # Read as Scrapy's HttpProxyMiddleware reads them (urllib's parser), not urlsplit.
        ("http://user:12/34@proxy.example:8080", "proxy.example:8080"),
        ("http://APIKEY/abc=@proxy.example:8010", "proxy.example:8010"),
        ("http://user:1234#5@proxy.example:8080", "proxy.example:8080"),
        (None, None),
        ("", None),
    ],
)
def test_a_proxy_s_budget_is_named_by_its_host_and_port(proxy: object, name: str | None) -> None:
    assert proxy_name(proxy) == name


@pytest.mark.parametrize(
    "proxy",
    [
        "http://user:secret@:8080",
        "http://user:secret@host:99999",
        "http://user:secret@host:0",
        "http://user:secret@ho st:80",
        "http://user:secret@host:port",
        "http://user:secret@" + "a" * 300 + ":1",
        b"http://user:secret@host:1",
        ["http://user:secret@host:1"],
    ],
)
def test_a_bad_proxy_is_refused_without_showing_it(proxy: object) -> None:
    with pytest.raises(ValueError, match="meta\\['proxy'\\]") as refused:
        proxy_name(proxy)
    assert "secret" not in str(refused.value)


@async_test
async def test_a_bad_proxy_or_cost_fails_its_request_only(
    redis_server: RedisServer, site: DemoSite, caplog: pytest.LogCaptureFixture
) -> None:
    """A request whose meta["proxy"] is no proxy URL fails, counted, saying so without its
    value (it may hold credentials); one whose cost exceeds another scope's burst fails too;
    a request that goes direct has no proxy budget. The start-up says what the scopes are."""
    caplog.set_level(logging.INFO, logger="scrapy_redis_throttle")
    bad_proxy = "http://user:secret@proxy.example:port"
    requests: list[dict[str, Any]] = [
        {"url": site.url(A, "/page/0"), "meta": {"proxy": bad_proxy}},
        {"url": site.url(A, "/page/1"), "meta": {"redis_throttle_cost": 2, "proxy": UNUSED}},
        {"url": site.url(A, "/page/2")},
    ]
    crawler = await run_crawl(
        crawl_settings(redis_server.url, REDIS_THROTTLE_SCOPE=[HOST_SCOPE, PROXY_SCOPE]),
        requests,
        redis_throttle_rates={A: {"rate": 5, "burst": 2}, "127.0.0.1:1": "5/s"},
    )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 1
    assert stats["redis_throttle/invalid_meta"] == 2
    assert crawler.spider.failure_messages == [  # type: ignore[union-attr]
        "meta['proxy'] is no proxy URL with a host (its value is not shown) "
        f"(<GET {site.url(A, '/page/0')}>)",
        "redis_throttle_cost 2 exceeds 1, the burst of 5/s (burst 1) for '127.0.0.1:1', so "
        f"the request could never go (<GET {site.url(A, '/page/1')}>)",
    ]
    assert any(
        "one budget per domain (a domain: each host; and one per proxy, REDIS_THROTTLE_SCOPE)"
        in record.getMessage()
        for record in caplog.records
    )


@async_test
async def test_requests_with_and_without_a_proxy_share_a_host_in_turn(
    redis_server: RedisServer,
) -> None:
    """Half of a host's requests go through a proxy (scopes ["host", "proxy"]), half direct:
    the host's budget binds. Each proxied request reserves its turn in the host's bucket (and
    the proxy's at that moment), as the direct ones do: none starves, and no crowd of requests
    asks again at each moment (one Redis call per request; 4.0 when they asked again at their
    moment instead)."""
    host_rate = 4
    with ForwardProxy() as proxy, DemoSite([A], pages=16) as site:
        requests: list[dict[str, Any]] = [
            {"url": site.url(A, f"/page/{n}"), "meta": {"proxy": proxy.url} if n % 2 else {}}
            for n in range(16)
        ]
        crawler = await run_crawl(
            crawl_settings(redis_server.url, REDIS_THROTTLE_SCOPE=[HOST_SCOPE, PROXY_SCOPE]),
            requests,
            redis_throttle_rates={A: f"{host_rate}/s", proxy.address: "50/s"},
        )
        arrivals = site.arrivals(A)
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 16
    assert len(arrivals) == 16
    went = released(stats, A)
    assert_paced(went, host_rate, 1, f"{A}, as released")
    missed = missed_moments(stats, A)
    utilisation = achieved_rate(went, 1, missed) / host_rate
    calls = stats["redis_throttle/redis_calls"] / 16
    print(f"{A}: utilisation {utilisation:.2f}, missed {missed}, Redis calls per request {calls}")
    assert utilisation >= 0.9
    assert calls <= 1.5 + missed


@async_test
async def test_a_parked_request_whose_proxy_changed_asks_anew(redis_server: RedisServer) -> None:
    """A request parked with its moment reserved in its host's and its proxy's buckets comes
    back through another proxy (a rotating-proxy middleware changed meta["proxy"] meanwhile):
    its moment was not reserved in that proxy's bucket, so it asks anew and waits for it."""
    with ForwardProxy() as first, ForwardProxy() as second, DemoSite([A], pages=4) as site:
        parked = site.url(A, "/page/1")
        requests = [
            {"url": site.url(A, "/page/0"), "meta": {"proxy": second.url}},
            {"url": parked, "meta": {"proxy": first.url}},
        ]
        scheduled: Counter[str] = Counter()

        def switch_proxy_on_the_way_back(request: Request, **_: Any) -> None:
            scheduled[request.url] += 1
            # Scheduled at the start, to be parked, and given back: the third time.
            if request.url == parked and scheduled[request.url] == 3:
                request.meta["proxy"] = second.url

        crawler = await run_crawl(
            crawl_settings(redis_server.url, REDIS_THROTTLE_SCOPE=[HOST_SCOPE, PROXY_SCOPE]),
            requests,
            {signals.request_scheduled: switch_proxy_on_the_way_back},
            redis_throttle_rates={A: "1/2s", first.address: "10/s", second.address: "1/4s"},
        )
    stats = crawler.stats.get_stats()
    assert stats["test/responses"] == 2
    assert scheduled[parked] >= 3, "parked, and given back"
    went = released(stats, A)
    assert len(went) == 2
    assert went[1] - went[0] >= 4 - 0.01, f"{went[1] - went[0]:.3f} s apart"
