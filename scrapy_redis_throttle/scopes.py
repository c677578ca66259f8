"""What a limit is kept per (its scope): each host, each registrable domain (``a.example.com``
and ``b.example.com`` share ``example.com``'s budget, as sites that limit per domain count), each
server address (the hosts one server serves share its budget), each proxy, or what a callable
of the project's says.

The scope turns a request into its *domain*, the name of its budget: the name its limit is
looked up by, its Redis bucket, its pauses, its live limit and its lines in the logs.
``REDIS_THROTTLE_SCOPE`` sets it (default ``"host"``); the meta key ``redis_throttle_scope``
sets it for one request, by name; the meta key ``redis_throttle_key`` names the domain itself.

``REDIS_THROTTLE_SCOPE`` may list several scopes: the first gives the request's domain, each
other one a budget of its own that must allow the request too, in the same atomic call (its
limit looked up by its name, as a domain's; see ``lua/token_bucket.lua``; on a Redis Cluster,
where the budgets are on several nodes, see :mod:`.across_nodes`).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.request import _parse_proxy  # type: ignore[attr-defined]  # Scrapy's own parser

from scrapy.utils.misc import load_object
from tldextract import TLDExtract

from .errors import ThrottleConfigError
from .rates import normalize_domain

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request

HOST = "host"
REGISTRABLE_DOMAIN = "registrable_domain"
IP = "ip"
PROXY = "proxy"
NAMED = (HOST, REGISTRABLE_DOMAIN, IP, PROXY)
# The most scopes a request is under (lua/token_bucket.lua takes one bucket each, in one call;
# on a Redis Cluster, across_nodes.py asks each one twice).
MAX_SCOPES = 4

# The Public Suffix List tldextract ships with itself: no download, no cache files. Its ICANN
# part only, as Crawlee's registrable domains: the hosts under a private suffix (github.io,
# herokuapp.com) are one operator's servers, which share one budget.
_EXTRACT = TLDExtract(suffix_list_urls=(), cache_dir=None, include_psl_private_domains=False)
# Hosts whose registrable domain is remembered (a dict lookup instead of a walk of the list).
CACHED_HOSTS = 10_000


@functools.lru_cache(maxsize=CACHED_HOSTS)
def registrable_domain(host: str) -> str:
    """*host*'s registrable domain (``shop.example.co.uk`` -> ``example.co.uk``), or *host*
    itself when it has none: an IP address, ``localhost``, a public suffix, a name under no
    known suffix."""
    return _EXTRACT(host).top_domain_under_public_suffix or host


@dataclass(frozen=True)
class Scope:
    """A scope: one of :data:`NAMED`, or *function*, a callable of the project's that takes a
    request and returns its domain (a non-empty string), named *name* in logs."""

    name: str
    function: Callable[[Request], object] | None = None

    @property
    def wildcards_cover_domains(self) -> bool:
        """Whether a pattern ``*.shop.com`` names the registrable domain ``shop.com`` too (for
        every domain of a crawl under this scope: one bucket, one limit)."""
        return self.name == REGISTRABLE_DOMAIN

    def __str__(self) -> str:
        return self.name


def parse_scopes(value: object, *, source: str) -> tuple[Scope, ...]:
    """The scopes of a setting: one (see :func:`parse_scope`), or a list of at most
    :data:`MAX_SCOPES` different ones, the request's domain's first."""
    if not isinstance(value, (list, tuple)):
        return (parse_scope(value, source=source),)
    if not 1 <= len(value) <= MAX_SCOPES:
        raise ThrottleConfigError(
            f"{source} must list 1 to {MAX_SCOPES} scopes, got {len(value)}: {shown(value)}"
        )
    scopes = tuple(parse_scope(item, source=f"{source}[{n}]") for n, item in enumerate(value))
    names = [scope.name for scope in scopes]
    if len(set(names)) != len(names):
        raise ThrottleConfigError(f"{source} lists a scope twice: {shown(value)}")
    return scopes


def parse_scope(value: object, *, source: str) -> Scope:
    """A scope from a setting: ``"host"``, ``"registrable_domain"``, a callable, or the import
    path of one (``"myproject.throttling.domain_of"``)."""
    if isinstance(value, str) and value in NAMED:
        return Scope(value)
    function: Any = value
    if isinstance(value, str) and "." in value:
        try:
            function = load_object(value)
        except Exception as error:  # whatever importing its module raised
            raise ThrottleConfigError(
                f"{source}: cannot import {value!r}: {type(error).__name__}: {error}"
            ) from None
    if not callable(function) or isinstance(function, type) or not _takes_one(function):
        raise ThrottleConfigError(
            f"{source} must be {HOST!r}, {REGISTRABLE_DOMAIN!r}, {IP!r}, {PROXY!r}, or a "
            f"function (or its import path) that takes a request and returns its domain (or a "
            f"list of those), got {shown(value)}"
        )
    name = value if isinstance(value, str) else getattr(function, "__qualname__", repr(function))
    return Scope(name, function)


def _takes_one(function: Callable[..., object]) -> bool:
    """Whether *function* can be called with one argument (True when Python cannot tell)."""
    try:
        inspect.signature(function).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature (some built-ins)
        return True
    return True


def parse_meta_scope(value: object) -> Scope:
    """A request's ``redis_throttle_scope``: a name only (meta may come from outside: it
    never names code to run). ValueError for another value."""
    if isinstance(value, str) and value in NAMED:
        return Scope(value)
    raise ValueError(
        f"redis_throttle_scope must be {HOST!r}, {REGISTRABLE_DOMAIN!r}, {IP!r} or {PROXY!r}, "
        f"got {shown(value)}"
    )


# The longest proxy name (a Redis key, a line in the logs): a host name's longest, and a port.
LONGEST_PROXY_NAME = 253 + 8
# A proxy's "host:port" (the port optional): a name, or an IPv6 address in brackets.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s:/?#@\[\]]+)(?::([0-9]{1,5}))?")


def proxy_name(value: object) -> str | None:
    """The budget name of a request's ``meta["proxy"]`` (None: no proxy, it goes direct): its
    proxy's host and port, without the scheme or the credentials (``proxy.example:8080``),
    parsed as Scrapy's ``HttpProxyMiddleware`` does. ValueError for a value that is no proxy
    URL; its message never shows the value (it may hold credentials)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"meta['proxy'] must be a proxy URL, got a {type(value).__name__}")
    try:
        scheme, _, _, host_port = _parse_proxy(value)
    except ValueError:  # its message shows the value
        host_port, scheme = "", None
    default_port = 443 if (scheme or "").lower() == "https" else 80
    try:
        return proxy_budget(host_port, default_port)
    except ValueError:
        raise ValueError(
            "meta['proxy'] is no proxy URL with a host (its value is not shown)"
        ) from None


def proxy_budget(host_port: str, default_port: int | None = None) -> str:
    """The budget name of a proxy at *host_port* (``Proxy.Example:8080`` ->
    ``proxy.example:8080``; the host as a domain's, see :func:`.rates.normalize_domain`), with
    *default_port* when it has none (None: it must have one). ValueError otherwise."""
    match = _HOST_PORT.fullmatch(host_port)
    if match is None or len(host_port) > LONGEST_PROXY_NAME:
        raise ValueError(f"no proxy host:port: {host_port!r:.100}")
    host, port_text = match.groups()
    port = int(port_text) if port_text else default_port
    if port is None or not 1 <= port <= 65535:
        raise ValueError(f"no proxy port in {host_port!r:.100}")
    name = host.lower() if host.startswith("[") else normalize_domain(host)
    if not name:
        raise ValueError(f"no proxy host in {host_port!r:.100}")
    return f"{name}:{port}"


def shown(value: object) -> str:
    """*value* for a message: its repr, at most 200 characters (a repr that fails: its type)."""
    try:
        return f"{value!r:.200}"
    except Exception:
        return f"<{type(value).__name__}>"
