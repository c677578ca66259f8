"""The settings that say which Redis the throttle uses and how it connects to it: its URL (or
scrapy-redis's), client parameters, Redis Sentinel and Redis Cluster; and scrapy-redis's own
Redis, where the parking area lives beside its queue."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus, urlsplit

from redis.connection import parse_url

from .errors import ThrottleConfigError
from .setting_values import get_addresses, get_dict, get_value

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scrapy.settings import BaseSettings

# Short timeouts: a stalled Redis must cost a request one second, not scrapy-redis's 30 s.
# Only REDIS_THROTTLE_PARAMS may change them, not the REDIS_PARAMS made for scrapy-redis.
DEFAULT_REDIS_PARAMS: Mapping[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
# Client parameters the throttle chooses itself, with the reason.
_NO_REPLAY = "a replayed acquire could take its tokens twice; see REDIS_THROTTLE_ON_REDIS_ERROR"
_SET_BY_THE_THROTTLE = {
    "max_connections": "each script has one connection, pipelined",
    "retry": _NO_REPLAY,
    "retry_on_timeout": _NO_REPLAY,
    "retry_on_error": _NO_REPLAY,
}
_PART_OF_THE_URL = frozenset({"url", "host", "port", "db", "path"})
# What scrapy-redis's REDIS_PARAMS may hold for its own client, which the throttle does not use.
_NOT_SHARED_WITH_SCRAPY_REDIS = frozenset(
    {"redis_cls", *_SET_BY_THE_THROTTLE, *_PART_OF_THE_URL, *DEFAULT_REDIS_PARAMS}
)


@dataclass(frozen=True)
class Sentinel:
    """Redis Sentinel: the sentinels to ask for the current primary of *service*."""

    addresses: tuple[tuple[str, int], ...]
    service: str
    params: Mapping[str, Any]
    """Connection parameters for the sentinels themselves (a password, TLS, ...)."""

    def __str__(self) -> str:
        where = ", ".join(f"{host}:{port}" for host, port in self.addresses)
        return f"the primary of {self.service!r} (Redis Sentinel at {where})"


@dataclass(frozen=True)
class Cluster:
    """Redis Cluster: nodes to discover it from (any one that answers will do)."""

    addresses: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        where = ", ".join(f"{host}:{port}" for host, port in self.addresses)
        return f"Redis Cluster (seed nodes {where})"


def redact_url(url: str) -> str:
    """*url* with its password replaced, for logs and errors: the one after the user name (up
    to the last ``@``, which a password with an unencoded ``#`` or ``?`` hides from URL
    parsers) and a ``password=`` in the query (its name maybe percent-encoded). Where redis-py
    would still read a password that shows, only the scheme is shown."""
    # redis-py drops these wherever they are.
    url = url.translate(_DROPPED)
    shown = url
    scheme, separator, rest = url.partition("://")
    userinfo, at, location = rest.rpartition("@")
    if separator and at and ":" in userinfo:
        shown = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{location}"
    base, question, query = shown.partition("?")
    if question:
        shown = f"{base}?" + "&".join(
            f"{pair.partition('=')[0]}=***" if _is_password(pair) else pair
            for pair in query.split("&")
        )
    try:
        password = parse_url(url).get("password")  # type: ignore[no-untyped-call]
    except Exception:  # not a URL redis-py reads: no password it would use
        password = None
    return f"{scheme}://***" if password and str(password) in shown else shown


_DROPPED = str.maketrans("", "", "\t\r\n")


def _is_password(pair: str) -> bool:
    return unquote_plus(pair.partition("=")[0]).strip().lower() == "password"


def read_redis_url(settings: BaseSettings, own_setting: str | None = "REDIS_THROTTLE_URL") -> str:
    """The Redis scrapy-redis uses: *own_setting*, else REDIS_URL, else REDIS_PARAMS' url, else
    REDIS_HOST/PORT/DB (or REDIS_PARAMS' host/port/db), as scrapy-redis reads them."""
    shared_params = get_dict(settings, "REDIS_PARAMS")
    candidates = [
        ("REDIS_URL", settings.get("REDIS_URL")),
        ("REDIS_PARAMS['url']", shared_params.get("url")),
    ]
    if own_setting:
        candidates.insert(0, (own_setting, settings.get(own_setting)))
    for name, url in candidates:
        if url:
            if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "unix"):
                shown = redact_url(url) if isinstance(url, str) else type(url).__name__
                raise ThrottleConfigError(
                    f"{name} must be a redis://, rediss:// or unix:// URL, got {shown!r}"
                )
            return url
    host = settings.get("REDIS_HOST") or shared_params.get("host") or "localhost"
    port = settings.get("REDIS_PORT") or shared_params.get("port") or 6379
    db = settings.get("REDIS_DB") or shared_params.get("db") or 0
    return f"redis://{host}:{port}/{db}"


def queue_redis_location(settings: BaseSettings) -> str:
    """scrapy-redis's own Redis, as the logs name it (its password hidden)."""
    try:
        return redact_url(read_redis_url(settings, own_setting=None))
    except ThrottleConfigError as exc:
        return f"(unreadable: {exc})"


