"""A Redis Cluster of the test's own: three masters of the machine's `redis-server` (or another
binary, such as Valkey's), on free local ports, each owning a third of the slots, and optionally a
replica of each, which the cluster promotes when its master fails.

Built the way an operator would without `redis-cli --cluster create`: ADDSLOTSRANGE on each node,
then CLUSTER MEET, then CLUSTER REPLICATE on each replica, then wait until every node reports
`cluster_state:ok`, knows every node, and every master has its replica in sync.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import key_slot

from sluice.wire.connections import reply_text
from sluice.wire.keys import SLOTS
from tests.faults._support import REDIS_SERVER, RedisServer
from tests.support import wait_until

# Append-only, fsynced every second, as `sluice up` ships; each node keeps its own nodes.conf.
CLUSTER_NODE = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "cluster-node-timeout": "5000",
                "appendonly": "yes", "appendfsync": "everysec", "save": ""}


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it, as Redis fixes it) is free too."""
    for _ in range(200):
        port = random.randint(20_000, 55_000)
        if all(_free(p) for p in (port, port + 10_000)):
            return port
    raise RuntimeError("no free pair of ports for a cluster node")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class LocalCluster:
    directory: Path
    masters: int = 3
    replicas: int = 0  # per master
    binary: str = REDIS_SERVER
    node_timeout_ms: int = 5000  # how long a master may be unreachable before its replica takes over
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Any node names the cluster: the client learns the rest from it."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def start(self) -> None:
        total = self.masters * (1 + self.replicas)
        for n in range(total):
            directory = self.directory / f"node{n}"
            directory.mkdir(parents=True, exist_ok=True)
            node = RedisServer(directory=directory, port=cluster_port(), binary=self.binary,
                               persistence={**CLUSTER_NODE, "cluster-node-timeout": str(self.node_timeout_ms)})
            self.nodes.append(node)  # before it starts: a node that fails to answer is still stopped
            node.start()
        share = SLOTS // self.masters
        for n, node in enumerate(self.nodes[:self.masters]):
            last = SLOTS - 1 if n == self.masters - 1 else (n + 1) * share - 1
            with self._client(node) as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", n * share, last)
        with self._client(self.nodes[0]) as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        wait_until(lambda: self._known_everywhere(total), timeout_s=30, what="every cluster node to know the others")
        for n, replica in enumerate(self.nodes[self.masters:]):
            with self._client(self.nodes[n % self.masters]) as master:
                master_id = master.execute_command("CLUSTER", "MYID")
            with self._client(replica) as client:
                client.execute_command("CLUSTER", "REPLICATE", master_id)
        wait_until(lambda: self.ready() and self._replicated(), timeout_s=30,
                   what="the local Redis Cluster to agree on its slots")

    def _known_everywhere(self, total: int) -> bool:
        for node in self.nodes:
            with self._client(node) as client:
                if f"cluster_known_nodes:{total}" not in reply_text(client.execute_command("CLUSTER", "INFO")):
                    return False
        return True

    def node_of(self, key: str) -> int:
        """The index of the node that holds `key`'s slot."""
        return min(key_slot(key.encode()) // (SLOTS // self.masters), self.masters - 1)

    def ready(self) -> bool:
        """Every running node says the cluster is ok (a failed master's slots have a new owner)."""
        for node in self.nodes:
            if node.ping():
                with self._client(node) as client:
                    if "cluster_state:ok" not in reply_text(client.execute_command("CLUSTER", "INFO")):
                        return False
        return True

    def _replicated(self) -> bool:
        for master in self.nodes[:self.masters]:
            with self._client(master) as client:
                replication = client.info("replication")
            online = [v for k, v in replication.items() if k.startswith("slave") and isinstance(v, dict)
                      and v.get("state") == "online"]
            if len(online) < self.replicas:
                return False
        return True

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True)

    def flush(self) -> None:
        for node in self.nodes:
            with self._client(node) as client:
                client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    @staticmethod
    def _client(node: RedisServer) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5)


@contextmanager
def running_cluster(directory: Path, *, binary: str = REDIS_SERVER) -> Iterator[LocalCluster]:
    """A started cluster, stopped (every node that started) on the way out."""
    made = LocalCluster(directory=directory, binary=binary)
    try:
        made.start()
        yield made
    finally:
        made.stop()
