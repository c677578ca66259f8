"""Settings and spider attribute parsing, without a crawler."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fakes import with_addon
from scrapy.exceptions import NotConfigured
from scrapy.settings import Settings

from scrapy_redis_throttle.config import Adaptive, Backoff, ThrottleConfig, needs_extra
from scrapy_redis_throttle.connection import ClusterClient, connect
from scrapy_redis_throttle.errors import ThrottleConfigError
from scrapy_redis_throttle.live_limits import LiveLimit
from scrapy_redis_throttle.rates import (
    FIXED_WINDOW,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    Limit,
    Quota,
    format_rate,
    parse_limit,
    parse_rate,
)
from scrapy_redis_throttle.redis_settings import (
    DEFAULT_REDIS_PARAMS,
    queue_redis_connection,
    redact_url,
)


def config(spider_rates: object = None, **settings: Any) -> ThrottleConfig:
    return ThrottleConfig.from_settings(Settings(settings), spider_rates=spider_rates)


@pytest.mark.parametrize(
    ("text", "per_second"),
    [
        ("5/s", 5.0),
        ("5 / s", 5.0),
        ("100/m", 100 / 60),
        ("100/min", 100 / 60),
        ("1000/h", 1000 / 3600),
        ("1/10s", 0.1),
        ("3/M", 3 / 60),
        ("2/d", 2 / 86400),
        ("1/1.5s", 1 / 1.5),
        ("2.5/second", 2.5),
        (7, 7.0),
        ("7", 7.0),
        (" 0.5 ", 0.5),
        (0.25, 0.25),
    ],
)
def test_rate_strings(text: object, per_second: float) -> None:
    assert parse_rate(text, source="X") == pytest.approx(per_second)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("5 per second", r"X: invalid rate '5 per second'; expected e.g. '5/s'"),
        ("5/fortnight", "unknown time unit 'fortnight'"),
        ("0/s", "rate must be positive and finite, got '0/s'"),
        ("1/0s", "the period is zero"),
        ("-1/s", "invalid rate '-1/s'"),
        (0, "rate must be positive and finite, got 0"),
        (-3, "rate must be positive and finite, got -3"),
        (float("nan"), "rate must be positive and finite, got nan"),
        (float("inf"), "rate must be positive and finite, got inf"),
        (True, "invalid rate True"),
        ([5], r"invalid rate \[5\]"),
    ],
)
def test_invalid_rates(value: object, message: str) -> None:
    with pytest.raises(ThrottleConfigError, match=message):
        parse_rate(value, source="X")


def test_defaults() -> None:
    cfg = config()
    assert cfg.limits.lookup("anything.example") == Limit(1.0, 1, "1/s")
    assert cfg.redis_url == "redis://localhost:6379/0"
    assert cfg.redis_params == DEFAULT_REDIS_PARAMS
    assert cfg.key_prefix == "redis_throttle"
    assert (cfg.on_redis_error, cfg.fallback_workers, cfg.probe_interval) == ("local", None, 0.5)
    assert (cfg.crawl_delay, cfg.max_crawl_delay) == (True, 30.0)
    assert cfg.penalty_codes == {429, 503}
    assert cfg.backoff == Backoff(first=2.0, longest=600.0, decay=60.0)
    assert cfg.adaptive is None
    assert cfg.gc_freeze is True


@pytest.mark.parametrize(
    ("rate", "text"), [(5, "5/s"), (2.5, "2.5/s"), (1, "1/s"), (0.5, "1/2s"), (1 / 60, "1/60s")]
)
def test_rates_in_logs(rate: float, text: str) -> None:
    assert format_rate(rate) == text


def test_adaptive_rate_defaults_and_settings() -> None:
    assert config(REDIS_THROTTLE_ADAPTIVE_ENABLED=True).adaptive == Adaptive(
        min_rate=1 / 60, decrease=0.5, recovery=600.0
    )
    assert config(
        REDIS_THROTTLE_ADAPTIVE_ENABLED="true",
        REDIS_THROTTLE_ADAPTIVE_MIN_RATE="1/10s",
        REDIS_THROTTLE_ADAPTIVE_DECREASE="0.7",
        REDIS_THROTTLE_ADAPTIVE_RECOVERY="120",
    ).adaptive == Adaptive(min_rate=0.1, decrease=0.7, recovery=120.0)


def test_parking_uses_scrapy_redis_own_connection() -> None:
    """RedisThrottleScheduler parks beside scrapy-redis's queue, with scrapy-redis's settings,
    even when the throttle's buckets live in another Redis."""
    settings = Settings(
        {
            "REDIS_URL": "redis://queue:6379/2",
            "REDIS_THROTTLE_URL": "redis://throttle:6379/0",
            "REDIS_PARAMS": {"password": "p", "redis_cls": "redis.Redis", "socket_timeout": 9},
        }
    )
    url, params = queue_redis_connection(settings)
    assert url == "redis://queue:6379/2"
    # scrapy-redis's own defaults; nothing of it that would replay a command or decode bytes.
    assert params == {"password": "p", "socket_timeout": 9, "socket_connect_timeout": 30}


