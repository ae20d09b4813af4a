"""Bearer-token auth (health exempt) and TLS on a real loopback server."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragkv.client import RagClient
from ragkv.retry import NO_RETRY
from tests.server.fakes import FakeBackend, ServerThread, settings


@pytest.fixture
def auth_server(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    st = ServerThread(settings(auth_token_file=token_file), lambda _: FakeBackend())
    yield st
    st.stop()


@pytest.mark.parametrize("token", [None, "wrong-token", "s3cret-token-but-longer"])
def test_unauthenticated_without_a_valid_token(auth_server: ServerThread, token: str | None) -> None:
    with RagClient(auth_server.addr, token=token, timeout=5, retry=NO_RETRY) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.query("q"))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            client.retrieve("q")
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_valid_token_is_served(auth_server: ServerThread) -> None:
    with RagClient(auth_server.addr, token="s3cret-token", timeout=5) as client:
        assert client.query("hello there").result().text == "hello there "
        assert len(client.retrieve("q", top_k=2).chunks) == 2


def test_health_is_exempt(auth_server: ServerThread) -> None:
    channel = grpc.insecure_channel(auth_server.addr)
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_auth_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGKV_AUTH_TOKEN", "env-token")
    st = ServerThread(settings(), lambda _: FakeBackend())
    try:
        with RagClient(st.addr, timeout=5, retry=NO_RETRY) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.retrieve("q")
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with RagClient(st.addr, token="env-token", timeout=5) as client:
            assert client.retrieve("q", top_k=1).chunks
    finally:
        st.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test certificate")
def test_tls_round_trip(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    st = ServerThread(settings(tls_cert=cert, tls_key=key), lambda _: FakeBackend())
    try:
        with RagClient(st.addr, root_certificates=cert, server_name="localhost", timeout=5) as client:
            assert client.query("over tls").result().text == "over tls "
        with RagClient(st.addr, timeout=2, retry=NO_RETRY) as plaintext:
            with pytest.raises(grpc.RpcError) as err:
                plaintext.retrieve("q")
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        st.stop()
