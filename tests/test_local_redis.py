"""The private redis-servers of the demo and the tests: the ports they are given."""

from __future__ import annotations

import subprocess
import sys

from local_redis import PORT_LOCKS, free_port, release_port

# Another process's view: can it take the lock of this port now (as free_port would)?
TAKES_LOCK = """
import fcntl, os, sys
lock = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    print("held")
else:
    print("free")
"""


def another_process_sees(port: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", TAKES_LOCK, str(PORT_LOCKS / str(port))],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_a_port_chosen_by_one_process_is_not_chosen_by_another_until_released() -> None:
    """Test processes side by side choose ports at random: before its server listens, a port
    one of them chose must not be chosen by another (a cluster node once exited at start)."""
    port = free_port()
    assert another_process_sees(port) == "held"
    release_port(port)
    assert another_process_sees(port) == "free"