def queue_redis_connection(settings: BaseSettings) -> tuple[str, dict[str, Any]]:
    """URL and asyncio client parameters of scrapy-redis's own Redis (its queue), read as
    ``scrapy_redis.connection.get_redis_from_settings`` reads them: with scrapy-redis's
    scheduler, the parking area lives there, with the queue (see :mod:`.parking`)."""
    from scrapy_redis import defaults

    params = {**defaults.REDIS_PARAMS, **get_dict(settings, "REDIS_PARAMS")}
    allowed = _connection_parameters() - {"encoding", "decode_responses"}  # members are bytes
    return read_redis_url(settings, own_setting=None), {
        key: value for key, value in params.items() if key in allowed
    }


@functools.cache
def _connection_parameters() -> frozenset[str]:
    """Every keyword argument the throttle's redis.asyncio connections accept."""
    from redis.asyncio import connection

    names: set[str] = set()
    for cls in (connection.AbstractConnection, connection.Connection, connection.SSLConnection):
        names.update(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "kwargs", *_SET_BY_THE_THROTTLE, *_PART_OF_THE_URL})


def read_sentinel(settings: BaseSettings) -> Sentinel | None:
    """REDIS_THROTTLE_SENTINELS ("host:port" each), REDIS_THROTTLE_SENTINEL_SERVICE and
    REDIS_THROTTLE_SENTINEL_PARAMS; None without sentinels."""
    name = "REDIS_THROTTLE_SENTINELS"
    addresses = get_addresses(settings, name)
    service = get_value(settings, "REDIS_THROTTLE_SENTINEL_SERVICE", None)
    if not addresses:
        if service is not None:
            raise ThrottleConfigError(
                f"REDIS_THROTTLE_SENTINEL_SERVICE is {service!r} but {name} lists no sentinel"
            )
        return None
    if not isinstance(service, str) or not service:
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_SENTINEL_SERVICE must name the primary the sentinels watch "
            f"(their 'sentinel monitor <name> ...'), got {service!r}"
        )
    params = {**DEFAULT_REDIS_PARAMS, **get_dict(settings, "REDIS_THROTTLE_SENTINEL_PARAMS")}
    unknown = set(params) - _connection_parameters()
    if unknown:
        raise ThrottleConfigError(
            f"REDIS_THROTTLE_SENTINEL_PARAMS: unknown redis-py connection parameter(s) "
            f"{sorted(unknown)}"
        )
    return Sentinel(tuple(addresses), service, params)


def read_cluster(
    settings: BaseSettings,
    redis_url: str,
    redis_params: Mapping[str, Any],
    sentinel: Sentinel | None,
) -> Cluster | None:
    """REDIS_THROTTLE_CLUSTER_NODES ("host:port" each); None without them. The URL and the
    parameters must suit a cluster client."""
    name = "REDIS_THROTTLE_CLUSTER_NODES"
    addresses = get_addresses(settings, name)
    if not addresses:
        return None
    if sentinel is not None:
        raise ThrottleConfigError(
            f"{name} and REDIS_THROTTLE_SENTINELS are both set: the throttle's Redis is either "
            f"a cluster or a Sentinel-managed primary"
        )
    url = urlsplit(redis_url)
    if url.scheme == "unix":
        raise ThrottleConfigError(
            f"{name}: a cluster is reached over TCP, but the URL is {redact_url(redis_url)!r} "
            f"(REDIS_THROTTLE_URL gives the cluster's user, password and TLS)"
        )
    if url.path.strip("/") not in ("", "0"):
        raise ThrottleConfigError(
            f"{name}: a cluster has database 0 alone, but the URL is {redact_url(redis_url)!r} "
            f"(REDIS_THROTTLE_URL gives the cluster's user, password and TLS)"
        )
    unknown = set(redis_params) - _cluster_parameters()
    if unknown:
        raise ThrottleConfigError(
            f"{name}: redis-py's cluster client does not take the connection parameter(s) "
            f"{sorted(unknown)} (of REDIS_THROTTLE_PARAMS or REDIS_PARAMS)"
        )
    return Cluster(tuple(addresses))


@functools.cache
def _cluster_parameters() -> frozenset[str]:
    """Every keyword argument redis-py's asyncio cluster client accepts."""
    from redis.asyncio import RedisCluster

    return frozenset(inspect.signature(RedisCluster.__init__).parameters)


def read_redis_params(settings: BaseSettings) -> dict[str, Any]:
    """Client parameters: our defaults < scrapy-redis's REDIS_PARAMS < REDIS_THROTTLE_PARAMS.

    From REDIS_PARAMS, what only scrapy-redis's client should use (its 30 s timeouts among them)
    is left out."""
    params: dict[str, Any] = dict(DEFAULT_REDIS_PARAMS)
    allowed = _connection_parameters()
    for name in ("REDIS_PARAMS", "REDIS_THROTTLE_PARAMS"):
        own = name == "REDIS_THROTTLE_PARAMS"
        for key, value in get_dict(settings, name).items():
            if key in _SET_BY_THE_THROTTLE and own:
                raise ThrottleConfigError(
                    f"{name}: {key!r} is set by the throttle itself ({_SET_BY_THE_THROTTLE[key]})"
                )
            if not own and key in _NOT_SHARED_WITH_SCRAPY_REDIS:
                continue
            if key in allowed:
                params[key] = value
            else:
                raise ThrottleConfigError(
                    f"{name}: unknown redis-py connection parameter {key!r}"
                    + (" (host, port and db go in the URL)" if key in _PART_OF_THE_URL else "")
                )
    return params
