"""Which domain (budget) each request is under: its ``redis_throttle_key``, else the project's
own ``download_slot``, else what its scope (:mod:`.scopes`) gives its URL's host (or its
proxy); and the budgets of its other scopes."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING, NoReturn

from scrapy import Request
from scrapy.resolver import dnscache
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.reactor import is_reactor_installed
from twisted.internet.defer import Deferred

from .errors import InvalidThrottleDomain, InvalidThrottleMeta
from .rates import normalize_domain
from .scopes import (
    IP,
    PROXY,
    REGISTRABLE_DOMAIN,
    Scope,
    parse_meta_scope,
    proxy_name,
    registrable_domain,
    shown,
)
from .stats import STATS_PREFIX

if TYPE_CHECKING:
    from scrapy.statscollectors import StatsCollector

# [URL, the project's own meta["download_slot"] (None: none)] as the throttle first saw a
# request of that URL. Scrapy's downloader sets a download_slot too (the host name, or its
# address with CONCURRENT_REQUESTS_PER_IP), which a retry, a redirect, or a request made with a
# copy of the meta carries on: that one is not the project's.
OWN_SLOT_META = "_redis_throttle_own_slot"


class Domains:
    """A bad value fails its request only, counted: :class:`.InvalidThrottleMeta` for a meta
    value, :class:`.InvalidThrottleDomain` for what the scope's function did."""

    def __init__(
        self,
        scope: Scope,
        stats: StatsCollector,
        dns_timeout: float,
        other_scopes: tuple[Scope, ...] = (),
    ) -> None:
        self._scope = scope
        self._other_scopes = other_scopes
        self._stats = stats
        self._addresses = ServerAddresses(dns_timeout)

    def close(self) -> None:
        self._addresses.close()

    async def of(self, request: Request) -> str:
        """The domain of *request* ("" for data: and file: URLs: not throttled)."""
        meta = request.meta
        key = meta.get("redis_throttle_key")
        if key is not None:
            if not (isinstance(key, str) and key):
                self.bad_meta(
                    request, f"redis_throttle_key must be a non-empty string, got {shown(key)}"
                )
            return self._meta_named(request, key)
        scope = self._scope
        if "redis_throttle_scope" in meta:
            try:
                scope = parse_meta_scope(meta["redis_throttle_scope"])
            except ValueError as error:
                self.bad_meta(request, str(error))
        own_slot = _own_slot(request)
        if own_slot is not None and scope.function is None:
            if not (isinstance(own_slot, str) and own_slot):
                self.bad_meta(
                    request, f"download_slot must be a non-empty string, got {shown(own_slot)}"
                )
            return self._meta_named(request, own_slot)
        host = urlparse_cached(request).hostname
        if not host:
            return ""
        # A request that goes direct is under its host (by the proxy scope).
        return await self._named(request, scope, host) or self._meta_named(request, host)

    async def others(self, request: Request, domain: str) -> list[tuple[str, Scope]]:
        """The budgets of *request*'s other scopes (see :mod:`.scopes`), each with its scope:
        those that name one (the proxy scope names none for a request that goes direct), and
        that *domain* or another one before it is not already."""
        if not self._other_scopes:
            return []
        host = urlparse_cached(request).hostname
        if not host:
            return []
        names, budgets = {domain}, []
        for scope in self._other_scopes:
            name = await self._named(request, scope, host)
            if name and name not in names:
                names.add(name)
                budgets.append((name, scope))
        return budgets

    async def _named(self, request: Request, scope: Scope, host: str) -> str:
        """The budget *scope* puts *request* (to *host*) under ("": none, a direct request's
        proxy)."""
        if scope.name == IP:
            return self._meta_named(request, await self._addresses.of(host))
        if scope.name == PROXY:
            try:
                return proxy_name(request.meta.get("proxy")) or ""
            except ValueError as error:
                self.bad_meta(request, str(error))
        return self._scoped(request, scope, host)

    def of_robots_txt(self, url: str) -> str:
        """The domain a robots.txt at *url* sets the Crawl-delay of: its host's, by the
        configured scope (whatever the meta of the request that fetched it; under the "ip"
        scope, the address it was fetched from, as Scrapy's DNS cache has it)."""
        request = Request(url)
        return self._scoped(request, self._scope, urlparse_cached(request).hostname or "")

    def _scoped(self, request: Request, scope: Scope, host: str) -> str:
        if scope.function is None:
            if scope.name == REGISTRABLE_DOMAIN:
                named = registrable_domain(host)
            elif scope.name == IP:
                named = self._addresses.cached(host) or host
            else:  # a host's; under the proxy scope, a robots.txt's site's
                named = host
            return self._meta_named(request, named)
        try:
            domain = scope.function(request)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException as error:  # the project's function: that request fails
            self._bad_domain(request, f"{scope} failed: {shown(error)}")
        if not (isinstance(domain, str) and domain):
            self._bad_domain(request, f"{scope} gave {shown(domain)}, not a domain")
        normalized = _normalized(domain)
        if not normalized:
            self._bad_domain(request, f"{scope} gave {shown(domain)}, no name IDNA takes")
        return normalized

    def _meta_named(self, request: Request, name: str) -> str:
        """*name*, a meta value or a host name, as a domain."""
        normalized = _normalized(name)
        if not normalized:
            self.bad_meta(request, f"throttle key {shown(name)} is no name IDNA takes")
        return normalized

    def bad_meta(self, request: Request, message: str) -> NoReturn:
        """Fail *request* for an invalid meta value (counted)."""
        self._stats.inc_value(f"{STATS_PREFIX}/invalid_meta")
        raise InvalidThrottleMeta(f"{message} ({request})")

    def _bad_domain(self, request: Request, message: str) -> NoReturn:
        self._stats.inc_value(f"{STATS_PREFIX}/invalid_domains")
        raise InvalidThrottleDomain(f"REDIS_THROTTLE_SCOPE: {message} ({request})")


