"""A real HTTP forward proxy in an OS process of its own, for tests that crawl through a proxy.

The proxy is proxy.py (PyPI ``proxy.py``, import name ``proxy``), started as
``python -m proxy``: a separate process, so that what it does (accept, connect upstream,
answer 407) is what a real proxy does, not a stub in the test's own reactor. ::

    with ForwardProxy() as proxy:  # or ForwardProxy(auth="user:secret")
        Request("http://127.0.0.2:8080/", meta={"proxy": proxy.url})

It forwards plain HTTP (``GET http://host:port/path HTTP/1.1``) and tunnels CONNECT.
The proxy resolves host names itself, with the system's resolver: tests give it loopback
addresses (127.0.0.2, 127.0.0.3, ... all reach ``lo`` on Linux), not names of their own.
It strips ``Proxy-Authorization`` and adds a ``Via`` header before forwarding.

One request per client connection (the plugin ``OneRequestPerConnection`` below): proxy.py
2.4 sends every later request of a kept-alive client connection to the upstream of the
first, whatever its host (seen: Scrapy through one proxy, ``GET http://127.0.0.3:P/`` served
by 127.0.0.2), and without asking the auth plugin (its source). So the proxy answers every
response with ``Connection: close`` and closes. Clients that pipeline are not served: two
requests in one packet reach no origin, and the connection ends after proxy.py's inactivity
timeout (10 s); Scrapy never pipelines.

POSIX only (process groups, ``os.waitid``); the tests run on Linux.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from processes import wait_until
from proxy.http.parser import HttpParser
from proxy.http.proxy import HttpProxyBasePlugin

logger = logging.getLogger(__name__)

# Bounds, not sleeps: startup is polled every POLL_INTERVAL until it succeeds or the bound is hit.
STARTUP_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
POLL_INTERVAL = 0.02
LOG_TAIL_CHARS = 4000

# Sent to the proxy itself (not in proxy form): proxy.py answers it at once with
# "400 BAD REQUEST", contacting no upstream and logging nothing at WARNING. A reply proves an
# acceptor process is up and serving, not merely that the kernel queued the connection.
READINESS_PROBE = b"GET / HTTP/1.1\r\nHost: forward-proxy-readiness\r\nConnection: close\r\n\r\n"

# Headers about the connection they came on, which a response must not carry to the client.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection"})


class OneRequestPerConnection(HttpProxyBasePlugin):
    """A proxy.py plugin, loaded by the proxy process (``--plugins``): each client connection
    carries one plain-HTTP request. The upstream is asked to close after its response, the
    client is told ``Connection: close`` so that it does not reuse the connection, and a
    request pipelined behind the first is dropped (logged), never sent to the wrong host.
    CONNECT tunnels pass untouched."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._requests = 0
        # The response head gathered so far; None once the head has gone to the client (or
        # in a tunnel), after which chunks pass as they come.
        self._head: bytes | None = b""

    def handle_client_request(self, request: HttpParser) -> HttpParser | None:
        if request.is_https_tunnel:
            self._head = None
            return request
        self._requests += 1
        if self._requests > 1:
            logger.warning(
                "dropped request %d of one client connection (%r): one per connection",
                self._requests,
                request.method,
            )
            return None
        request.del_headers([b"Keep-Alive"])
        request.add_header(b"Connection", b"close")
        return request

    def handle_upstream_chunk(self, chunk: memoryview) -> memoryview | None:
        if self._head is None:
            return chunk
        self._head += chunk.tobytes()
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            return None  # held back until the whole head has come
        status_line, *headers = self._head[:end].split(b"\r\n")
        body = self._head[end + 4 :]
        self._head = None
        kept = [h for h in headers if h.split(b":", 1)[0].strip().lower() not in HOP_BY_HOP]
        return memoryview(b"\r\n".join([status_line, *kept, b"Connection: close", b"", body]))