def test_disabled() -> None:
    with pytest.raises(NotConfigured):
        config(REDIS_THROTTLE_ENABLED=False)


def test_spider_attribute_and_setting_merge_with_precedence() -> None:
    cfg = config(
        spider_rates={
            "shop.example": "5/s",
            "api.example": {"rate": "100/m", "burst": 10},
            "*.cdn.example": "20/s",
            "free.example": None,
        },
        REDIS_THROTTLE_RATES={"shop.example": "1/s", "other.example": "3/m"},
        REDIS_THROTTLE_DEFAULT_RATE="2/s",
        REDIS_THROTTLE_DEFAULT_BURST=3,
    )
    lookup = cfg.limits.lookup
    assert lookup("shop.example") == Limit(5, 3, "5/s"), "the spider attribute wins"
    assert lookup("SHOP.example") == Limit(5, 3, "5/s"), "host names are case-insensitive"
    assert lookup("other.example") == Limit(0.05, 3, "3/m"), "setting entries are kept"
    assert lookup("api.example") == Limit(100 / 60, 10, "100/m")
    assert lookup("img.cdn.example") == Limit(20, 3, "20/s")
    assert lookup("a.b.cdn.example") == Limit(20, 3, "20/s")
    assert lookup("cdn.example") == Limit(2, 3, "2/s"), "a wildcard does not match its base"
    assert lookup("free.example") is None
    assert lookup("unknown.example") == Limit(2, 3, "2/s")


def test_exact_beats_wildcard_and_longest_wildcard_wins() -> None:
    cfg = config(
        spider_rates={
            "*.example": "1/s",
            "*.cdn.example": "2/s",
            "img.cdn.example": "3/s",
        }
    )
    assert cfg.limits.lookup("img.cdn.example").rate == 3  # type: ignore[union-attr]
    assert cfg.limits.lookup("js.cdn.example").rate == 2  # type: ignore[union-attr]
    assert cfg.limits.lookup("www.example").rate == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("unlimited", [None, "unlimited", "Unlimited "])
def test_unlisted_domains_can_be_left_unthrottled(unlimited: object) -> None:
    cfg = config(spider_rates={"shop.example": "1/s"}, REDIS_THROTTLE_DEFAULT_RATE=unlimited)
    assert cfg.limits.lookup("other.example") is None
    assert cfg.limits.lookup("shop.example") is not None


def test_settings_from_the_command_line_are_strings() -> None:
    cfg = config(
        REDIS_THROTTLE_RATES='{"shop.example": {"rate": "2/s", "burst": 4}}',
        REDIS_THROTTLE_DEFAULT_RATE="3",
        REDIS_THROTTLE_DEFAULT_BURST="2",
        REDIS_THROTTLE_PENALTY_HTTP_CODES="429,503,520",
        REDIS_THROTTLE_CRAWL_DELAY_ENABLED="false",
        REDIS_THROTTLE_GC_FREEZE="0",
    )
    assert cfg.limits.lookup("shop.example") == Limit(2, 4, "2/s")
    assert str(cfg.limits.lookup("other.example")) == "3/s (burst 2)"
    assert cfg.penalty_codes == {429, 503, 520}
    assert cfg.crawl_delay is False
    assert cfg.gc_freeze is False


def test_several_limits_and_windows() -> None:
    cfg = config(
        spider_rates={
            "api.example": ["5/s", {"rate": "1000/h", "algorithm": "sliding_window"}, "100/m"],
            "search.example": {"rate": "10/2s", "algorithm": "fixed_window"},
            "log.example": [{"rate": "30/m", "algorithm": "sliding_window"}, "2/s"],
        },
        REDIS_THROTTLE_DEFAULT_BURST=2,
    )
    api = cfg.limits.lookup("api.example")
    assert api == Limit(
        5,
        2,
        "5/s",
        (Quota(SLIDING_WINDOW, 1000, 3600, "1000/h"), Quota(TOKEN_BUCKET, 100, 0.6, "100/m")),
    ), "a token bucket after the first item: its burst is its count"
    assert str(api) == "5/s (burst 2) and 1000/h (sliding window) and 100/m (burst 100)"
    assert api.sustained_rate == 1000 / 3600, "the hourly quota, in the long run"
    assert api.max_cost == 2
    # Windows only: the bucket they imply (2N for a fixed window), shown as them.
    search = cfg.limits.lookup("search.example")
    assert search == Limit(5, 20, "10/2s", (Quota(FIXED_WINDOW, 10, 2, "10/2s"),))
    assert str(search) == "10/2s (fixed window)"
    assert search.max_cost == 10
    # The first token bucket is the domain's own, wherever it is in the list.
    log = cfg.limits.lookup("log.example")
    assert log == Limit(2, 2, "2/s", (Quota(SLIDING_WINDOW, 30, 60, "30/m"),))
    assert log.sustained_rate == 0.5
    assert [quota.script_text for quota in (*api.quotas, *log.quotas)] == [
        "s1000/3600000000",
        "t100/600000",
        "s30/60000000",
    ]
    # A window's period goes to the script in whole µs (4.1 s is 4099999.9999999995 µs).
    odd = parse_limit({"rate": "10/4.1s", "algorithm": "fixed_window"}, default_burst=1, source="")
    assert odd is not None
    assert [quota.script_text for quota in odd.quotas] == ["f10/4100000"]


