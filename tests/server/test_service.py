"""RagService over a fake backend: stream shape, stats, every status code, health, reflection."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ragkv.client import RagClient
from ragkv.retry import NO_RETRY, RetryPolicy
from ragkv.types import FinishReason, Mode, Tier
from ragkv.v1 import ragkv_pb2 as pb
from ragkv.v1 import ragkv_pb2_grpc as pb_grpc
from tests.server.fakes import FakeBackend, ServerThread, settings


def _stub(addr: str) -> tuple[grpc.Channel, pb_grpc.RagServiceStub]:
    channel = grpc.insecure_channel(addr)
    return channel, pb_grpc.RagServiceStub(channel)


def test_stream_order_chunks_tokens_stats(server: ServerThread) -> None:
    channel, stub = _stub(server.addr)
    with channel:
        msgs = list(stub.Query(pb.QueryRequest(question="one two three", top_k=3), timeout=10))
    kinds = [m.WhichOneof("event") for m in msgs]
    assert kinds == ["chunks", "token", "token", "token", "stats"]
    assert [c.chunk_id for c in msgs[0].chunks.chunks] == ["doc0#0", "doc1#0", "doc2#0"]
    assert [m.token.index for m in msgs[1:4]] == [0, 1, 2]
    assert msgs[-1].stats.text == "".join(m.token.text for m in msgs[1:4]) == "one two three "


def test_final_stats(server: ServerThread) -> None:
    with RagClient(server.addr, timeout=10) as client:
        stream = client.query("alpha beta", top_k=2, mode="blend", recompute_ratio=0.3, snippet_chars=5)
        assert [c.kv_tier for c in stream.chunks] == [Tier.CPU, Tier.DISK]
        assert all(len(c.text) == 5 for c in stream.chunks)
        assert list(stream) == ["alpha ", "beta "]
        stats = stream.stats
    assert stats is not None
    assert stats.mode is Mode.BLEND and stats.finish_reason is FinishReason.STOP
    assert stats.recompute_fraction == pytest.approx(0.3)
    assert stats.usage.completion_tokens == 2 and stats.usage.prompt_tokens == 34
    assert stats.usage.cached_prompt_tokens == 24
    assert 0 < stats.ttft_seconds <= stats.total_seconds < 5
    assert {"retrieve", "queue", "kv_load", "decode"} <= set(stats.phase_seconds)


def test_defaults_and_length_finish(server: ServerThread) -> None:
    with RagClient(server.addr, timeout=10) as client:
        stats = client.query("a b c d e", max_new_tokens=2, mode=Mode.FULL).result()
    assert stats.text == "a b " and stats.finish_reason is FinishReason.LENGTH
    assert stats.mode is Mode.FULL and stats.recompute_fraction == 1.0


def test_retrieve_and_collections(server: ServerThread) -> None:
    with RagClient(server.addr, timeout=10) as client:
        result = client.retrieve("q", top_k=5, snippet_chars=8)
        assert [c.chunk_id for c in result.chunks] == [f"doc{i}#0" for i in range(5)]
        assert all(c.kv_tier is None and len(c.text) == 8 for c in result.chunks)
        assert result.chunks[0].metadata == {"source": "doc0.txt"}
        names = [c.name for c in client.list_collections()]
        assert names == ["default", "mismatch"]
        stats = client.collection_stats("default")
    assert stats.collection.num_chunks == 8 and [t.tier for t in stats.tiers] == [Tier.CPU, Tier.DISK]


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"question": ""}, "question"),
        ({"question": "   "}, "question"),
        ({"question": "x" * 4097}, "question"),
        ({"top_k": 33}, "top_k"),
        ({"recompute_ratio": -0.1}, "recompute_ratio"),
        ({"recompute_ratio": 1.5}, "recompute_ratio"),
        ({"recompute_ratio": math.nan}, "recompute_ratio"),
        ({"mode": 99}, "mode"),
        ({"mode": 5}, "mode"),  # the reserved number of the removed MODE_CLIP
        ({"max_new_tokens": 5000}, "max_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["s"] * 9}, "stop"),
        ({"sampling": pb.SamplingOptions(top_p=1.5)}, "sampling.top_p"),
        ({"sampling": pb.SamplingOptions(temperature=-1.0)}, "sampling.temperature"),
    ],
)
def test_invalid_argument_names_the_field(server: ServerThread, request_fields: dict, field: str) -> None:
    fields = {"question": "fine question", **request_fields}
    channel, stub = _stub(server.addr)
    with channel, pytest.raises(grpc.RpcError) as err:
        list(stub.Query(pb.QueryRequest(**fields), timeout=10))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()


def test_retrieve_invalid_and_not_found(server: ServerThread) -> None:
    with RagClient(server.addr, timeout=10, retry=NO_RETRY) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.retrieve("q", top_k=100)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "top_k" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.retrieve("q", collection="nope")
        assert err.value.code() is grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.collection_stats("nope")
        assert err.value.code() is grpc.StatusCode.NOT_FOUND


def test_not_found_and_failed_precondition(server: ServerThread) -> None:
    with RagClient(server.addr, timeout=10) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.query("q", collection="nope"))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            list(client.query("q", collection="mismatch"))
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "other-model-fp" in err.value.details()


def test_backend_crash_is_internal_and_server_survives(server: ServerThread) -> None:
    with RagClient(server.addr, timeout=10) as client:
        stream = client.query("boom here")
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() is grpc.StatusCode.INTERNAL
        assert "exploded" not in err.value.details()  # internals stay in the server log
        assert stream.chunks  # the chunks message had already arrived
        assert client.query("still here").result().text == "still here "


def test_resource_exhausted_when_queue_full(slow_server: ServerThread, slow_backend: FakeBackend) -> None:
    with RagClient(slow_server.addr, timeout=20, retry=NO_RETRY) as client:
        running = [client.query(f"q{i}") for i in range(3)]
        # All three admitted: one decoding, two waiting behind it.
        _wait_for(lambda: slow_server.server._admission.depth == 3)
        with pytest.raises(grpc.RpcError) as err:
            list(client.query("one too many"))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in running:
            s.cancel()


def test_deadline_is_honoured_and_frees_the_engine(slow_server: ServerThread, slow_backend: FakeBackend) -> None:
    with RagClient(slow_server.addr, timeout=20, retry=NO_RETRY) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(client.query("slow", timeout=0.4))
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 1.5
        _wait_for(lambda: "slow" in slow_backend.cancelled)
        slow_backend.n_pieces = 2
        assert client.query("next", timeout=5).result().usage.completion_tokens == 2


def test_cancel_frees_work_at_once(slow_server: ServerThread, slow_backend: FakeBackend) -> None:
    with RagClient(slow_server.addr, timeout=20) as client:
        stream = client.query("to be cancelled")
        it = iter(stream)
        assert next(it) == "w0 "
        stream.cancel()
        cancelled_at = time.monotonic()
        _wait_for(lambda: "to be cancelled" in slow_backend.cancelled)
        assert time.monotonic() - cancelled_at < 0.5  # one piece at most, not 40
        assert "to be cancelled" not in slow_backend.finished
        _wait_for(lambda: slow_server.server._admission.depth == 0)


def test_health_answers_while_decoding(slow_server: ServerThread) -> None:
    channel = grpc.insecure_channel(slow_server.addr)
    health = health_pb2_grpc.HealthStub(channel)
    with channel, RagClient(slow_server.addr, timeout=20) as client:
        stream = client.query("long answer")
        assert stream.chunks
        for _ in range(5):
            started = time.monotonic()
            resp = health.Check(health_pb2.HealthCheckRequest(service="ragkv.v1.RagService"), timeout=2)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - started < 0.5
        # Retrieve runs on its own pool: answered during a decode, not after it.
        started = time.monotonic()
        client.retrieve("q", top_k=1)
        assert time.monotonic() - started < 1.0
        assert stream.stats is None  # the decode was still running
        stream.cancel()


def test_not_serving_until_loaded_then_serving() -> None:
    release = threading.Event()
    backend = FakeBackend()

    def factory(_):
        assert release.wait(10)
        return backend

    st = ServerThread(settings(), factory, wait_loaded=False)
    try:
        channel = grpc.insecure_channel(st.addr)
        health = health_pb2_grpc.HealthStub(channel)
        with channel:
            for service in ("", "ragkv.v1.RagService"):
                resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with RagClient(st.addr, timeout=5, retry=NO_RETRY) as client:
                with pytest.raises(grpc.RpcError) as err:
                    list(client.query("too early"))
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            # A retrying client rides out the loading phase.
            threading.Timer(0.3, release.set).start()
            retrying = RetryPolicy(max_attempts=10, initial_backoff=0.1, max_backoff=0.3)
            with RagClient(st.addr, timeout=10, retry=retrying) as client:
                assert client.query("now").result().text == "now "
            resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        st.stop()


def test_reflection_lists_the_services(server: ServerThread) -> None:
    channel = grpc.insecure_channel(server.addr)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    with channel:
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"ragkv.v1.RagService", "grpc.health.v1.Health"} <= names


def test_drain_finishes_in_flight_and_refuses_new(slow_backend: FakeBackend) -> None:
    slow_backend.n_pieces = 10
    st = ServerThread(settings(), lambda _: slow_backend)
    channel = grpc.insecure_channel(st.addr)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        with RagClient(st.addr, timeout=20, retry=NO_RETRY) as client:
            stream = client.query("in flight")
            assert stream.chunks
            drain = threading.Thread(target=st.stop, kwargs={"grace": 10.0})
            drain.start()
            _wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                      == health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(grpc.RpcError) as err:
                list(client.query("late"))
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            assert stream.result().usage.completion_tokens == 10
            drain.join(15)
            assert not drain.is_alive()
    finally:
        channel.close()
        st.stop()


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within timeout")
        time.sleep(0.01)
