"""The demo site the pacing tests measure with: when a request reached it."""

from __future__ import annotations

import socket
import sys
import time

import pytest
from demo_site import HOSTS, DemoSite


@pytest.mark.skipif(sys.platform != "linux", reason="kernel receive stamps are Linux's")
def test_an_arrival_is_when_the_request_reached_the_site_not_when_its_thread_ran() -> None:
    """A site whose threads run late (a busy machine) still records when each request came
    in: pacing is judged by when requests reached the site."""
    late = 0.5  # how late the site's threads run: the delay this test is about
    site = DemoSite(HOSTS[:1], pages=1)  # listening, its threads not started
    try:
        with socket.create_connection((HOSTS[0], site.port), timeout=10) as client:
            sent = time.monotonic()
            client.sendall(f"GET /page/0 HTTP/1.1\r\nHost: {HOSTS[0]}\r\n\r\n".encode())
            time.sleep(late)
            site.start()
            # Its answer: the arrival is recorded by then.
            assert client.recv(4096).startswith(b"HTTP/1.1 200 "), "the page was not served"
    finally:
        site.stop()
    (arrival,) = site.arrivals()
    assert arrival.path == "/page/0"
    assert arrival.time - sent < late / 2, f"recorded {arrival.time - sent:.3f} s after it came"
