"""SIGTERM: health NOT_SERVING, the in-flight request finishes, the process exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragkv.client import RagClient

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_then_exits_zero(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.server.fake_serve", str(port_file)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        addr = f"127.0.0.1:{port_file.read_text()}"
        channel = grpc.insecure_channel(addr)
        health = health_pb2_grpc.HealthStub(channel)
        with channel, RagClient(addr, timeout=30) as client:
            grpc.channel_ready_future(channel).result(timeout=10)
            stream = client.query("in flight")
            assert stream.chunks  # decoding has begun: 20 pieces, 50 ms each
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while health.Check(health_pb2.HealthCheckRequest(), timeout=2).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health never went NOT_SERVING"
                time.sleep(0.02)
            stats = stream.result()
            assert stats.usage.completion_tokens == 20
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
