"""The forward proxy of the tests (forward_proxy.py) is a real proxy: it forwards plain HTTP to
origins on other loopback addresses, each request to its own host, demands its basic auth when
told to, and is gone once stopped."""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from forward_proxy import ForwardProxy
from processes import wait_until

# Other "domains" than the proxy's 127.0.0.1, on lo all the same.
ORIGIN_HOST, OTHER_ORIGIN_HOST = "127.0.0.2", "127.0.0.3"


class _Origin(ThreadingHTTPServer):
    daemon_threads = True
    # The headers of each request received, in order.
    seen: list[dict[str, str]]
    # Requests for /held are answered once this is set.
    release: threading.Event

    @property
    def host(self) -> str:
        return str(self.server_address[0])

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.server_address[1]}{path}"


class _OriginHandler(BaseHTTPRequestHandler):
    # Keeps connections alive, as the demo site does: what a proxy must not take as leave to
    # send the next request of its client's connection along the same upstream connection.
    protocol_version = "HTTP/1.1"
    server: _Origin

    def do_GET(self) -> None:
        self.server.seen.append(dict(self.headers.items()))
        if self.path == "/held":
            self.server.release.wait(timeout=10)
        body = f"{self.server.host} page {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # no access log on the test's stderr


@contextmanager
def running_origin(host: str) -> Iterator[_Origin]:
    server = _Origin((host, 0), _OriginHandler)
    server.seen = []
    server.release = threading.Event()
    # A short poll interval: shutdown() waits for the loop's next look (0.5 s by default).
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="origin", daemon=True
    )
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def origin() -> Iterator[_Origin]:
    with running_origin(ORIGIN_HOST) as server:
        yield server


@pytest.fixture
def other_origin() -> Iterator[_Origin]:
    with running_origin(OTHER_ORIGIN_HOST) as server:
        yield server


@pytest.fixture(autouse=True)
def _no_proxy_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # urllib would go straight to an origin that no_proxy lists, bypassing the proxy.
    for name in ("no_proxy", "NO_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)


def fetch(url: str, proxy_url: str) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy_url}))
    with opener.open(url, timeout=10) as response:
        return response.status, response.read()


def test_the_proxy_forwards_plain_http_to_the_origin(origin: _Origin) -> None:
    with ForwardProxy() as proxy:
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"
        assert proxy.address == f"127.0.0.1:{proxy.port}"
        status, body = fetch(origin.url("/some/path"), proxy.url)
    assert (status, body) == (200, b"127.0.0.2 page /some/path")
    (headers,) = origin.seen
    # proxy.py marks what it forwarded: the page came through the proxy, not around it.
    assert "proxy.py" in headers.get("Via", ""), headers


def test_the_proxy_with_auth_answers_407_without_credentials(origin: _Origin) -> None:
    with ForwardProxy(auth="user:secret") as proxy:
        assert proxy.url == f"http://user:secret@127.0.0.1:{proxy.port}"
        status, body = fetch(origin.url("/page"), proxy.url)
        assert (status, body) == (200, b"127.0.0.2 page /page")

        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch(origin.url("/page"), f"http://{proxy.address}")
        assert refused.value.code == 407
        with pytest.raises(urllib.error.HTTPError) as wrong:
            fetch(origin.url("/page"), f"http://user:wrong@{proxy.address}")
        assert wrong.value.code == 407
    # Only the authenticated request reached the origin, without the proxy's credentials.
    (headers,) = origin.seen
    assert "Proxy-Authorization" not in headers, headers


def test_each_request_reaches_its_own_host_over_a_kept_alive_client(
    origin: _Origin, other_origin: _Origin
) -> None:
    """A client that keeps its connection to the proxy alive (as Scrapy does) alternating
    between two hosts: each answer comes from the host asked, and tells the client to close."""
    with ForwardProxy() as proxy:
        client = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        answers, expected = [], []
        try:
            for server in (origin, other_origin, origin, other_origin):
                client.request("GET", server.url("/alternating"))
                response = client.getresponse()
                answers.append((response.status, response.read(), response.getheader("Connection")))
                expected.append((200, f"{server.host} page /alternating".encode(), "close"))
        finally:
            client.close()
    assert answers == expected
    assert (len(origin.seen), len(other_origin.seen)) == (2, 2)


def test_a_request_pipelined_behind_another_never_reaches_the_first_ones_host(
    origin: _Origin, other_origin: _Origin
) -> None:
    """A second request sent on the connection while the first is still being answered is
    dropped: proxy.py would send it to the first request's host."""
    first = f"GET {origin.url('/held')} HTTP/1.1\r\nHost: {origin.host}\r\n\r\n"
    second = f"GET {other_origin.url('/second')} HTTP/1.1\r\nHost: {other_origin.host}\r\n\r\n"
    with (
        ForwardProxy() as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock,
    ):
        sock.sendall(first.encode())
        wait_until(lambda: origin.seen, 10, "the first request at its origin")
        sock.sendall(second.encode())
        wait_until(lambda: "dropped request 2" in proxy.log(), 10, "the second request dropped")
        origin.release.set()
        answer = b""
        while chunk := sock.recv(65536):  # until the proxy closes
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert answer.endswith(b"\r\n\r\n127.0.0.2 page /held"), answer
    assert [len(origin.seen), len(other_origin.seen)] == [1, 0]


def test_a_stopped_proxy_is_gone() -> None:
    proxy = ForwardProxy().start()
    process, port = proxy.process, proxy.port
    assert process is not None
    proxy.stop()
    assert process.returncode is not None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_proxy_that_cannot_start_says_why() -> None:
    with (
        pytest.raises(RuntimeError, match="exited during startup") as failed,
        ForwardProxy(extra_args=["--no-such-option"]),
    ):
        pass
    # proxy.py's own complaint, from the tail of its output.
    assert "unrecognized arguments: --no-such-option" in str(failed.value)