def test_sentinels() -> None:
    cfg = config(
        REDIS_THROTTLE_SENTINELS="10.0.0.1:26379, sentinel-2:26380",  # as from -s
        REDIS_THROTTLE_SENTINEL_SERVICE="throttle",
        REDIS_THROTTLE_SENTINEL_PARAMS={"password": "s3cret"},
        REDIS_THROTTLE_URL="redis://:p@ignored:6379/2",
    )
    assert cfg.sentinel is not None
    assert cfg.sentinel.addresses == (("10.0.0.1", 26379), ("sentinel-2", 26380))
    assert cfg.sentinel.params == {**DEFAULT_REDIS_PARAMS, "password": "s3cret"}
    assert cfg.redis_location == (
        "the primary of 'throttle' (Redis Sentinel at 10.0.0.1:26379, sentinel-2:26380)"
    )
    assert config().sentinel is None


def test_cluster_nodes() -> None:
    cfg = config(
        REDIS_THROTTLE_CLUSTER_NODES="10.0.0.1:6379, node-2:7000",  # as from -s
        REDIS_THROTTLE_URL="rediss://worker:p@ignored:6379/0",
    )
    assert cfg.cluster is not None
    assert cfg.cluster.addresses == (("10.0.0.1", 6379), ("node-2", 7000))
    assert cfg.redis_location == "Redis Cluster (seed nodes 10.0.0.1:6379, node-2:7000)"
    assert config().cluster is None
    # No database in the URL (0, a cluster's only one) will do as well.
    without_db = config(REDIS_THROTTLE_CLUSTER_NODES="a:1", REDIS_THROTTLE_URL="redis://u:p@h")
    client = connect(without_db)
    assert isinstance(client, ClusterClient)
    assert client.get_connection_kwargs()["username"] == "u"


def test_describe_lists_effective_limits() -> None:
    cfg = config(spider_rates={"a.example": "5/s", "*.b.example": None})
    assert cfg.limits.describe() == [
        "a.example: 5/s (burst 1)",
        "*.b.example: unlimited",
        "other domains: 1/s (burst 1)",
    ]


