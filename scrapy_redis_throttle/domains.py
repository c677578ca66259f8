"""Which domain (budget) each request is under: its ``redis_throttle_key``, else the project's
own ``download_slot``, else what its scope (:mod:`.scopes`) gives its URL's host."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, NoReturn

from scrapy import Request
from scrapy.utils.httpobj import urlparse_cached

from .config import STATS_PREFIX
from .errors import InvalidThrottleDomain, InvalidThrottleMeta
from .rates import normalize_domain
from .scopes import REGISTRABLE_DOMAIN, Scope, parse_meta_scope, registrable_domain

if TYPE_CHECKING:
    from scrapy.statscollectors import StatsCollector

# The project's own meta["download_slot"] as the request first came (None: none). Scrapy's
# downloader sets one too (the host name, or its address with CONCURRENT_REQUESTS_PER_IP),
# which a retry or a redirect carries on: that one is not the project's.
OWN_SLOT_META = "_redis_throttle_own_slot"


class Domains:
    """A bad value fails its request only, counted: :class:`.InvalidThrottleMeta` for a meta
    value, :class:`.InvalidThrottleDomain` for what the scope's function did."""

    def __init__(self, scope: Scope, stats: StatsCollector) -> None:
        self._scope = scope
        self._stats = stats

    def of(self, request: Request) -> str:
        """The domain of *request* ("" for data: and file: URLs: not throttled)."""
        meta = request.meta
        key = meta.get("redis_throttle_key")
        if key is not None:
            if not (isinstance(key, str) and key):
                self._bad_meta(
                    request, f"redis_throttle_key must be a non-empty string, got {_show(key)}"
                )
            return self._meta_named(request, key)
        scope = self._scope
        if "redis_throttle_scope" in meta:
            try:
                scope = parse_meta_scope(meta["redis_throttle_scope"])
            except ValueError as error:
                self._bad_meta(request, str(error))
        own_slot = meta.setdefault(OWN_SLOT_META, meta.get("download_slot"))
        if own_slot is not None and scope.function is None:
            if not (isinstance(own_slot, str) and own_slot):
                self._bad_meta(
                    request, f"download_slot must be a non-empty string, got {_show(own_slot)}"
                )
            return self._meta_named(request, own_slot)
        host = urlparse_cached(request).hostname
        if not host:
            return ""
        return self._scoped(request, scope, host)

    def of_robots_txt(self, url: str) -> str:
        """The domain a robots.txt at *url* sets the Crawl-delay of: its host's, by the
        configured scope (whatever the meta of the request that fetched it)."""
        request = Request(url)
        return self._scoped(request, self._scope, urlparse_cached(request).hostname or "")

    def _scoped(self, request: Request, scope: Scope, host: str) -> str:
        if scope.function is None:
            named = registrable_domain(host) if scope.name == REGISTRABLE_DOMAIN else host
            return self._meta_named(request, named)
        try:
            domain = scope.function(request)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException as error:  # the project's function: that request fails
            self._bad_domain(request, f"{scope} failed: {_show(error)}")
        if not (isinstance(domain, str) and domain):
            self._bad_domain(request, f"{scope} gave {_show(domain)}, not a domain")
        normalized = _normalized(domain)
        if not normalized:
            self._bad_domain(request, f"{scope} gave {_show(domain)}, no name IDNA takes")
        return normalized

    def _meta_named(self, request: Request, name: str) -> str:
        """*name*, a meta value or a host name, as a domain."""
        normalized = _normalized(name)
        if not normalized:
            self._bad_meta(request, f"throttle key {_show(name)} is no name IDNA takes")
        return normalized

    def _bad_meta(self, request: Request, message: str) -> NoReturn:
        self._stats.inc_value(f"{STATS_PREFIX}/invalid_meta")
        raise InvalidThrottleMeta(f"{message} ({request})")

    def _bad_domain(self, request: Request, message: str) -> NoReturn:
        self._stats.inc_value(f"{STATS_PREFIX}/invalid_domains")
        raise InvalidThrottleDomain(f"REDIS_THROTTLE_SCOPE: {message} ({request})")


def _show(value: object) -> str:
    """*value* for a message: its repr, at most 200 characters (a repr that fails: its type)."""
    try:
        return f"{value!r:.200}"
    except Exception:
        return f"<{type(value).__name__}>"


def _normalized(name: str) -> str:
    """*name* as :func:`.normalize_domain` gives it ("" for a name IDNA refuses)."""
    try:
        return normalize_domain(name)
    except ValueError:
        return ""
