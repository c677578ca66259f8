"""A DNS resolver for test crawls, as Scrapy's ``TWISTED_DNS_RESOLVER`` (``DNS_RESOLVER`` before
Scrapy 2.19) takes one: the names of the setting ``LOOPBACK_NAMES`` (``{name: address}``)
resolve to their loopback addresses, the others as the reactor resolves them. Host names under
real public suffixes (``a.shop.com``) reach the demo site, with no edit to /etc/hosts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from scrapy.resolver import HostResolution
from scrapy.settings import default_settings
from twisted.internet.address import IPv4Address

# Scrapy 2.19 renamed the setting.
RESOLVER_SETTING = (
    "TWISTED_DNS_RESOLVER" if hasattr(default_settings, "TWISTED_DNS_RESOLVER") else "DNS_RESOLVER"
)


@contextmanager
def name_resolver(resolver: Any) -> Iterator[None]:
    """The reactor resolves names with *resolver* meanwhile (an in-process crawl: Scrapy's
    CrawlerRunner installs no resolver of its settings)."""
    from twisted.internet import reactor

    original = reactor.nameResolver
    reactor.installNameResolver(resolver)
    try:
        yield
    finally:
        reactor.installNameResolver(original)


def resolving(names: Mapping[str, str]) -> dict[str, Any]:
    """The settings of a crawl that resolves *names* (``{name: loopback address}``)."""
    return {RESOLVER_SETTING: f"{__name__}.LoopbackNames", "LOOPBACK_NAMES": dict(names)}


class LoopbackNames:
    """Twisted's IHostnameResolver (the reactor takes any object that has its method)."""

    def __init__(self, reactor: Any, names: Mapping[str, str]) -> None:
        self._reactor = reactor
        self._original = reactor.nameResolver
        self._names = dict(names)

    @classmethod
    def from_crawler(cls, crawler: Any, reactor: Any) -> LoopbackNames:
        return cls(reactor, crawler.settings.getdict("LOOPBACK_NAMES"))

    def install_on_reactor(self) -> None:
        self._reactor.installNameResolver(self)

    def resolveHostName(  # Twisted's IHostnameResolver (zope interfaces: typed loosely)
        self,
        resolutionReceiver: Any,
        hostName: str,
        portNumber: int = 0,
        addressTypes: Any = None,
        transportSemantics: str = "TCP",
    ) -> Any:
        address = self._names.get(hostName)
        if address is None:
            return self._original.resolveHostName(
                resolutionReceiver, hostName, portNumber, addressTypes, transportSemantics
            )
        resolution = HostResolution(hostName)
        resolutionReceiver.resolutionBegan(resolution)
        resolutionReceiver.addressResolved(IPv4Address("TCP", address, portNumber))
        resolutionReceiver.resolutionComplete()
        return resolution
