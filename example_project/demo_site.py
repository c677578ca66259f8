"""A small real website served under several loopback host names, logging every arrival.

Each host (127.0.0.2, 127.0.0.3, ...) serves the same port; Scrapy keys its download slots, and the
throttle its buckets, by host name, so each host is a separate "domain". Pages link to other pages
of the same host, so a link-following spider finds all of them from ``/``.

Run it alone with ``python demo_site.py --hosts 127.0.0.2 127.0.0.3 --pages 50``; it prints
``READY <port>`` and logs one JSON line per arrival to ``--log``. Tests use :class:`DemoSite`.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any

# The demo's "domains": Linux routes all of 127.0.0.0/8 to the loopback interface.
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
# Linux's socket option (asm-generic/socket.h; Python's socket module lacks the name): the kernel
# stamps each packet received with the time it came in.
SO_TIMESTAMPNS = 35
# On Linux, when a request reached the site is read off its packet's stamp, not off the clock
# when the server's thread got to it: under load that thread runs late (up to ~0.1 s seen on two
# busy cores), and requests sent apart look bunched, or the reverse.
KERNEL_STAMPS = sys.platform == "linux"

# The demo's fourth domain answers 429 to more than OVERLOAD[0] requests a second, with
# Retry-After: OVERLOAD[1] seconds.
OVERLOADED_HOST = "127.0.0.5"
OVERLOAD = (3, 2)


@dataclass(frozen=True)
class Arrival:
    time: float
    """time.monotonic() when the request's first packet arrived (comparable within one
    process)."""
    wall_time: float
    """time.time() then."""
    host: str
    path: str
    status: int


# Ten links a page: the frontier outgrows what any one worker holds within seconds, so every
# worker of a fleet finds work, as on a real site.
LINK_STEPS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)


def page_links(index: int, pages: int) -> list[int]:
    """Pages that page *index* links to; every page is reachable from /."""
    return sorted({(index + step) % pages for step in LINK_STEPS} - {index})


class _Handler(BaseHTTPRequestHandler):
    server: _HostServer
    protocol_version = "HTTP/1.1"

    def handle_one_request(self) -> None:
        self.arrived = _arrival_time(self.connection)
        super().handle_one_request()

    def do_GET(self) -> None:
        arrived = self.arrived
        robots = self.server.site.robots.get(self.server.host)
        error = self.server.site.next_error(self.server.host, self.path, arrived[0])
        stall = self.server.site.next_stall(self.server.host, self.path)
        headers: Mapping[str, str] = {}
        if error is not None:
            (status, headers), body, content_type = error, "<html>try later</html>", "text/html"
        elif self.path == "/robots.txt" and robots is not None:
            status, body, content_type = 200, robots, "text/plain"
        else:
            status, body = self._page()
            content_type = "text/html"
        self.server.site.record(
            Arrival(arrived[0], arrived[1], self.server.host, self.path, status)
        )
        data = body.encode()
        if stall and self.server.site.stalling(stall):
            return  # the site is stopping: no answer
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", f"{content_type}; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a stalled answer came too late for it)

    def _page(self) -> tuple[int, str]:
        pages = self.server.site.pages[self.server.host]
        if self.path == "/":
            links = [0] if pages else []
        elif (
            self.path.startswith("/page/")
            and self.path[6:].isdigit()
            and (int(self.path[6:]) < pages)
        ):
            links = page_links(int(self.path[6:]), pages)
        else:
            return 404, "<html><body>not found</body></html>"
        anchors = "".join(f'<a href="/page/{n}">page {n}</a> ' for n in links)
        return 200, f"<html><body><h1>{self.server.host}{self.path}</h1>{anchors}</body></html>"

    def log_message(self, format: str, *args: Any) -> None:
        """Arrivals are recorded, not printed."""


def _arrival_time(connection: socket.socket) -> tuple[float, float]:
    """(monotonic, wall) time when the next request on *connection* arrived: its first
    packet's kernel stamp, waiting for it (as reading the request would); now, where the kernel
    stamps nothing (another system, or the client closed)."""
    if KERNEL_STAMPS:
        try:
            _, ancillary, _, _ = connection.recvmsg(1, socket.CMSG_SPACE(16), socket.MSG_PEEK)
        except OSError:
            ancillary = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
                seconds, nanoseconds = struct.unpack("qq", data[:16])
                wall = seconds + nanoseconds / 1e9
                return time.monotonic() - (time.time() - wall), wall
    return time.monotonic(), time.time()


class _HostServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's backlog of 5 drops the connections of a fleet that starts at once: their
    # SYNs are retried a second later, and those requests arrive a second late.
    request_queue_size = 128

    def __init__(self, site: DemoSite, host: str, port: int) -> None:
        self.site = site
        self.host = host
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        if KERNEL_STAMPS:
            # Inherited by every connection accepted.
            self.socket.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        super().server_bind()


class DemoSite:
    """Serve linked pages on each of *hosts*, all on one port (0 picks a free one).

    *pages* is the number of pages of every host, or a dict giving each host's. *robots* gives
    the robots.txt of some hosts (the others answer 404, which Scrapy takes as "allow all").
    *errors* gives, for some ``(host, path)``, the ``(status, headers)`` answers to the first
    requests for it, in turn (e.g. a 429 with ``Retry-After``); later requests get the page. The
    path ``"*"`` stands for any of the host's (those of its own path come first).
    *overload* gives, for some hosts, ``(requests, retry_after)``: a request that comes after
    that many in the last second gets a 429 with ``Retry-After: retry_after``; for the host
    ``"*"``, after that many to any of the hosts (a server that limits them together, as one
    registrable domain's; a host may have its own limit too). *stalls* gives,
    for some ``(host, path)``, the seconds the first request for it waits for its answer (a
    download timeout for a client that waits less).
    """

    def __init__(
        self,
        hosts: list[str],
        port: int = 0,
        pages: int | Mapping[str, int] = 20,
        log: IO[str] | None = None,
        robots: Mapping[str, str] | None = None,
        errors: Mapping[tuple[str, str], Sequence[tuple[int, Mapping[str, str]]]] | None = None,
        overload: Mapping[str, tuple[int, int]] | None = None,
        stalls: Mapping[tuple[str, str], float] | None = None,
    ) -> None:
        self._overload = dict(overload or {})
        self._stalls = dict(stalls or {})
        self._stopping = threading.Event()
        self.hosts = hosts
        self.robots = dict(robots or {})
        self._errors = {where: list(answers) for where, answers in (errors or {}).items()}
        self.pages = dict(pages) if isinstance(pages, Mapping) else dict.fromkeys(hosts, pages)
        self._log = log
        self._lock = threading.Lock()
        self._arrivals: list[Arrival] = []
        self._servers = self._bind(port)
        self.port: int = self._servers[0].server_address[1]
        self._threads = [
            threading.Thread(target=server.serve_forever, name=f"demo-site-{server.host}")
            for server in self._servers
        ]

    def _bind(self, port: int, attempts: int = 20) -> list[_HostServer]:
        # A port free on the first host may be taken on another: try again with a new one.
        for _ in range(attempts):
            servers: list[_HostServer] = []
            try:
                for host in self.hosts:
                    chosen = servers[0].server_address[1] if servers else port
                    servers.append(_HostServer(self, host, chosen))
                return servers
            except OSError:
                for server in servers:
                    server.server_close()
                if port:
                    raise
        raise OSError(f"no port free on all of {self.hosts} after {attempts} attempts")

    def start(self) -> DemoSite:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> DemoSite:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def paths(self, host: str) -> set[str]:
        """Every path of *host* that answers 200."""
        return {"/"} | {f"/page/{n}" for n in range(self.pages[host])}

    def url(self, host: str, path: str = "/") -> str:
        return f"http://{host}:{self.port}{path}"

    def next_error(
        self, host: str, path: str, arrived: float
    ) -> tuple[int, Mapping[str, str]] | None:
        """The error answer due for a request that *arrived*, if any (see *errors* and
        *overload*)."""
        with self._lock:
            answers = self._errors.get((host, path)) or self._errors.get((host, "*"))
            if answers:
                return answers.pop(0)
            for counted in (host, "*"):
                if counted not in self._overload:
                    continue
                most, retry_after = self._overload[counted]
                recent = sum(
                    counted in ("*", a.host) and a.time > arrived - 1 for a in self._arrivals
                )
                if recent >= most:
                    return 429, {"Retry-After": str(retry_after)}
            return None

    def add_errors(
        self, where: tuple[str, str], answers: Sequence[tuple[int, Mapping[str, str]]]
    ) -> None:
        """Answer the next requests for *where* (host, path) with *answers* (see *errors*)."""
        with self._lock:
            self._errors.setdefault(where, []).extend(answers)

    def next_stall(self, host: str, path: str) -> float:
        """Seconds the answer to this request waits (0: none; see *stalls*)."""
        with self._lock:
            return self._stalls.pop((host, path), 0.0)

    def stalling(self, seconds: float) -> bool:
        """Wait *seconds* (a stalled answer); True when the site stops meanwhile."""
        return self._stopping.wait(seconds)

    def record(self, arrival: Arrival) -> None:
        with self._lock:
            self._arrivals.append(arrival)
            if self._log is not None:
                self._log.write(json.dumps(asdict(arrival)) + "\n")
                self._log.flush()

    def arrivals(self, host: str | None = None) -> list[Arrival]:
        with self._lock:
            return [a for a in self._arrivals if host is None or a.host == host]


def loopback_hosts_available(hosts: list[str]) -> bool:
    """Whether this machine routes all of *hosts* (Linux routes all of 127.0.0.0/8; macOS does
    not without aliases)."""
    for host in hosts:
        with socket.socket() as sock:
            try:
                sock.bind((host, 0))
            except OSError:
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", nargs="+", default=HOSTS)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--pages", type=int, default=20)
    parser.add_argument("--log", type=argparse.FileType("a"), default=None)
    args = parser.parse_args()
    site = DemoSite(args.hosts, args.port, args.pages, args.log).start()
    print(f"READY {site.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        site.stop()


if __name__ == "__main__":
    main()