ADAPTIVE = {"REDIS_THROTTLE_ADAPTIVE_ENABLED": True}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"REDIS_THROTTLE_DEFAULT_RATE": "fast"}, "REDIS_THROTTLE_DEFAULT_RATE: invalid rate 'fast'"),
        ({"REDIS_THROTTLE_DEFAULT_RATE": 0}, "REDIS_THROTTLE_DEFAULT_RATE: rate must be positive"),
        ({"REDIS_THROTTLE_DEFAULT_BURST": 0}, "REDIS_THROTTLE_DEFAULT_BURST: burst must be an integer >= 1, got 0"),
        ({"REDIS_THROTTLE_DEFAULT_BURST": 1.5}, "burst must be an integer >= 1, got 1.5"),
        ({"REDIS_THROTTLE_RATES": "not json"}, "REDIS_THROTTLE_RATES must be a dict, got 'not json'"),
        ({"REDIS_THROTTLE_RATES": {"a.example": "x"}}, r"REDIS_THROTTLE_RATES\['a.example'\]: invalid rate 'x'"),
        ({"REDIS_THROTTLE_RATES": {"a.example": {"rate": "1/s", "brust": 2}}}, r"unknown key\(s\) \['brust'\]"),
        ({"REDIS_THROTTLE_RATES": {"a.example": {"burst": 2}}}, "has no 'rate'"),
        ({"REDIS_THROTTLE_RATES": {"a.example": {"rate": "1/s", "burst": 0}}}, "burst must be an integer >= 1, got 0"),
        ({"REDIS_THROTTLE_RATES": {"a.*.example": "1/s"}}, "invalid domain pattern 'a.*.example'"),
        ({"REDIS_THROTTLE_RATES": {"*": "1/s"}}, "invalid domain pattern '\\*'"),
        ({"REDIS_THROTTLE_RATES": {"": "1/s"}}, "invalid domain pattern ''"),
        ({"REDIS_THROTTLE_RATES": {"http://a.example/": "1/s"}}, "invalid domain pattern"),
        ({"REDIS_THROTTLE_KEY_PREFIX": ""}, "REDIS_THROTTLE_KEY_PREFIX must be a non-empty string"),
        ({"REDIS_THROTTLE_KEY_PREFIX": "a{b"}, "REDIS_THROTTLE_KEY_PREFIX must be a non-empty string without"),
        ({"REDIS_THROTTLE_URL": "http://localhost"}, "REDIS_THROTTLE_URL must be a redis://, rediss:// or unix:// URL, got 'http://localhost'"),
        ({"REDIS_URL": "localhost:6379"}, "REDIS_URL must be a redis://"),
        ({"REDIS_THROTTLE_PARAMS": "[1]"}, "REDIS_THROTTLE_PARAMS must be a dict"),
        ({"REDIS_THROTTLE_PARAMS": {"retry_on_timeout": True}}, "'retry_on_timeout' is set by the throttle itself \\(a replayed acquire could take its tokens twice"),
        ({"REDIS_THROTTLE_ON_REDIS_ERROR": "fail"}, "REDIS_THROTTLE_ON_REDIS_ERROR must be one of 'local', 'open', 'wait', got 'fail'"),
        ({"REDIS_THROTTLE_FALLBACK_WORKERS": 0}, "REDIS_THROTTLE_FALLBACK_WORKERS: the number of workers must be an integer >= 1, got 0"),
        ({"REDIS_THROTTLE_FALLBACK_WORKERS": "many"}, "REDIS_THROTTLE_FALLBACK_WORKERS: the number of workers must be an integer >= 1, got 'many'"),
        ({"REDIS_THROTTLE_PROBE_INTERVAL": 0}, "REDIS_THROTTLE_PROBE_INTERVAL must be a number of seconds >= 0.1, got 0"),
        ({"REDIS_THROTTLE_FALLBACK_AFTER": -1}, "REDIS_THROTTLE_FALLBACK_AFTER must be a number of seconds >= 0, got -1"),
        ({"REDIS_THROTTLE_FALLBACK_AFTER": float("inf")}, "REDIS_THROTTLE_FALLBACK_AFTER must be a number of seconds >= 0, got inf"),
        ({"REDIS_THROTTLE_PENALTY_HTTP_CODES": "soon"}, "REDIS_THROTTLE_PENALTY_HTTP_CODES must be a list of HTTP status codes \\(100-599\\), got 'soon'"),
        ({"REDIS_THROTTLE_PENALTY_HTTP_CODES": [429, 1000]}, "REDIS_THROTTLE_PENALTY_HTTP_CODES must be a list of HTTP status codes \\(100-599\\), got \\[429, 1000\\]"),
        ({"REDIS_THROTTLE_PENALTY_HTTP_CODES": 429}, "REDIS_THROTTLE_PENALTY_HTTP_CODES must be a list"),
        ({"REDIS_THROTTLE_PENALTY_BACKOFF": -1}, "REDIS_THROTTLE_PENALTY_BACKOFF must be a number of seconds >= 0.001, got -1"),
        ({"REDIS_THROTTLE_MAX_PAUSE": "long"}, "REDIS_THROTTLE_MAX_PAUSE must be a number of seconds >= 0.001, got 'long'"),
        ({"REDIS_THROTTLE_PENALTY_DECAY": 0}, "REDIS_THROTTLE_PENALTY_DECAY must be a number of seconds >= 0.001, got 0"),
        ({"REDIS_THROTTLE_MAX_CRAWL_DELAY": 0}, "REDIS_THROTTLE_MAX_CRAWL_DELAY must be a number of seconds >= 0.001, got 0"),
        ({"REDIS_THROTTLE_CRAWL_DELAY_ENABLED": "maybe"}, "REDIS_THROTTLE_CRAWL_DELAY_ENABLED must be True or False \\(or 1, 0, 'true', 'false'\\), got 'maybe'"),
        ({"REDIS_THROTTLE_ENABLED": "perhaps"}, "REDIS_THROTTLE_ENABLED must be True or False"),
        ({"REDIS_THROTTLE_GC_FREEZE": "never"}, "REDIS_THROTTLE_GC_FREEZE must be True or False \\(or 1, 0, 'true', 'false'\\), got 'never'"),
        ({"REDIS_THROTTLE_MAX_HOLD": float("nan")}, "REDIS_THROTTLE_MAX_HOLD must be a number of seconds >= 0, got nan"),
        ({"REDIS_THROTTLE_ADAPTIVE_ENABLED": "sometimes"}, "REDIS_THROTTLE_ADAPTIVE_ENABLED must be True or False"),
        ({**ADAPTIVE, "REDIS_THROTTLE_ADAPTIVE_DECREASE": 1}, "REDIS_THROTTLE_ADAPTIVE_DECREASE must be a number between 0 and 1 \\(both excluded\\), got 1"),
        ({**ADAPTIVE, "REDIS_THROTTLE_ADAPTIVE_DECREASE": 0}, "REDIS_THROTTLE_ADAPTIVE_DECREASE must be a number between 0 and 1 \\(both excluded\\), got 0"),
        ({**ADAPTIVE, "REDIS_THROTTLE_ADAPTIVE_DECREASE": "half"}, "REDIS_THROTTLE_ADAPTIVE_DECREASE must be a number between 0 and 1 \\(both excluded\\), got 'half'"),
        ({**ADAPTIVE, "REDIS_THROTTLE_ADAPTIVE_DECREASE": True}, "REDIS_THROTTLE_ADAPTIVE_DECREASE must be a number between 0 and 1 \\(both excluded\\), got True"),
        ({**ADAPTIVE, "REDIS_THROTTLE_ADAPTIVE_MIN_RATE": "0/s"}, "REDIS_THROTTLE_ADAPTIVE_MIN_RATE: rate must be positive and finite, got '0/s'"),
        ({**ADAPTIVE, "REDIS_THROTTLE_ADAPTIVE_RECOVERY": -5}, "REDIS_THROTTLE_ADAPTIVE_RECOVERY must be a number of seconds >= 0.001, got -5"),
        ({"REDIS_THROTTLE_MAX_RESERVE": "soon"}, "REDIS_THROTTLE_MAX_RESERVE must be a number of seconds >= 1, got 'soon'"),
        ({"REDIS_THROTTLE_REPORT_INTERVAL": -1}, "REDIS_THROTTLE_REPORT_INTERVAL must be a number of seconds >= 0, got -1"),
        ({"REDIS_THROTTLE_SENTINELS": ["127.0.0.1"]}, "REDIS_THROTTLE_SENTINELS must be a list of 'host:port', got \\['127.0.0.1'\\]"),
        ({"REDIS_THROTTLE_SENTINELS": "a:1,b:x"}, "REDIS_THROTTLE_SENTINELS must be a list of 'host:port', got 'a:1,b:x' \\('b:x'\\)"),
        ({"REDIS_THROTTLE_SENTINELS": ["a:26379"]}, "REDIS_THROTTLE_SENTINEL_SERVICE must name the primary the sentinels watch"),
        ({"REDIS_THROTTLE_CLUSTER_NODES": "a:1,b"}, "REDIS_THROTTLE_CLUSTER_NODES must be a list of 'host:port', got 'a:1,b' \\('b'\\)"),
        ({"REDIS_THROTTLE_CLUSTER_NODES": ["a:1"], "REDIS_THROTTLE_SENTINELS": ["b:2"], "REDIS_THROTTLE_SENTINEL_SERVICE": "m"}, "REDIS_THROTTLE_CLUSTER_NODES and REDIS_THROTTLE_SENTINELS are both set"),
        ({"REDIS_THROTTLE_CLUSTER_NODES": ["a:1"], "REDIS_THROTTLE_URL": "redis://:secret@h:6379/2"}, "REDIS_THROTTLE_CLUSTER_NODES: a cluster has database 0 alone, but the URL is 'redis://:\\*\\*\\*@h:6379/2'"),
        ({"REDIS_THROTTLE_CLUSTER_NODES": ["a:1"], "REDIS_THROTTLE_URL": "unix:///run/redis.sock"}, "REDIS_THROTTLE_CLUSTER_NODES: a cluster is reached over TCP"),
        ({"REDIS_THROTTLE_CLUSTER_NODES": ["a:1"], "REDIS_THROTTLE_PARAMS": {"socket_type": 0}}, "REDIS_THROTTLE_CLUSTER_NODES: redis-py's cluster client does not take the connection parameter\\(s\\) \\['socket_type'\\]"),
        ({"REDIS_THROTTLE_SENTINEL_SERVICE": "mymaster"}, "REDIS_THROTTLE_SENTINEL_SERVICE is 'mymaster' but REDIS_THROTTLE_SENTINELS lists no sentinel"),
        ({"REDIS_THROTTLE_SENTINELS": ["a:26379"], "REDIS_THROTTLE_SENTINEL_SERVICE": "m", "REDIS_THROTTLE_SENTINEL_PARAMS": {"pasword": "x"}}, "REDIS_THROTTLE_SENTINEL_PARAMS: unknown redis-py connection parameter\\(s\\) \\['pasword'\\]"),
        ({"REDIS_THROTTLE_RATES": {"a.example": []}}, r"REDIS_THROTTLE_RATES\['a.example'\]: an empty list of limits"),
        ({"REDIS_THROTTLE_RATES": {"a.example": ["1/s", "x"]}}, r"REDIS_THROTTLE_RATES\['a.example'\]\[1\]: invalid rate 'x'"),
        ({"REDIS_THROTTLE_RATES": {"a.example": {"rate": "1/s", "algorithm": "leaky"}}}, "unknown algorithm 'leaky'; expected one of 'token_bucket', 'fixed_window', 'sliding_window'"),
        ({"REDIS_THROTTLE_RATES": {"a.example": {"rate": "2.5/s", "algorithm": "sliding_window"}}}, "a sliding_window counts whole requests: expected e.g. '10/2s', got '2.5/s'"),
        ({"REDIS_THROTTLE_RATES": {"a.example": {"rate": "5/s", "algorithm": "fixed_window", "burst": 2}}}, "a fixed_window has no burst"),
        ({"REDIS_THROTTLE_METRICS_PORT": 70000}, "REDIS_THROTTLE_METRICS_PORT must be a port \\(0-65535; 0: any free one\\) or a range \\[low, high\\] of them, got 70000"),
        ({"REDIS_THROTTLE_METRICS_PORT": [9420, 9410]}, "REDIS_THROTTLE_METRICS_PORT must be a port .* got \\[9420, 9410\\]"),
        ({"REDIS_THROTTLE_METRICS_PORT": [9410, 9411, 9412]}, "REDIS_THROTTLE_METRICS_PORT must be a port"),
        ({"REDIS_THROTTLE_METRICS_PORT": True}, "REDIS_THROTTLE_METRICS_PORT must be a port .* got True"),
        ({"REDIS_THROTTLE_METRICS_PORT": "94x0"}, "REDIS_THROTTLE_METRICS_PORT must be a port .* got '94x0'"),
        ({"REDIS_THROTTLE_METRICS_PORT": 9410.5}, "REDIS_THROTTLE_METRICS_PORT must be a port .* got 9410.5"),
        ({"REDIS_THROTTLE_METRICS_HOST": ""}, "REDIS_THROTTLE_METRICS_HOST must be a host name or address, got ''"),
        ({"REDIS_THROTTLE_METRICS_HOST": 127}, "REDIS_THROTTLE_METRICS_HOST must be a host name or address, got 127"),
        ({"REDIS_THROTTLE_METRICS_MAX_DOMAINS": 0}, "REDIS_THROTTLE_METRICS_MAX_DOMAINS: the number of domains must be an integer >= 1, got 0"),
        ({"REDIS_THROTTLE_METRICS_OTEL": "yes please"}, "REDIS_THROTTLE_METRICS_OTEL must be True or False"),
    ],
)  # fmt: skip
def test_invalid_settings_name_the_setting_and_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ThrottleConfigError, match=message):
        config(**kwargs)


