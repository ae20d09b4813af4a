"""Raw bytes that are not a request message: INVALID_ARGUMENT on every method, no traceback logged."""

from __future__ import annotations

import logging
import random

import grpc
import pytest

from ragkv.v1 import ragkv_pb2 as pb
from tests.server.fakes import FakeBackend, ServerThread, settings

_IDENTITY = {"request_serializer": None, "response_deserializer": None}  # bytes in, bytes out


def _garbage(rng: random.Random) -> bytes:
    """Bytes the protobuf parser refuses: a field tag of wire type 7 (none such), then noise."""
    return bytes([0x0F]) + rng.randbytes(rng.randrange(0, 64))


@pytest.fixture(scope="module")
def server():
    st = ServerThread(settings(), lambda s: FakeBackend())
    yield st
    st.stop()


def test_garbage_really_does_not_parse() -> None:
    from google.protobuf.message import DecodeError

    rng = random.Random(0)
    for _ in range(20):
        with pytest.raises(DecodeError):
            pb.QueryRequest.FromString(_garbage(rng))


@pytest.mark.parametrize("method, kind", [
    ("/ragkv.v1.RagService/Query", "unary_stream"),
    ("/ragkv.v1.RagService/Retrieve", "unary_unary"),
    ("/ragkv.v1.RagService/ListCollections", "unary_unary"),
    ("/ragkv.v1.RagService/GetCollectionStats", "unary_unary"),
    ("/grpc.health.v1.Health/Check", "unary_unary"),
])
def test_random_payloads_are_invalid_argument(server: ServerThread, method: str, kind: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(hash(method) & 0xFFFF)
    codes: dict[str, int] = {}
    with caplog.at_level(logging.DEBUG), grpc.insecure_channel(server.addr) as channel:
        call = getattr(channel, kind)(method, **_IDENTITY)
        for _ in range(25):
            payload = _garbage(rng)
            with pytest.raises(grpc.RpcError) as err:
                if kind == "unary_stream":
                    list(call(payload, timeout=10))
                else:
                    call(payload, timeout=10)
            code = err.value.code()
            codes[code.name] = codes.get(code.name, 0) + 1
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                assert "not a valid protobuf message" in err.value.details(), err.value.details()
    assert codes == {"INVALID_ARGUMENT": 25}, f"{method}: status codes of 25 undecodable requests: {codes}"
    tracebacks = [r for r in caplog.records if r.exc_info or "Unexpected" in r.getMessage()]
    assert not tracebacks, f"logged per bad request: {[r.getMessage()[:120] for r in tracebacks]}"


def test_valid_requests_still_work_through_the_interceptor(server: ServerThread) -> None:
    with grpc.insecure_channel(server.addr) as channel:
        call = channel.unary_unary("/ragkv.v1.RagService/ListCollections", **_IDENTITY)
        raw = call(pb.ListCollectionsRequest().SerializeToString(), timeout=10)
        assert pb.ListCollectionsResponse.FromString(raw).collections
        query = channel.unary_stream("/ragkv.v1.RagService/Query", **_IDENTITY)
        replies = [pb.QueryResponse.FromString(r) for r in
                   query(pb.QueryRequest(question="hello?", collection="default").SerializeToString(), timeout=10)]
        assert len(replies) >= 2, replies


def test_rejections_are_counted(server: ServerThread) -> None:
    metrics = server.server.metrics
    before = metrics.errors.labels("Retrieve", "INVALID_ARGUMENT")._value.get()
    with grpc.insecure_channel(server.addr) as channel:
        with pytest.raises(grpc.RpcError):
            channel.unary_unary("/ragkv.v1.RagService/Retrieve", **_IDENTITY)(_garbage(random.Random(1)), timeout=10)
    assert metrics.errors.labels("Retrieve", "INVALID_ARGUMENT")._value.get() == before + 1