class ForwardProxy:
    """A proxy.py forward proxy on *host*, on a port the kernel chose (``--port 0``).

    With *auth* (``"user:password"``) it demands that HTTP basic proxy authentication and
    answers 407 to requests without it. *log_level* is proxy.py's (its log goes to a
    temporary file, shown in the error if startup fails; read it with :meth:`log`).
    *extra_args* are appended to proxy.py's command line, e.g. ``("--timeout", "30")`` for
    an origin slower than proxy.py's default 10 s inactivity timeout.

    ``start()`` / ``stop()``, or a ``with`` block (which stops it whatever happens inside).
    ``port``, ``url`` and ``address`` are known once it has started.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        auth: str | None = None,
        *,
        log_level: str = "WARNING",
        extra_args: Sequence[str] = (),
    ) -> None:
        if auth is not None and ":" not in auth:
            raise ValueError(f"auth must be 'user:password', got {auth!r}")
        self.host = host
        self.auth = auth
        self.log_level = log_level
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._log_file: IO[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes]], ForwardProxy] | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy has not been started")
        return self._port

    @property
    def address(self) -> str:
        """``host:port``, as a proxy setting without scheme or credentials."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``http://host:port``, with ``user:password@`` when *auth* is set (as Scrapy's
        ``meta["proxy"]`` and urllib's ProxyHandler take it)."""
        credentials = f"{self.auth}@" if self.auth else ""
        return f"http://{credentials}{self.address}"

    @property
    def proxy_authorization(self) -> str:
        """The ``Proxy-Authorization`` header value that *auth* requires."""
        if self.auth is None:
            raise RuntimeError("this proxy has no auth")
        return "Basic " + base64.b64encode(self.auth.encode()).decode("ascii")

    def log(self) -> str:
        """What the proxy process has written so far (stdout and stderr, interleaved)."""
        if self._dir is None:
            return ""
        try:
            return (Path(self._dir.name) / "proxy.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self) -> ForwardProxy:
        if self.process is not None:
            raise RuntimeError(f"the proxy is already running on {self.address}")
        self._dir = tempfile.TemporaryDirectory(prefix="forward_proxy_")
        try:
            self._launch(Path(self._dir.name))
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, workdir: Path) -> None:
        port_file = workdir / "port"
        command = [
            sys.executable, "-m", "proxy",
            "--hostname", self.host,
            # The kernel picks a free port and proxy.py writes it to --port-file once it
            # listens: no window between choosing a port and binding it, unlike a port chosen
            # beforehand, so proxies in parallel test processes never collide.
            "--port", "0", "--port-file", str(port_file),
            # One acceptor process; --threaded gives each connection a plain thread in it,
            # rather than the default "threadless" event loops, whose executors and idle-work
            # cleanup (--inactive-conn-cleanup-timeout) a test proxy does not need.
            # (--num-workers only sizes the threadless executors: unused here.)
            "--num-acceptors", "1", "--threaded",
            "--plugins", f"{__name__}.{OneRequestPerConnection.__qualname__}",
            "--log-level", self.log_level,
            # proxy.py creates its data, certificate and cache directories at startup, by
            # default under ~/.proxy: keep them in our temporary directory instead.
            "--data-dir", str(workdir / "data"),
            "--cache-dir", str(workdir / "cache"),
        ]  # fmt: skip
        if self.auth is not None:
            command += ["--basic-auth", self.auth]
        command += self.extra_args
        # A file, not a pipe: nobody reads the log while the proxy runs, and a full pipe would
        # block it.
        self._log_file = (workdir / "proxy.log").open("wb")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            # For the plugin: the proxy process imports this module from our directory.
            env=_with_pythonpath(str(Path(__file__).resolve().parent)),
            # A process group of its own: proxy.py forks its acceptor, which stop() must reach
            # too, even when the main process has to be killed before it could stop it.
            start_new_session=True,
        )
        # A safety net for a proxy never stopped (no ``with``, test interrupted): at garbage
        # collection or interpreter exit its processes are killed.
        self._finalizer = weakref.finalize(self, _kill_group, self.process)
        self._port = self._wait_for_port(port_file)
        self._wait_until_serving()

    def stop(self) -> None:
        """Stop the proxy: SIGTERM to its process group, SIGKILL after STOP_TIMEOUT."""
        process = self.process
        if process is not None:
            _stop_group(process, STOP_TIMEOUT)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        self.process = None
        self._port = None

    def __enter__(self) -> ForwardProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_for_port(self, port_file: Path) -> int:
        def written() -> bool:
            # proxy.py writes "PORT\n" after it has bound: a line without its newline is
            # still being written.
            try:
                return port_file.read_text().endswith("\n")
            except FileNotFoundError:
                return False

        self._wait(written, "write its port file")
        return int(port_file.read_text().split()[0])

    def _wait_until_serving(self) -> None:
        def serving() -> bool:
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as sock:
                    sock.sendall(READINESS_PROBE)
                    return sock.recv(64).startswith(b"HTTP/1.")
            except OSError:
                return False

        self._wait(serving, f"answer HTTP on {self.address}")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Poll *ready* (see :func:`processes.wait_until`) while the proxy runs; fail saying
        why, with the end of its output."""

        def alive_and_ready() -> bool:
            assert self.process is not None
            if _has_exited(self.process):
                raise RuntimeError(
                    f"proxy.py exited during startup ({self._describe()});"
                    f" its output ends with:\n{self._log_tail()}"
                )
            return ready()

        try:
            wait_until(alive_and_ready, STARTUP_TIMEOUT, what, POLL_INTERVAL)
        except AssertionError:
            raise RuntimeError(
                f"proxy.py did not {what} within {STARTUP_TIMEOUT} s ({self._describe()});"
                f" its output ends with:\n{self._log_tail()}"
            ) from None

    def _describe(self) -> str:
        assert self.process is not None
        command = self.process.args
        assert isinstance(command, list)
        return " ".join(
            "***" if previous == "--basic-auth" else str(arg)
            for previous, arg in zip(["", *command], command, strict=False)
        )

    def _log_tail(self) -> str:
        return self.log()[-LOG_TAIL_CHARS:] or "(nothing)"


def _with_pythonpath(directory: str) -> dict[str, str]:
    """This process's environment, with *directory* first on PYTHONPATH."""
    paths = [directory, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}


def _has_exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether *process* has ended, without reaping it: while it is a zombie its pid, and so
    its process group id, cannot be given to another process, and killpg() stays safe."""
    if process.returncode is not None:
        return True
    try:
        result = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped
        return True
    return result is not None


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    _signal_group(process, signal.SIGKILL)
    process.wait(timeout=STOP_TIMEOUT)


def _signal_group(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    # The group's id is the main process's pid (start_new_session). Once that process is
    # reaped (returncode set) the id may be another process's: signal no more. Until then,
    # even as a zombie, it holds the id, so this reaches its acceptor too.
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _stop_group(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the group (proxy.py shuts down and joins its acceptor), wait up to *timeout*,
    then SIGKILL whatever of the group is left, and reap the main process."""
    _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not _has_exited(process) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL)
    # Not reaped yet: this reaches an acceptor left behind even by a main process that
    # exited on its own (normally the main process has joined it: nothing is left).
    _signal_group(process, signal.SIGKILL)
    process.wait(timeout=timeout)