@pytest.mark.parametrize(
    ("spider_rates", "message"),
    [
        (["shop.example"], "spider attribute redis_throttle_rates must be a dict"),
        ({"shop.example": "5/x"}, r"spider attribute redis_throttle_rates\['shop.example'\]: invalid rate"),
        ({3: "1/s"}, "invalid domain pattern 3"),
    ],
)  # fmt: skip
def test_invalid_spider_attribute(spider_rates: object, message: str) -> None:
    with pytest.raises(ThrottleConfigError, match=message):
        config(spider_rates=spider_rates)


def test_redis_connection_follows_scrapy_redis_settings() -> None:
    cfg = config(
        REDIS_URL="redis://shared:6379/2",
        REDIS_PARAMS={"socket_timeout": 30, "redis_cls": "redis.StrictRedis", "password": "p"},
    )
    assert cfg.redis_url == "redis://shared:6379/2"
    # scrapy-redis's 30 s timeouts would let a stalled Redis freeze every request for 30 s.
    assert cfg.redis_params == {**DEFAULT_REDIS_PARAMS, "password": "p"}

    cfg = config(
        REDIS_URL="redis://shared:6379/2",
        REDIS_THROTTLE_URL="rediss://throttle:6380/1",
        REDIS_PARAMS={"socket_timeout": 30},
        REDIS_THROTTLE_PARAMS={"socket_timeout": 1, "ssl_cert_reqs": "none"},
    )
    assert cfg.redis_url == "rediss://throttle:6380/1"
    assert cfg.redis_params["socket_timeout"] == 1
    assert cfg.redis_params["ssl_cert_reqs"] == "none"

    assert config(REDIS_HOST="h", REDIS_PORT=7000, REDIS_DB=3).redis_url == "redis://h:7000/3"
    # scrapy-redis also takes the connection from REDIS_PARAMS; what it skips, we skip.
    cfg = config(REDIS_PARAMS={"url": "redis://p:1/4", "retry": None, "max_connections": 3})
    assert cfg.redis_url == "redis://p:1/4"
    assert cfg.redis_params == DEFAULT_REDIS_PARAMS
    cfg = config(REDIS_PARAMS={"host": "h", "port": 7001, "db": 5})
    assert cfg.redis_url == "redis://h:7001/5"
    assert cfg.redis_params == DEFAULT_REDIS_PARAMS


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"REDIS_THROTTLE_PARAMS": {"socket_timout": 1}}, "REDIS_THROTTLE_PARAMS: unknown redis-py connection parameter 'socket_timout'"),
        ({"REDIS_PARAMS": {"socket_timout": 1}}, "REDIS_PARAMS: unknown redis-py connection parameter 'socket_timout'"),
        ({"REDIS_THROTTLE_PARAMS": {"max_connections": 5}}, "'max_connections' is set by the throttle itself \\(each script has one connection, pipelined\\)"),
        ({"REDIS_THROTTLE_PARAMS": {"retry": None}}, "'retry' is set by the throttle itself"),
        ({"REDIS_THROTTLE_PARAMS": {"host": "h"}}, "unknown redis-py connection parameter 'host' \\(host, port and db go in the URL\\)"),
    ],
)  # fmt: skip
def test_invalid_redis_params(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ThrottleConfigError, match=message):
        config(**kwargs)


