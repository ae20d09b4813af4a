"""The cluster's security settings without starting Ray: TLS reaches Ray Serve's HTTP proxy (its
gRPC proxy speaks none, so it is not started), joining a remote Ray needs Ray's token auth, and
a request's tenant travels to the replica."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the ray extra (pip install 'ragkv[ray]') is not installed")

from ragkv.server import cluster, ray_proxy
from ragkv.server.query import Query
from ragkv.server.routing import Policy
from tests.server.fakes import settings


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict:
    """cluster.start with Ray and Serve replaced by recorders."""
    calls: dict = {}
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "0")  # what start sets is undone after the test
    monkeypatch.delenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE")
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "0")
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    monkeypatch.setenv("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "x")
    monkeypatch.delenv("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH")
    monkeypatch.setattr(cluster.serve, "start", lambda **kw: calls.update(kw))
    monkeypatch.setattr(cluster.serve, "run", lambda *a, **kw: None)
    monkeypatch.setattr(cluster, "build_app", lambda s, c: None)
    from ragkv.kvstore.tiers import peer_ray

    monkeypatch.setattr(peer_ray, "directory_actor", lambda *a, **kw: calls.setdefault("peer_directory", True))
    return calls


def test_the_peer_directory_starts_before_the_replicas_only_when_they_have_peers(started: dict) -> None:
    cluster.start(settings(insecure_no_auth=True), cluster.ClusterSettings(2, None, Policy.CHUNK))
    assert started.pop("peer_directory")
    cluster.start(settings(insecure_no_auth=True), cluster.ClusterSettings(2, None, Policy.CHUNK, peer_tier=False))
    cluster.start(settings(insecure_no_auth=True), cluster.ClusterSettings(1, None, Policy.CHUNK))
    assert "peer_directory" not in started


def test_tls_reaches_ray_serves_http_proxy_and_no_plaintext_grpc_is_started(started: dict, tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cluster.start(settings(tls_cert=cert, tls_key=key, http_port=8443), cluster.ClusterSettings(2, None, Policy.CHUNK))
    assert started["http_options"]["ssl_certfile"] == str(cert)
    assert started["http_options"]["ssl_keyfile"] == str(key)
    assert started["grpc_options"] is None
    started.clear()
    token = tmp_path / "token"
    token.write_text("a-token-of-twenty-chars-or-more")
    cluster.start(settings(auth_token_file=token), cluster.ClusterSettings(2, None, Policy.CHUNK))
    assert "ssl_certfile" not in started["http_options"] and started["grpc_options"] is not None


def test_without_credentials_the_grpc_proxy_that_binds_every_interface_is_not_started(
        started: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 71: Ray Serve's gRPC proxy listens on [::]:PORT whatever --host says, so a cluster
    with no credentials serves no gRPC (its HTTP API stays on --host); with a key, or when told
    --insecure-no-auth, it does. The proxy's message bound is --max-request-bytes, not 2 GiB."""
    import os

    cluster.start(settings(max_request_bytes=1 << 20), cluster.ClusterSettings(1, None, Policy.CHUNK))
    assert started["grpc_options"] is None and started["http_options"]["host"] == "127.0.0.1"
    assert "gRPC is not served" in caplog.text
    assert os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(1 << 20)
    started.clear()
    cluster.start(settings(insecure_no_auth=True), cluster.ClusterSettings(1, None, Policy.CHUNK))
    assert started["grpc_options"] is not None and started["grpc_options"].enable_reflection is False
    # Ray's HTTP proxy wraps itself in what this names: its /-/routes is refused (tests/server/test_cluster.py)
    from ray._common.utils import import_attr

    assert [m.cls for m in import_attr(os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"])()] == [
        ray_proxy.RefuseRayRoutes]


def test_a_proxy_restarted_while_serve_starts_does_not_fail_the_start(
        started: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a loaded host Serve's controller gave up on a proxy after 5 s and killed it while
    serve.start waited on it (ActorDiedError: CI's cluster tests failed at start-up). The
    controller is given longer, and a proxy replaced anyway is waited for, not an error."""
    import os

    from ray.exceptions import ActorDiedError

    def killed(**kw):
        raise ActorDiedError()

    ran: list = []
    monkeypatch.setattr(cluster.serve, "start", killed)
    monkeypatch.setattr(cluster.serve, "run", lambda *a, **kw: ran.append(kw["name"]))
    cluster.start(settings(insecure_no_auth=True), cluster.ClusterSettings(1, None, Policy.CHUNK))
    assert ran == [cluster.APP_NAME] and "a Serve proxy was restarted" in caplog.text
    assert float(os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) == cluster.PROXY_READY_S > 5


def test_the_ray_auth_check_runs_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    joined: list = []
    monkeypatch.setenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "0")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: joined.append(kw))
    monkeypatch.setattr(cluster, "ray_token_auth_on", lambda: False)
    with pytest.raises(ValueError, match="RAY_AUTH_MODE=token"):
        cluster.start(settings(), cluster.ClusterSettings(2, "10.0.0.5:6379", Policy.CHUNK))
    assert joined == []  # refused before ray.init joined anything


def test_joining_a_ray_cluster_without_token_auth_is_refused(started: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "ray_token_auth_on", lambda: False)
    with pytest.raises(ValueError, match="RAY_AUTH_MODE=token"):
        cluster.start(settings(), cluster.ClusterSettings(2, "10.0.0.5:6379", Policy.CHUNK))
    assert started == {}  # refused before Serve started
    cluster.check_ray_auth(None)  # a local Ray started by this process
    cluster.check_ray_auth("10.0.0.5:6379", insecure_no_auth=True)  # warned, not refused
    monkeypatch.setattr(cluster, "ray_token_auth_on", lambda: True)
    cluster.check_ray_auth("10.0.0.5:6379")


def test_the_tenant_travels_with_the_request_to_its_replica() -> None:
    import pickle

    asked = cluster.Asked.of(Query("q", collection="docs", tenant="alice"), None)
    assert pickle.loads(pickle.dumps(asked)).query.tenant == "alice"
    a, b = (cluster.route_keys(Query("q", collection="docs", tenant=t), ()).conversation
            for t in ("alice", "bob"))
    assert a != b


def test_ray_api_list_applications_is_not_served_on_rays_own_grpc_server() -> None:
    """Issue 71: Ray's gRPC proxy registers its own RayServeAPIService, whose ListApplications
    answers anyone, before any replica checks a key. The cluster's last servicer function swaps
    that handler: over Ray's own server class, started as the proxy starts it, the call gets
    UNIMPLEMENTED and names no application, while Healthz still answers through the proxy's
    handler factory. Without the swap, the factory's handler answers with the application list."""
    import asyncio
    from unittest.mock import Mock

    import grpc
    from ray._common.utils import import_attr
    from ray.serve._private.grpc_util import gRPCGenericServer
    from ray.serve.generated import serve_pb2
    from ray.serve.generated.serve_pb2_grpc import add_RayServeAPIServiceServicer_to_server

    assert cluster._SERVICER_FUNCTIONS[-1] == ray_proxy.GUARD

    def factory(service_method: str, streaming_type: object):  # the proxy's: every call routed by its name
        async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return serve_pb2.ListApplicationsResponse(application_names=["ragkv"]).SerializeToString()
        return answer

    async def call(guard: bool) -> tuple[grpc.StatusCode, str, grpc.StatusCode]:
        server = gRPCGenericServer(factory)
        port = server.add_insecure_port("127.0.0.1:0")
        for fn in [add_RayServeAPIServiceServicer_to_server] + ([import_attr(ray_proxy.GUARD)] if guard else []):
            fn(Mock(), server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                listed = channel.unary_unary("/ray.serve.RayServeAPIService/ListApplications",
                                             request_serializer=serve_pb2.ListApplicationsRequest.SerializeToString,
                                             response_deserializer=serve_pb2.ListApplicationsResponse.FromString)
                try:
                    reply = await listed(serve_pb2.ListApplicationsRequest(), timeout=10)
                    code, text = grpc.StatusCode.OK, " ".join(reply.application_names)
                except grpc.aio.AioRpcError as e:
                    code, text = e.code(), e.details() or ""
                health = channel.unary_unary("/ray.serve.RayServeAPIService/Healthz",
                                             request_serializer=serve_pb2.HealthzRequest.SerializeToString,
                                             response_deserializer=lambda b: b)
                await health(serve_pb2.HealthzRequest(), timeout=10)
                return code, text, grpc.StatusCode.OK
        finally:
            await server.stop(None)

    code, text, health = asyncio.run(call(guard=True))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "ragkv" not in text.replace("ragkv's cluster", ""), text
    assert health == grpc.StatusCode.OK
    assert asyncio.run(call(guard=False))[:2] == (grpc.StatusCode.OK, "ragkv")  # what the guard stops
