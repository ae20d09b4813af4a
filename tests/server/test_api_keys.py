"""Named API keys, fail-closed start and request caps, tried from outside as an attacker would:
gRPC and HTTP against a loopback server with the fake backend (collections "default" and
"mismatch")."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from ragkv.cli.main import main
from ragkv.client import RagClient
from ragkv.retry import NO_RETRY
from ragkv.server.api_keys import KeyRing, check_exposure, is_loopback
from ragkv.server.settings import ServerSettings
from tests.server.fakes import FakeBackend, ServerThread, settings

READER = "reader-secret-0123456789"  # may read "default" only, 3 requests a minute
ADMIN = "admin-secret-0123456789ab"  # every collection, no limits


def _keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([
        {"name": "reader", "key_sha256": hashlib.sha256(READER.encode()).hexdigest(), "collections": ["default"],
         "requests_per_minute": 3},
        {"name": "admin", "key": ADMIN},
    ]))
    return path


@pytest.fixture
def keyed(tmp_path: Path):
    st = ServerThread(settings(api_keys_file=_keys_file(tmp_path), http_port=0, metrics_port=0),
                      lambda _: FakeBackend())
    yield st
    st.stop()


def _http(st: ServerThread, path: str, key: str | None, body: object | bytes | None = None,
          timeout: float = 10) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{st.server.http_port}{path}", data=data,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def test_a_foreign_collection_is_permission_denied_without_naming_others(keyed: ServerThread) -> None:
    with RagClient(keyed.addr, token=READER, timeout=5, retry=NO_RETRY) as client:
        assert client.query("hello there").result().text == "hello there "  # its own collection
        for call in (lambda: list(client.query("q", collection="mismatch")),
                     lambda: client.retrieve("q", collection="mismatch"),
                     lambda: client.collection_stats("mismatch"),
                     lambda: client.collection_stats("no-such-collection")):  # no existence oracle either
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "default" not in err.value.details()
        assert [c.name for c in client.list_collections()] == ["default"]
    with RagClient(keyed.addr, token=ADMIN, timeout=5) as client:
        assert sorted(c.name for c in client.list_collections()) == ["default", "mismatch"]
    status, body = _http(keyed, "/v1/chat/completions", READER, _chat("mismatch"))
    assert status == 403 and body["error"]["type"] == "permission_error"
    status, body = _http(keyed, "/v1/models", READER)
    assert status == 200 and [m["id"] for m in body["data"]] == ["default"]
    assert _http(keyed, "/v1/models/mismatch", READER)[0] == 403


def test_unknown_and_missing_keys_are_unauthenticated(keyed: ServerThread) -> None:
    for key in (None, "reader-secret", READER + "x", hashlib.sha256(READER.encode()).hexdigest()):
        with RagClient(keyed.addr, token=key, timeout=5, retry=NO_RETRY) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.retrieve("q")
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert _http(keyed, "/v1/chat/completions", key, _chat("default"))[0] == 401


def test_a_key_past_its_requests_per_minute_is_resource_exhausted(keyed: ServerThread) -> None:
    with RagClient(keyed.addr, token=READER, timeout=5, retry=NO_RETRY) as client:
        for _ in range(2):
            client.retrieve("q")
    assert _http(keyed, "/v1/chat/completions", READER, _chat("default"))[0] == 200  # the third
    status, body = _http(keyed, "/v1/chat/completions", READER, _chat("default"))
    assert status == 429 and "requests_per_minute" not in body["error"]["message"]
    assert "limit is 3" in body["error"]["message"]
    with RagClient(keyed.addr, token=READER, timeout=5, retry=NO_RETRY) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.retrieve("q")
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    with RagClient(keyed.addr, token=ADMIN, timeout=5) as client:  # another key is not limited by it
        for _ in range(5):
            client.retrieve("q")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{keyed.server.metrics_port}/metrics", timeout=10).read()
    text = metrics.decode()
    assert 'ragkv_key_refusals_total{code="RESOURCE_EXHAUSTED",key="reader"} 2.0' in text
    assert 'ragkv_key_requests_total{key="admin",method="Retrieve"} 5.0' in text


def test_prompt_tokens_per_minute_limit(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "small", "key": READER, "prompt_tokens_per_minute": 20}]))
    st = ServerThread(settings(api_keys_file=path), lambda _: FakeBackend())
    try:
        with RagClient(st.addr, token=READER, timeout=5, retry=NO_RETRY) as client:
            client.query("one two").result()  # the fake counts 10 + 12 per chunk prompt tokens: past 20
            with pytest.raises(grpc.RpcError) as err:
                client.query("three").result()
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "prompt tokens" in err.value.details()
    finally:
        st.stop()


def test_an_oversized_body_is_refused_fast_unparsed(tmp_path: Path) -> None:
    st = ServerThread(settings(api_keys_file=_keys_file(tmp_path), http_port=0, max_request_bytes=64 * 1024),
                      lambda _: FakeBackend())
    try:
        big = "x" * (200 * 1024)
        t0 = time.perf_counter()
        with RagClient(st.addr, token=ADMIN, timeout=5, retry=NO_RETRY) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.retrieve(big)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        status, body = _http(st, "/v1/chat/completions", ADMIN, b"{" + b" " * (200 * 1024) + b"}")
        assert status == 413 and "--max-request-bytes" in body["error"]["message"]
        assert time.perf_counter() - t0 < 1.0
        # no key: refused before the body is read or parsed, whatever it holds
        status, _ = _http(st, "/v1/chat/completions", None, b"not json at all")
        assert status == 401
        channel = grpc.insecure_channel(st.addr)
        with channel:
            raw = channel.unary_unary("/ragkv.v1.RagService/Retrieve", request_serializer=None,
                                      response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                raw(b"\xff\xff\xff\xff garbage that is no protobuf", timeout=5)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        st.stop()


def test_the_single_token_is_one_unnamed_key_beside_named_keys(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("the-shared-token-0123\n")
    st = ServerThread(settings(api_keys_file=_keys_file(tmp_path), auth_token_file=token), lambda _: FakeBackend())
    try:
        for key in ("the-shared-token-0123", ADMIN):
            with RagClient(st.addr, token=key, timeout=5) as client:
                assert len(client.list_collections()) == 2
    finally:
        st.stop()


# -- fail closed ------------------------------------------------------------------------------


def test_the_default_host_is_loopback() -> None:
    assert ServerSettings().host == "127.0.0.1" and ServerSettings().metrics_host == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.7")


def test_serve_on_all_interfaces_without_credentials_refuses_to_start(tmp_path: Path, capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGKV_AUTH_TOKEN", raising=False)
    index = tmp_path / "no-index-needed"  # refused before the index is looked at
    assert main(["serve", "--index", str(index), "--host", "0.0.0.0", "--port", "0"]) != 0
    err = capsys.readouterr().err
    assert "refusing to serve on 0.0.0.0" in err and "--api-keys" in err and "--insecure-no-auth" in err
    with pytest.raises(ValueError, match="refusing to serve"):
        ServerThread(settings(host="0.0.0.0"), lambda _: FakeBackend())


def test_insecure_no_auth_serves_openly_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    check_exposure("127.0.0.1", KeyRing(), insecure_no_auth=False)  # loopback needs nothing
    with caplog.at_level("WARNING"):
        check_exposure("0.0.0.0", KeyRing(), insecure_no_auth=True)
    assert "NO authentication" in caplog.text
    check_exposure("0.0.0.0", KeyRing.from_token("t" * 16), insecure_no_auth=False)


@pytest.mark.parametrize("entries, message", [
    ([], "non-empty JSON list"),
    ([{"name": "a"}], "exactly one of 'key'"),
    ([{"name": "a", "key": "short"}], "at least 16"),
    ([{"name": "a", "key_sha256": "abc"}], "64 hex"),
    ([{"name": "a b", "key": "k" * 16}], "'name' must match"),
    ([{"name": "a", "key": "k" * 16, "colections": ["x"]}], "unknown fields"),
    ([{"name": "a", "key": "k" * 16, "requests_per_minute": 0}], "positive integer"),
    ([{"name": "a", "key": "k" * 16}, {"name": "b", "key": "k" * 16}], "same secret"),
    ([{"name": "a", "key": "k" * 16}, {"name": "a", "key": "j" * 16}], "unique"),
])
def test_a_bad_keys_file_is_refused_naming_what_is_wrong(tmp_path: Path, entries: list, message: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=message):
        KeyRing.load(path)


def test_a_refused_call_never_reaches_the_request_parser() -> None:
    """The interceptor's refusing handler takes the raw bytes: nothing of an unauthenticated
    caller's message is parsed (protobuf parsing is the costly, attackable part)."""
    import asyncio
    from collections import namedtuple

    from ragkv.server.auth import AuthInterceptor

    parsed: list[bytes] = []

    def spy(data: bytes) -> bytes:
        parsed.append(data)
        return data

    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req, request_deserializer=spy)
    Details = namedtuple("Details", "method invocation_metadata")
    interceptor = AuthInterceptor(KeyRing.from_token("t" * 16))

    async def continuation(_details):
        return handler

    for metadata in ((), (("authorization", "Bearer wrong-token-000000"),)):
        refused = asyncio.run(interceptor.intercept_service(continuation, Details("/ragkv.v1.RagService/Query",
                                                                                    metadata)))
        assert refused is not handler and refused.request_deserializer is None
    allowed = asyncio.run(interceptor.intercept_service(
        continuation, Details("/ragkv.v1.RagService/Query", (("authorization", "Bearer " + "t" * 16),))))
    assert allowed is handler and parsed == []