def test_config_is_frozen() -> None:
    cfg = config()
    with pytest.raises(AttributeError):
        cfg.key_prefix = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:secret@host:6379/0", "rediss://user:***@host:6379/0"),
        # An unencoded "#" or "?" ends the netloc for URL parsers: the password would show.
        ("redis://:se#cr?et@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:p@ss@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://host:6379/0?password=secret&db=1", "redis://host:6379/0?password=***&db=1"),
        ("unix:///run/redis.sock?db=0&Password=secret", "unix:///run/redis.sock?db=0&Password=***"),
        ("redis://user@host:6379/0", "redis://user@host:6379/0"),
        # redis-py drops tabs and line ends, decodes the query's names, splits it at "&" only.
        ("redis:/\t/:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://host/0?%70assword=secret", "redis://host/0?%70assword=***"),
        ("redis://host/0?pass%77ord=secret&db=1", "redis://host/0?pass%77ord=***&db=1"),
        ("redis://host/0?password=sec;ret", "redis://host/0?password=***"),
    ],
)
def test_passwords_are_not_logged(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url", ["http://:secret@host", "http://host/?password=secret", "://:se#cret@host"]
)
def test_a_bad_url_is_named_without_its_password(url: str) -> None:
    with pytest.raises(ThrottleConfigError, match="REDIS_URL must be a redis://") as error:
        config(REDIS_URL=url)
    assert "secret" not in str(error.value)
    assert "cret" not in str(error.value)


