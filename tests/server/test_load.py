"""Concurrency and metrics: a burst of sync and asyncio clients, the Prometheus endpoint."""

from __future__ import annotations

import asyncio
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ragkv.client import AsyncRagClient, RagClient
from ragkv.types import Mode
from tests.server.fakes import FakeBackend, ServerThread, settings


def test_burst_of_sync_clients_no_errors() -> None:
    backend = FakeBackend(token_delay=0.002)
    st = ServerThread(settings(max_queue=32), lambda _: backend)
    try:
        def one(i: int) -> str:
            with RagClient(st.addr, timeout=30) as client:
                return client.query(f"client {i} asks", top_k=1 + i % 4).result().text

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(32)))
        assert answers == [f"client {i} asks " for i in range(32)]
        assert backend.max_active == 1  # the engine ran one request at a time
        assert len(backend.finished) == 32
    finally:
        st.stop()


def test_burst_of_async_clients_no_errors() -> None:
    backend = FakeBackend()
    st = ServerThread(settings(max_queue=32), lambda _: backend)

    async def main() -> list[str]:
        async with AsyncRagClient(st.addr, timeout=30) as client:
            async def one(i: int) -> str:
                stream = client.query(f"async {i}", mode="reuse")
                pieces = [p async for p in stream]
                assert stream.chunks is not None and stream.stats is not None
                assert stream.stats.mode is Mode.REUSE
                return "".join(pieces)

            answers = await asyncio.gather(*(one(i) for i in range(24)))
            result = await client.retrieve("q", top_k=2)
            assert len(result.chunks) == 2
            assert [c.name for c in await client.list_collections()][0] == "default"
            assert (await client.collection_stats()).collection.name == "default"
            return answers

    try:
        assert asyncio.run(main()) == [f"async {i} " for i in range(24)]
    finally:
        st.stop()


def test_metrics_endpoint() -> None:
    st = ServerThread(settings(metrics_port=0), lambda _: FakeBackend())
    try:
        with RagClient(st.addr, timeout=10) as client:
            client.query("measure me", top_k=4).result()
            try:
                client.retrieve("q", collection="nope")
            except Exception:  # the error counter is what we look at
                pass
        port = st.server.metrics_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        st.stop()
    assert 'ragkv_ttft_seconds_count{collection="default",mode="blend"} 1.0' in body  # the default mode
    assert 'ragkv_request_seconds_count{method="Query"} 1.0' in body
    # chunk tiers of the fake: cpu, disk, computed, gpu
    assert 'ragkv_kv_tier_hits_total{collection="default",tier="cpu"} 1.0' in body
    assert 'ragkv_kv_tier_misses_total{collection="default",tier="gpu"} 3.0' in body
    assert 'ragkv_kv_computed_total{collection="default"} 1.0' in body
    assert 'ragkv_kv_loaded_bytes_total{collection="default",tier="disk"} 2000.0' in body
    assert 'ragkv_recompute_ratio_count{collection="default",mode="blend"} 1.0' in body
    assert "ragkv_queue_depth 0.0" in body
    assert 'ragkv_rpc_errors_total{code="NOT_FOUND",method="Retrieve"} 1.0' in body
