"""A private redis-server on a free port (never the machine's 6379) for the demo and tests."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

STARTUP_TIMEOUT = 10.0
MISSING_MESSAGE = (
    "redis-server is not installed. Install it (Debian/Ubuntu: apt-get install redis-server; "
    "Fedora: dnf install redis; macOS: brew install redis) or pass the URL of a running Redis."
)
# The server certificate names both, so a client may connect to either with hostname checks on.
TLS_SUBJECT_ALT_NAME = "subjectAltName=IP:127.0.0.1,DNS:localhost"


# Servers get ports below the kernel's ephemeral range (Linux: 32768-60999), so that no client
# socket is given one between our choosing it and the server binding it.
PORTS_FROM, PORTS_BELOW = 10_000, 32_768
# A process holds a lock on a file named after each port it chose, until its server is closed
# (or the process ends): processes side by side (pytest-xdist, tox run-parallel, the demo) never
# choose the same port, even before its server listens. Checked only for a listener, two of them
# chose the same port in about one full test run of four (a cluster node exited at start).
PORT_LOCKS = Path(tempfile.gettempdir()) / "scrapy-redis-throttle-ports"
_held_ports: dict[int, int] = {}


def free_port() -> int:
    """A port nothing listens on now, and that no other process chose, for a server this
    process starts (see :func:`release_port`)."""
    PORT_LOCKS.mkdir(exist_ok=True)
    for port in random.sample(range(PORTS_FROM, PORTS_BELOW), 1000):
        lock = os.open(PORT_LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:  # chosen by another process, or something listens there
            os.close(lock)
            continue
        _held_ports[port] = lock
        return port
    raise OSError(f"no free port in {PORTS_FROM}-{PORTS_BELOW - 1} after 1000 tries")


def release_port(port: int) -> None:
    """*port*, from :func:`free_port`, may be chosen by another process again."""
    lock = _held_ports.pop(port, None)
    if lock is not None:
        os.close(lock)


def make_tls_files(directory: Path) -> None:
    """Write a throwaway CA (ca.crt) and a server certificate and key it signed (server.crt,
    server.key) for 127.0.0.1 and localhost into directory, with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("TLS needs the openssl command line tool, which is not installed")
    # P-256 keys: generated instantly, unlike RSA. The extensions follow what strict X.509
    # checks (Python 3.13's default context) demand of a CA and of a server certificate.
    (directory / "server.ext").write_text(
        f"{TLS_SUBJECT_ALT_NAME}\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    commands = [
        [openssl, "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=local_redis throwaway CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", *key, "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "server.ext"],
    ]  # fmt: skip
    for command in commands:
        result = subprocess.run(command, cwd=directory, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:2])} failed: {result.stderr.strip()}")
    # redis-server only needs to read the key; keep it private like a real one anyway.
    (directory / "server.key").chmod(0o600)


class RedisServer:
    """A redis-server process of our own, keeping nothing on disk. It can be stopped and started
    again on the same port (tests use that to simulate outages), or paused (SIGSTOP) to simulate
    a server that accepts connections but never answers.

    With tls=True the server speaks only TLS (no plain-text port), url is ``rediss://...`` and
    client() verifies the server against ca_file. The certificates live in a temporary directory
    made once per object, so stop()/start()/restart() reuse them. close() (and leaving the
    ``with`` block) stops the server and removes that directory; an object that is only stopped
    has it removed when it is garbage collected or at interpreter exit. start() after close()
    makes new certificates (and so a new ca_file).

    Everything lives in memory: after a restart ACL users added with add_user() are gone.
    """

    def __init__(self, *extra_args: str, password: str | None = None, tls: bool = False) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(MISSING_MESSAGE)
        self.executable = executable
        self.password = password
        self.tls = tls
        self.extra_args = (*extra_args, "--requirepass", password) if password else extra_args
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._tls_dir: tempfile.TemporaryDirectory[str] | None = None
        if tls:
            self._make_tls_dir()

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> str:
        """The CA certificate that signed a TLS server's certificate (ssl_ca_certs=...)."""
        return str(self._tls_path() / "ca.crt")

    def client(self) -> redis.Redis:
        """A client as the default user (with password, if any), verifying TLS if on."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5,
            ssl=self.tls, ssl_ca_certs=self.ca_file if self.tls else None,
        )  # fmt: skip

    def start(self) -> RedisServer:
        if self.tls:
            if self._tls_dir is None:
                self._make_tls_dir()
            tls_dir = self._tls_path()
            listen = [
                "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(tls_dir / "server.crt"),
                "--tls-key-file", str(tls_dir / "server.key"),
                "--tls-ca-cert-file", str(tls_dir / "ca.crt"),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        else:
            listen = ["--port", str(self.port)]
        self.process = subprocess.Popen(
            [self.executable, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             *self.extra_args],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT
        with self.client() as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited with {self.process.returncode}"
                    )
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"redis-server on port {self.port} did not answer PING within "
                            f"{STARTUP_TIMEOUT} s"
                        ) from None
                    time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (SIGKILL, even if paused); start() may follow, on the same port."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=STARTUP_TIMEOUT)
        self.process = None

    def restart(self) -> RedisServer:
        """Kill the server and start a fresh, empty one on the same port."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP the server: connections are still accepted by the kernel, nothing answers."""
        os.kill(self._running_pid(), signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server; it then answers what was sent meanwhile."""
        os.kill(self._running_pid(), signal.SIGCONT)

    def add_user(self, name: str, password: str, *rules: str) -> None:
        """Create (or redefine from scratch) an enabled ACL user, e.g.
        add_user("worker", "pw", "~throttle:*", "+get"). Runs, as the default user,
        ``ACL SETUSER name reset on >password rules...``; "reset" makes a second call replace
        the user's rules instead of adding to them (a new user starts with no rights anyway)."""
        with self.client() as client:
            client.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *rules)

    def close(self) -> None:
        """Stop the server for good and remove its TLS files, if any."""
        self.stop()
        release_port(self.port)
        if self._tls_dir is not None:
            self._tls_dir.cleanup()
            self._tls_dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _make_tls_dir(self) -> None:
        self._tls_dir = tempfile.TemporaryDirectory(prefix="local_redis_tls_")
        make_tls_files(Path(self._tls_dir.name))

    def _tls_path(self) -> Path:
        if self._tls_dir is None:
            raise RuntimeError("this RedisServer has no TLS files (tls=False, or closed)")
        return Path(self._tls_dir.name)

    def _running_pid(self) -> int:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"redis-server on port {self.port} is not running")
        return self.process.pid
