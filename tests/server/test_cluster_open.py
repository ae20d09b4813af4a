"""`ragkv serve --replicas` with no credentials listens on loopback only (issue 71): Ray Serve's
gRPC proxy binds every interface whatever --host says, so the cluster starts none, and its HTTP
API listens on --host. Checked through the machine's listening sockets (/proc/net/tcp*), on a
real local Ray with one replica of the tiny model."""

from __future__ import annotations

import ipaddress
import json
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the ray extra (ray[serve]) is not installed: pip install 'ragkv[ray]'")

from ragkv.server import cluster
from ragkv.server.routing import Policy
from ragkv.server.settings import CollectionSpec
from tests.server.fakes import build_index, settings
from tests.server.test_cluster import CORPUS, QUESTION, _free_port


def _listening(port: int) -> set[str]:
    """The addresses a socket of this machine listens on at `port` (IPv4 and IPv6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            host, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(host)
            # the kernel writes each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.add(str(ipaddress.ip_address(words)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp to read the listening sockets")
def test_a_cluster_without_credentials_listens_on_loopback_only(tmp_path: Path, tiny_llama_dir: Path) -> None:
    grpc_port, http_port = _free_port(), _free_port()
    index = build_index(tmp_path, CORPUS, tiny_llama_dir)
    s = settings(indexes=(CollectionSpec("docs", index),), port=grpc_port, http_port=http_port)
    cluster.start(s, cluster.ClusterSettings(1, routing=Policy.CHUNK, cpus_per_replica=0.5))
    try:
        assert _listening(grpc_port) == set()  # no gRPC proxy: it would listen on [::]
        assert _listening(http_port) == {"127.0.0.1"}
        body = {"model": "docs", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as reply:  # the loopback HTTP API answers
            assert json.loads(reply.read())["usage"]["completion_tokens"] >= 1
    finally:
        cluster.stop()