@pytest.mark.parametrize("name", ["REDIS_PARAMS", "REDIS_THROTTLE_PARAMS"])
def test_bad_connection_parameters_are_named_without_their_value(name: str) -> None:
    """Not JSON (a trailing comma): the value, which may hold a password, is not shown."""
    with pytest.raises(ThrottleConfigError, match=f"{name} must be a dict, got a str") as error:
        config(**{name: '{"password": "secret", }'})
    assert "secret" not in str(error.value)


def test_a_domains_limits_are_bounded() -> None:
    """As lua/token_bucket.lua keeps its work per call bounded."""
    with pytest.raises(ThrottleConfigError, match="17 limits; a domain has at most 16"):
        parse_limit(["1/s"] * 17, default_burst=1, source="RATES['a']")
    with pytest.raises(ThrottleConfigError, match="at most 10,000 per window, got '10001/h'"):
        parse_limit({"rate": "10001/h", "algorithm": "sliding_window"}, default_burst=1, source="x")
    assert parse_limit(["1/s"] * 16, default_burst=1, source="x") is not None
    assert parse_limit(
        {"rate": "10001/h", "algorithm": "fixed_window"}, default_burst=1, source="x"
    )


def test_a_bad_scrapy_redis_url_fails_only_the_parking_area_that_needs_it() -> None:
    """The throttle has its own Redis: scrapy-redis's REDIS_URL, needed only by the parking area
    beside scrapy-redis's queue, does not stop the crawl; attaching the parking area fails, with
    the setting named (and the throttle goes on without it: see engine_hooks.attach_parking)."""
    config = ThrottleConfig.from_settings(
        Settings({"REDIS_THROTTLE_URL": "redis://localhost:6379/0", "REDIS_URL": "localhost:6379"})
    )
    assert config.redis_url == "redis://localhost:6379/0"
    assert isinstance(config.crawl.queue_redis, ThrottleConfigError)
    assert "REDIS_URL" in str(config.crawl.queue_redis)
    config = ThrottleConfig.from_settings(Settings({"REDIS_URL": "redis://example:6380/2"}))
    assert config.crawl.queue_redis[0] == "redis://example:6380/2"  # type: ignore[index]


@pytest.mark.parametrize(
    ("port", "ports"),
    [(None, None), (9410, (9410, 9410)), ("9410", (9410, 9410)), (0, (0, 0)), ([9410, 9419], (9410, 9419)), ("9410,9419", (9410, 9419))],
)  # fmt: skip
def test_the_metrics_port_is_a_port_or_a_range(port: object, ports: object) -> None:
    metrics = config(REDIS_THROTTLE_METRICS_PORT=port).metrics
    assert metrics.ports == ports
    assert metrics.on == (ports is not None)
    assert (metrics.host, metrics.max_domains, metrics.otel) == ("127.0.0.1", 100, False)


def test_a_setting_that_needs_a_missing_extra_says_what_to_install() -> None:
    with pytest.raises(
        ThrottleConfigError,
        match=r"^REDIS_THROTTLE_METRICS_PORT needs not_installed_here: install the 'metrics' "
        r"extra \(from a checkout of scrapy-redis-throttle: "
        r"pip install './scrapy-redis-throttle\[metrics\]'\)$",
    ):
        needs_extra("REDIS_THROTTLE_METRICS_PORT", "not_installed_here.client", "metrics")


