"""A private redis-server on a free port (never the machine's 6379) for the demo and tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis

STARTUP_TIMEOUT = 10.0
MISSING_MESSAGE = (
    "redis-server is not installed. Install it (Debian/Ubuntu: apt-get install redis-server; "
    "Fedora: dnf install redis; macOS: brew install redis) or pass the URL of a running Redis."
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A redis-server process of our own, keeping nothing on disk. It can be stopped and started
    again on the same port (tests use that to simulate outages)."""

    def __init__(self, *extra_args: str, password: str | None = None) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(MISSING_MESSAGE)
        self.executable = executable
        self.password = password
        self.extra_args = (*extra_args, "--requirepass", password) if password else extra_args
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *self.extra_args],
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
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=STARTUP_TIMEOUT)
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
