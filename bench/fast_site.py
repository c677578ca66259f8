"""A fast HTTP/1.1 server for the crawl benchmarks: it must never be what limits a crawl.

Serves the same small page for every GET, with keep-alive, on one port of several loopback
addresses (each a "domain" for Scrapy and the throttle), from an asyncio protocol with no
framework in the way. Run it as its own process: ``python fast_site.py --hosts 127.0.0.2 ...``
prints ``READY <port>``, then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import socket

BODY = b"<html><body>" + b"<p>A page of the benchmark site.</p>" * 25 + b"</body></html>"
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)


class PageProtocol(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.pending = b""

    def data_received(self, data: bytes) -> None:
        # Requests are GETs without a body: one response per header block.
        self.pending += data
        *requests, self.pending = self.pending.split(b"\r\n\r\n")
        if requests:
            self.transport.write(RESPONSE * len(requests))


async def serve(hosts: list[str]) -> None:
    probe = socket.socket()
    probe.bind((hosts[0], 0))
    port = probe.getsockname()[1]
    probe.close()
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(PageProtocol, host, port) for host in hosts]
    print(f"READY {port}", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", nargs="+", required=True)
    asyncio.run(serve(parser.parse_args().hosts))


if __name__ == "__main__":
    main()
