"""Redis as production fleets run it, from real processes: a Sentinel-managed primary and a
Redis Cluster (part of #9). Each keeps its files in a directory of the test's."""

from __future__ import annotations

import shutil
import subprocess
from typing import TYPE_CHECKING, Any

import redis
import redis.cluster
from local_redis import RedisServer, free_port
from processes import wait_until

if TYPE_CHECKING:
    from pathlib import Path

SERVICE = "throttle"
# Nothing listens there: with sentinels or cluster nodes, the URL's host and port are not used.
UNUSED_URL = "redis://127.0.0.1:1/0"
# A node unreachable for this long is failed over (the default, 15 s, would slow tests down).
CLUSTER_NODE_TIMEOUT_MS = 1000
SETUP_TIMEOUT = 30


class SentinelSetup:
    """A primary, its replica, and one sentinel that fails over after 1 s without the primary."""

    def __init__(self, directory: Path) -> None:
        # Directories of their own: a primary and its replica write snapshots when they sync.
        for name in ("primary", "replica"):
            (directory / name).mkdir(parents=True)
        self.directory = directory
        # The replica syncs at once (Redis 7 waits 5 s by default for more replicas): a
        # failover promotes a copy of the buckets, not an empty Redis.
        self.primary = RedisServer(
            "--dir", str(directory / "primary"), "--repl-diskless-sync-delay", "0"
        )
        self.replica = RedisServer(
            "--dir", str(directory / "replica"), "--replicaof", "127.0.0.1",
            str(self.primary.port),
        )  # fmt: skip
        self.sentinel_port = free_port()
        self.sentinel: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelSetup:
        self.primary.start()
        self.replica.start()
        # The sentinel learns of replicas from the primary's INFO, at its start and then every
        # 10 s: connected first, the replica is known at once.
        with self.primary.client() as primary:
            wait_until(
                lambda: primary.info("replication").get("connected_slaves", 0) >= 1,
                SETUP_TIMEOUT,
                "the replica to connect to the primary",
            )
        with self.replica.client() as replica:
            wait_until(
                lambda: replica.info("replication").get("master_link_status") == "up",
                SETUP_TIMEOUT,
                "the replica to sync with the primary",
            )
        config = self.directory / "sentinel.conf"
        config.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.directory}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        self.sentinel = subprocess.Popen(
            [self.replica.executable, str(config), "--sentinel"], stdout=subprocess.DEVNULL
        )
        with self.sentinel_client() as client:

            def knows_the_replica() -> bool:
                try:
                    return bool(client.execute_command("SENTINEL", "REPLICAS", SERVICE))
                except redis.RedisError:
                    return False

            wait_until(knows_the_replica, SETUP_TIMEOUT, "the sentinel to know the replica")
        return self

    def stop(self) -> None:
        if self.sentinel is not None:
            self.sentinel.kill()
            self.sentinel.wait(timeout=10)
        self.replica.stop()
        self.primary.stop()

    def sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_timeout=5)

    def client(self) -> redis.Redis:
        """A client of the primary the sentinel names."""
        return redis.Redis(port=self.primary_port(), socket_timeout=5)

    def primary_port(self) -> int:
        with self.sentinel_client() as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    def settings(self) -> dict[str, Any]:
        """The throttle's settings for this Redis."""
        return {
            "REDIS_THROTTLE_URL": UNUSED_URL,
            "REDIS_THROTTLE_SENTINELS": f"127.0.0.1:{self.sentinel_port}",
            "REDIS_THROTTLE_SENTINEL_SERVICE": SERVICE,
        }


class LocalCluster:
    """A Redis Cluster of 3 primaries with a replica each, made as an operator makes one
    (``redis-cli --cluster create``)."""

    def __init__(self, directory: Path) -> None:
        self.nodes: list[RedisServer] = []
        for index in range(6):
            node_dir = directory / f"node-{index}"
            node_dir.mkdir(parents=True)
            self.nodes.append(
                RedisServer(
                    "--cluster-enabled", "yes",
                    "--dir", str(node_dir),
                    "--cluster-config-file", str(node_dir / "nodes.conf"),
                    # Not the default (port + 10000), which may be taken or above 65535.
                    "--cluster-port", str(free_port()),
                    "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                )
            )  # fmt: skip

    def start(self) -> LocalCluster:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("the cluster tests need redis-cli (Debian/Ubuntu: redis-tools)")
        for node in self.nodes:
            node.start()
        created = subprocess.run(
            [cli, "--cluster", "create", *self.addresses, "--cluster-replicas", "1",
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}")
        wait_until(self._settled, SETUP_TIMEOUT, "every node to see the cluster up and in sync")
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def flush(self) -> None:
        """Empty every primary, and reset every node's counts (INFO errorstats among them)."""
        for node in self.primaries():
            with node.client() as client:
                client.flushall()
        for node in self.running():
            with node.client() as client:
                client.config_resetstat()

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    def settings(self) -> dict[str, Any]:
        """The throttle's settings for this cluster: two seed nodes are enough."""
        return {"REDIS_THROTTLE_CLUSTER_NODES": ",".join(self.addresses[:2])}

    def client(self) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.running()[0].port)

    def primaries(self) -> list[RedisServer]:
        """The running primaries, as the running nodes see them."""
        with self.running()[0].client() as client:
            slots = client.execute_command("CLUSTER", "SLOTS")
        ports = {int(primary[1]) for _, _, primary, *_ in slots}
        return [node for node in self.running() if node.port in ports]

    def running(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None]

    def info(self, node: RedisServer, section: str) -> dict[str, Any]:
        with node.client() as client:
            return client.info(section)  # type: ignore[no-any-return]

    def node_id(self, node: RedisServer) -> str:
        with node.client() as client:
            return str(client.execute_command("CLUSTER", "MYID").decode())

    def slot(self, key: str) -> int:
        with self.running()[0].client() as client:
            return int(client.execute_command("CLUSTER", "KEYSLOT", key))

    def owner(self, slot: int) -> RedisServer:
        """The primary that serves *slot*, as the running nodes see it."""
        with self.running()[0].client() as client:
            for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(node for node in self.nodes if node.port == port)
        raise AssertionError(f"no node serves slot {slot}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        primary_id = self.node_id(primary)
        for node in self.running():
            with node.client() as client:
                replication = client.execute_command("CLUSTER", "REPLICAS", primary_id)
            if replication:
                port = int(replication[0].decode().split()[1].split("@")[0].rsplit(":", 1)[1])
                return next(node for node in self.nodes if node.port == port)
        raise AssertionError(f"no replica of node {primary.port}")

    def _settled(self) -> bool:
        """Every running node sees the cluster up, with the same view of the slots and every
        replica synchronised with its primary."""
        views = set()
        for node in self.running():
            try:
                with node.client() as client:
                    state = client.execute_command("CLUSTER", "INFO").decode()
                    slots = client.execute_command("CLUSTER", "SLOTS")
                replication = self.info(node, "replication")
            except redis.RedisError:
                return False
            if "cluster_state:ok" not in state:
                return False
            if replication["role"] == "slave" and replication["master_link_status"] != "up":
                return False
            views.add(tuple(sorted((start, end, primary[1]) for start, end, primary, *_ in slots)))
        return len(views) == 1


Topology = RedisServer | SentinelSetup | LocalCluster
"""The throttle's Redis: a plain one (scrapy-redis's, REDIS_URL), or one of the above."""


def throttle_settings(topology: Topology) -> dict[str, Any]:
    """The throttle's settings for *topology* (none for a plain Redis: REDIS_URL's)."""
    return {} if isinstance(topology, RedisServer) else topology.settings()