def test_the_addon_gives_the_paced_requests_a_download_slot_without_delay() -> None:
    settings = with_addon(
        DOWNLOAD_DELAY=1,
        CONCURRENT_REQUESTS=24,
        CONCURRENT_REQUESTS_PER_DOMAIN=1,
        DOWNLOAD_SLOTS={"slow.example": {"delay": 5}},
    )
    assert settings.getdict("DOWNLOAD_SLOTS") == {
        "slow.example": {"delay": 5},
        "redis_throttle": {"delay": 0.0, "concurrency": 24},
    }
    assert ThrottleConfig.from_settings(settings).download_slot == "redis_throttle"
    # The project's own settings stay as they are, for the domains the throttle does not pace.
    assert (settings["DOWNLOAD_DELAY"], settings["CONCURRENT_REQUESTS_PER_DOMAIN"]) == (1, 1)


def test_a_project_keeps_both_layers_or_names_its_own_slot() -> None:
    both = with_addon(REDIS_THROTTLE_DOWNLOAD_SLOT=None)
    assert both.getdict("DOWNLOAD_SLOTS") == {}
    assert ThrottleConfig.from_settings(both).download_slot is None
    own = with_addon(
        REDIS_THROTTLE_DOWNLOAD_SLOT="mine", DOWNLOAD_SLOTS={"mine": {"concurrency": 4}}
    )
    assert own.getdict("DOWNLOAD_SLOTS") == {"mine": {"concurrency": 4}}
    assert ThrottleConfig.from_settings(own).download_slot == "mine"
    assert config().download_slot is None, "the middleware line alone: Scrapy's slots"


@pytest.mark.parametrize(
    ("slot", "message"),
    [
        ("mine", "REDIS_THROTTLE_DOWNLOAD_SLOT 'mine' names no entry of DOWNLOAD_SLOTS: give it one \\(the add-on does, without delay\\)"),
        ("", "REDIS_THROTTLE_DOWNLOAD_SLOT must be the name of a download slot, or None, got ''"),
        (3, "REDIS_THROTTLE_DOWNLOAD_SLOT must be the name of a download slot, or None, got 3"),
    ],
)  # fmt: skip
def test_a_download_slot_without_its_entry_is_refused(slot: object, message: str) -> None:
    with pytest.raises(ThrottleConfigError, match=message):
        config(REDIS_THROTTLE_DOWNLOAD_SLOT=slot)


@pytest.mark.parametrize(
    ("live", "code", "applied"),
    [
        ("5 - 0", "1/s", (5.0, 1)),  # the live rate, the code's burst
        ("- 3 0", "2/s", (2.0, 3)),  # the code's rate, the live burst
        ("- 3 0", None, None),  # a rate no one here knows
        ("4 2 1", None, (4.0, 2)),  # paused: the limit stays as set
    ],
)
def test_a_live_limit_applies_its_fields_over_the_workers_own(
    live: str, code: str | None, applied: tuple[float, int] | None
) -> None:
    """As lua/token_bucket.lua merges them, for `status`."""
    parsed = LiveLimit.parse(live)
    assert parsed is not None
    own = None if code is None else parse_limit(code, default_burst=1, source="test")
    limit = parsed.over(own)
    assert (None if limit is None else (limit.rate, limit.burst)) == applied


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("REDIS_THROTTLE_RATE", "did you mean REDIS_THROTTLE_RATES?"),
        ("REDIS_THROTTLE_MAX_HOLDS", "did you mean REDIS_THROTTLE_MAX_HOLD?"),
        ("REDIS_THROTTLE_XYZZY", "is no setting of scrapy-redis-throttle (every setting"),
    ],
)
def test_a_name_that_is_no_setting_is_refused_with_the_closest(name: str, message: str) -> None:
    with pytest.raises(
        ThrottleConfigError,
        match=re.escape(f"{name} {message}" if "mean" not in message else message),
    ):
        ThrottleConfig.from_settings(Settings({name: "5/s"}))


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            "127.0.0.2:8000",
            "'127.0.0.2:8000' has a port, but the workers keep a site's limit under its host alone ('127.0.0.2')",
        ),
        ("http://shop.example", "invalid domain pattern 'http://shop.example'"),
        ("shop.example/catalog", "invalid domain pattern 'shop.example/catalog'"),
    ],
)
def test_a_limit_key_with_a_port_a_scheme_or_a_path_is_refused(key: str, message: str) -> None:
    """The workers keep a site's limit under its host name alone: such a key would never apply."""
    with pytest.raises(
        ThrottleConfigError, match=re.escape(f"spider attribute redis_throttle_rates[{key!r}]: ")
    ) as refused:
        ThrottleConfig.from_settings(Settings(), spider_rates={key: "5/s"})
    assert message in str(refused.value)


def test_a_proxy_s_host_and_port_is_a_key_where_the_scopes_count_proxies() -> None:
    config = ThrottleConfig.from_settings(
        Settings({"REDIS_THROTTLE_SCOPE": ["host", "proxy"]}),
        spider_rates={"proxy.example:8080": "5/s"},
    )
    limit = config.limits.lookup("proxy.example:8080")
    assert limit is not None
    assert limit.rate == 5