def _normalized(name: str) -> str:
    """*name* as :func:`.normalize_domain` gives it ("" for a name IDNA refuses)."""
    try:
        return normalize_domain(name)
    except ValueError:
        return ""


def _own_slot(request: Request) -> object:
    """The project's own download_slot of *request* (None: none; see OWN_SLOT_META)."""
    meta = request.meta
    seen = meta.get(OWN_SLOT_META)
    if isinstance(seen, list) and len(seen) == 2:
        redirected_from = meta.get("redirect_urls") or [None]
        if seen[0] == request.url:
            return seen[1]
        if seen[0] == redirected_from[-1]:  # a redirect of the request seen
            meta[OWN_SLOT_META] = [request.url, seen[1]]
            return seen[1]
    own = meta.get("download_slot")
    meta[OWN_SLOT_META] = [request.url, own]
    return own


class ServerAddresses:
    """The server address of each host, as Scrapy's resolver finds it: from its DNS cache, else
    one lookup through the reactor's resolver (``TWISTED_DNS_RESOLVER``), shared by the requests
    that wait for it, which fills that cache for the download (no second lookup, with Scrapy's
    caching resolvers and DNSCACHE_ENABLED). A host that does not resolve within *timeout*
    seconds is its own domain (its download fails too)."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._lookups: dict[str, asyncio.Future[str | None]] = {}

    def close(self) -> None:
        for lookup in list(self._lookups.values()):
            lookup.cancel()

    def cached(self, host: str) -> str | None:
        """*host*'s address if it is one, or Scrapy's DNS cache holds it (else None)."""
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            pass
        found = dnscache.get(host)
        if isinstance(found, (list, tuple)):  # CachingHostnameResolver: IAddress objects
            found = getattr(found[0], "host", None) if found else None
        return found if isinstance(found, str) and found else None

    async def of(self, host: str) -> str:
        """*host*'s address; *host* itself when it does not resolve (its download fails too)."""
        address = self.cached(host)
        if address is not None:
            return address
        lookup = self._lookups.get(host)
        if lookup is None:
            lookup = self._lookups[host] = asyncio.ensure_future(_resolve(host))
            lookup.add_done_callback(lambda _: self._lookups.pop(host, None))
        # Not wait_for: the lookup goes on for the other requests that wait for it.
        await asyncio.wait([lookup], timeout=self._timeout)
        if not lookup.done() or lookup.cancelled():
            return host
        return lookup.result() or host


class _Receiver:
    """Twisted's IResolutionReceiver: the addresses of one name, then the end."""

    def __init__(self) -> None:
        self.addresses: list[object] = []
        self.done: Deferred[None] = Deferred()

    def resolutionBegan(self, resolution: object) -> None:
        pass

    def addressResolved(self, address: object) -> None:
        self.addresses.append(address)

    def resolutionComplete(self) -> None:
        if not self.done.called:  # once, whatever the resolver does
            self.done.callback(None)


async def _resolve(host: str) -> str | None:
    """The first address the reactor's resolver finds for *host*, or the event loop's without a
    reactor (None: none, or it failed)."""
    if not is_reactor_installed():
        try:
            found: object = (await asyncio.get_running_loop().getaddrinfo(host, None))[0][4][0]
        except (OSError, IndexError, UnicodeError):  # an unresolvable name: its download fails
            return None
        return found if isinstance(found, str) and found else None
    from twisted.internet import reactor

    receiver = _Receiver()
    try:
        reactor.nameResolver.resolveHostName(receiver, host)
        await maybe_deferred_to_future(receiver.done)
    except Exception:  # an unresolvable name: its download fails and says why
        return None
    found = next((getattr(a, "host", None) for a in receiver.addresses), None)
    return found if isinstance(found, str) and found else None