def test_tool_descriptions_count_toward_the_request_limits() -> None:
    """A tool's description reaches the prompt: a huge one is refused like a huge schema."""
    from ragkv.server.status import InvalidArgumentError
    from ragkv.server.validation import RequestLimits, validate_query
    from ragkv.types import Mode, QueryOptions, Tool

    limits = RequestLimits(max_tools_chars=10_000)
    small = Tool("lookup", "finds a page")
    validate_query("q", QueryOptions(tools=(small,)), limits, frozenset(Mode))
    for tool in (Tool("lookup", "x" * 20_000), Tool("lookup", "", {"type": "object", "description": "y" * 20_000})):
        with pytest.raises(InvalidArgumentError, match="descriptions"):
            validate_query("q", QueryOptions(tools=(tool,)), limits, frozenset(Mode))


def test_prompt_tokens_are_reserved_before_they_are_computed(tmp_path: Path) -> None:
    """Issue 71: the per-minute prompt tokens were charged only on the final stats, so requests in
    flight together were all admitted, and one that never finished was never charged. They are
    reserved once the prompt is known: the second of two concurrent requests is refused, and a
    request cut short by its deadline still counts."""
    import concurrent.futures

    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "small", "key": READER, "prompt_tokens_per_minute": 20}]))
    backend = FakeBackend(token_delay=0.2, n_pieces=10)  # an answer takes about 2 s
    st = ServerThread(settings(api_keys_file=path), lambda _: backend)
    try:
        with RagClient(st.addr, token=READER, timeout=30, retry=NO_RETRY) as client:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                first = pool.submit(lambda: client.query("one two").result())
                deadline = time.monotonic() + 10
                while not backend.started and time.monotonic() < deadline:
                    time.sleep(0.01)
                second = pool.submit(lambda: client.query("three").result())
                with pytest.raises(grpc.RpcError) as err:
                    second.result()
                assert first.result().usage.prompt_tokens > 20  # the first is answered whole
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "prompt tokens" in err.value.details()
        st.stop()
        backend = FakeBackend(token_delay=0.2, n_pieces=10)
        st = ServerThread(settings(api_keys_file=path), lambda _: backend)
        with RagClient(st.addr, token=READER, timeout=0.5, retry=NO_RETRY) as client:
            with pytest.raises(grpc.RpcError) as cut:  # past its deadline mid-answer: charged all the same
                client.query("one two").result()
            assert cut.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        with RagClient(st.addr, token=READER, timeout=30, retry=NO_RETRY) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.query("three").result()
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        st.stop()
