"""`ragkv serve --replicas`: the server as Ray Serve deployments on a local Ray (server/cluster.py).

One cluster of two engine replicas over a tiny random Llama's index serves every test here:
the same answers as one process over gRPC (Ray Serve's gRPC proxy) and HTTP, client errors
with their own status, an agent's tool loop kept on one replica (its KV tree), and a replica
killed mid-answer (UNAVAILABLE, nothing hangs, the replica comes back). The retry of a request
whose replica died before its answer began is tested on the ingress's runner directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

pytest.importorskip("ray.serve", reason="the ray extra (ray[serve]) is not installed: pip install 'ragkv[ray]'")

from ray.exceptions import ActorDiedError

from ragkv.client import RagClient
from ragkv.engine.request import Request
from ragkv.server import cluster
from ragkv.server.admission import Admission
from ragkv.server.answering import ChunksEvent, TokenEvent
from ragkv.server.metrics import ServerMetrics
from ragkv.server.query import Query
from ragkv.server.routing import Policy, RouteKeys
from ragkv.server.settings import CollectionSpec
from ragkv.server.status import ReplicaLostError, status_for
from ragkv.types import ChatRole, ChatTurn, FinishReason, Mode, QueryStats, RetrievedChunk, Tool, ToolCall, Usage
from tests.server.fakes import ServerThread, build_index, settings

CORPUS = {f"topic{i}.txt": f"Topic {i}: the secret number of topic {i} is {4700 + i}, chosen by player {i}. " * 2
          for i in range(8)}
QUESTION = "What is the secret number of topic 3, and who chose it?"
TOKEN = "cluster-test-token"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return build_index(tmp_path_factory.mktemp("cluster-index"), CORPUS, tiny_llama_dir)


def _settings(index: Path, **overrides: object):  # -> ServerSettings
    return settings(indexes=(CollectionSpec("docs", index),), kv_tree_bytes=64 << 20, **overrides)


@pytest.fixture(scope="module")
def served(index: Path, tmp_path_factory: pytest.TempPathFactory):
    """The cluster (two replicas, chunk routing, a bearer token) and one process over the same index."""
    grpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    s = _settings(index, port=grpc_port, http_port=http_port, metrics_port=metrics_port, auth_token_file=token_file)
    cluster.start(s, cluster.ClusterSettings(2, routing=Policy.CHUNK, cpus_per_replica=0.5, stats_period_s=0.5))
    single = ServerThread(_settings(index), _pipeline_factory())
    yield Served(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", single,
                 f"http://127.0.0.1:{metrics_port}/metrics")
    single.stop()
    cluster.stop()


class Served(NamedTuple):
    """The cluster's addresses, and the one-process server answers are compared with."""

    addr: str  # gRPC, through Ray Serve's proxy
    http: str  # the OpenAI API's base URL
    single: ServerThread  # one process over the same index
    metrics: str  # the ingress's /metrics URL


def _pipeline_factory():
    from ragkv.server.assembly import build_pipeline

    return build_pipeline


def test_a_query_travels_whole_and_the_engine_request_holds_none_of_what_was_asked() -> None:
    import pickle

    from ragkv.server.query import Query

    query = Query("q", collection="docs", tools=(Tool("f", "d"),), tenant="alice")
    assert pickle.loads(pickle.dumps(cluster.Asked.of(query, None))).query == query
    # the engine's request: what the engine reads; the client's question, collection, turns, tools,
    # retrieval options and tenant stay in the Query
    shared = {f.name for f in dataclasses.fields(Request)} & {f.name for f in dataclasses.fields(Query)}
    assert shared == {"mode", "sampling"}


@pytest.mark.parametrize("mode", ["full", "blend", "focus"])
def test_the_cluster_answers_as_one_process_over_grpc(served, mode: str) -> None:
    addr, _, single, _ = served
    with RagClient(addr, token=TOKEN) as routed, RagClient(single.addr) as alone:
        kwargs = dict(collection="docs", mode=mode, top_k=3, max_new_tokens=8, recompute_ratio=0.2)
        a, b = routed.query(QUESTION, **kwargs), alone.query(QUESTION, **kwargs)
        assert "".join(a) == "".join(b)
        ra, rb = a.result(), b.result()
        assert [c.chunk_id for c in a.chunks] == [c.chunk_id for c in b.chunks]
        assert ra.usage.prompt_tokens == rb.usage.prompt_tokens
        assert ra.ttft_seconds > 0 and ra.total_seconds >= ra.ttft_seconds
        assert ra.finish_reason is FinishReason.LENGTH


def test_the_cluster_serves_the_openai_http_api(served) -> None:
    addr, http, single, _ = served
    body = {"model": "docs", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "mode": "blend"}
    req = urllib.request.Request(f"{http}/v1/chat/completions", json.dumps(body).encode(), HEADERS)
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    with RagClient(single.addr) as alone:
        expected = "".join(alone.query(QUESTION, collection="docs", mode="blend", max_new_tokens=8))
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["completion_tokens"] == 8
    # streamed (server-sent events through Ray Serve's HTTP proxy): the same text, piece by piece
    req = urllib.request.Request(f"{http}/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                 HEADERS)
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")]
    assert "".join(pieces) == expected and len([p for p in pieces if p]) > 1


def test_the_ingress_metrics_count_every_replicas_answers(served) -> None:
    addr = served.addr

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(served.metrics, timeout=30) as resp:
            lines = resp.read().decode().splitlines()
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in lines if line and line[0] != "#")}

    def requests_ok(m: dict[str, float]) -> float:
        return m.get('ragkv_requests_total{code="OK"}', 0.0)

    before = scrape()
    with RagClient(addr, token=TOKEN) as client:
        for i in range(3):
            "".join(client.query(f"{QUESTION} ({i})", collection="docs", mode="blend", max_new_tokens=2))
    after = scrape()
    assert requests_ok(after) - requests_ok(before) == 3
    ttft = 'ragkv_ttft_seconds_count{collection="docs",mode="blend"}'
    assert after.get(ttft, 0.0) - before.get(ttft, 0.0) == 3

    def decisions(m: dict[str, float]) -> float:
        return sum(v for k, v in m.items() if k.startswith("ragkv_route_decisions_total{"))

    # every request was routed, and each decision counted with its reason
    assert decisions(after) - decisions(before) >= 3
    # the replicas' own gauges, as they published them to the router: one series per replica
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with RagClient(addr, token=TOKEN) as client:  # the router asks the replicas for stats as it routes
            "".join(client.query(QUESTION, collection="docs", mode="blend", max_new_tokens=1))
        m = scrape()
        backlog = [k for k in m if k.startswith("ragkv_replica_backlog_seconds{")]
        tree = [k for k in m if k.startswith("ragkv_replica_kv_tree_bytes{")]
        peer = [k for k in m if k.startswith("ragkv_peer_reads_total{")]  # the peer tier is on with replicas
        published = sum(v for k, v in m.items() if k.startswith("ragkv_replica_peer_published_bytes{"))
        shared = sum(v for k, v in m.items() if k.startswith("ragkv_replica_host_tier_shared_bytes{"))
        if len(backlog) == 2 and len(tree) == 2 and len(peer) == 2 and published > 0 and shared > 0:
            break
        time.sleep(0.5)
    assert len(backlog) == 2 and len(tree) == 2, m
    assert len(peer) == 2 and published > 0, m  # what the replicas read, they published for each other
    assert shared > 0, m  # and their host tiers hold it in the published objects' memory


def test_health_collections_and_client_errors_keep_their_status(served) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    addr, _, _, _ = served
    with grpc.insecure_channel(addr) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    with RagClient(addr, token=TOKEN) as client:
        assert [c.name for c in client.list_collections()] == ["docs"]
        with pytest.raises(Exception) as err:
            "".join(client.query(QUESTION, collection="nope"))
        assert _code(err.value) is grpc.StatusCode.NOT_FOUND
        with pytest.raises(Exception) as err:
            "".join(client.query(QUESTION, collection="docs", recompute_ratio=2.0))
        assert _code(err.value) is grpc.StatusCode.INVALID_ARGUMENT
        assert "recompute_ratio" in str(err.value)


def test_without_the_token_the_cluster_answers_only_health(served) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    addr, http, _, _ = served
    with RagClient(addr) as client:
        with pytest.raises(Exception) as err:
            "".join(client.query(QUESTION, collection="docs"))
        assert _code(err.value) is grpc.StatusCode.UNAUTHENTICATED
    with RagClient(addr, token="wrong") as client:
        with pytest.raises(Exception) as err:
            client.list_collections()
        assert _code(err.value) is grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(addr) as channel:  # a load balancer probes without credentials
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    body = {"model": "docs", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
    req = urllib.request.Request(f"{http}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=60)
    assert http_err.value.code == 401


def test_ray_serves_neither_reflection_nor_its_route_list_without_a_key(served) -> None:
    """Issue 71: Ray Serve's proxies answer some calls themselves, before RagService checks the
    key. Server reflection (on by default in Ray's gRPC proxy) would describe the API to anyone,
    and Ray's own RayServeAPIService.ListApplications and the HTTP proxy's /-/routes list the
    applications: none is served. The health probes a load balancer makes still answer."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    addr, http, _, _ = served
    with grpc.insecure_channel(addr) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=30))
        assert err.value.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED), err.value
        from ray.serve.generated import serve_pb2  # Ray's own service: its application list is not served either

        listed = channel.unary_unary("/ray.serve.RayServeAPIService/ListApplications",
                                     request_serializer=serve_pb2.ListApplicationsRequest.SerializeToString,
                                     response_deserializer=serve_pb2.ListApplicationsResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            listed(serve_pb2.ListApplicationsRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value
        assert cluster.APP_NAME not in (err.value.details() or "").replace("ragkv's cluster", "")
        health = channel.unary_unary("/ray.serve.RayServeAPIService/Healthz",
                                     request_serializer=serve_pb2.HealthzRequest.SerializeToString,
                                     response_deserializer=serve_pb2.HealthzResponse.FromString)
        assert health(serve_pb2.HealthzRequest(), timeout=30).message  # a load balancer's probe still answers
    for path in ("/-/routes", "/-/routes/"):
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(f"{http}{path}", timeout=30)
        assert http_err.value.code == 404, path
        assert b"routes" not in http_err.value.read().replace(b"list its routes", b"")  # no route named
    with urllib.request.urlopen(f"{http}/-/healthz", timeout=30) as reply:
        assert reply.status == 200


def _code(exc: BaseException) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None)
    return code() if callable(code) else code


def _loop_turns(step: int) -> list[ChatTurn]:
    turns: list[ChatTurn] = []
    for i in range(step):
        call = ToolCall(f"call_{i}", "lookup", f'{{"page": {i}}}')
        turns += [ChatTurn(ChatRole.ASSISTANT, "", (call,)),
                  ChatTurn(ChatRole.TOOL, f"page {i}: the archive lists 4703.", tool_call_id=call.id)]
    return turns


def test_an_agent_loop_stays_on_one_replica_and_reuses_its_kv_tree(served) -> None:
    addr, _, _, _ = served
    question = "Which player chose the secret number of topic 5?"
    with RagClient(addr, token=TOKEN) as client:
        for step in range(4):
            answer = client.query(question, collection="docs", mode="blend", top_k=3, max_new_tokens=4,
                                  agent_turns=_loop_turns(step))
            "".join(answer)
            usage = answer.result().usage
            if step > 0:  # every later call lands where the conversation's KV is
                assert usage.tree_prompt_tokens > 0, f"step {step} computed its whole prompt again"


def test_a_responses_conversation_continues_on_the_replica_holding_it(served) -> None:
    """Over the cluster's HTTP API: `previous_response_id` routes to the replica that answered
    the response (the ingress pinned the conversation there), which reads it from its KV tree."""
    import openai

    client = openai.OpenAI(base_url=f"{served.http}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    extra = {"mode": "blend", "top_k": 3}
    response = client.responses.create(model="docs", input="Which player chose the secret number of topic 6?",
                                       max_output_tokens=4, extra_body=extra)
    for step in range(3):
        call = {"type": "function_call", "call_id": f"call_{step}", "name": "lookup", "arguments": "{}"}
        result = {"type": "function_call_output", "call_id": f"call_{step}", "output": f"page {step}: 4703."}
        response = client.responses.create(model="docs", previous_response_id=response.id, input=[call, result],
                                           max_output_tokens=4, extra_body=extra)
        assert response.model_extra["ragkv"]["tree_prompt_tokens"] > 0, f"step {step} missed its replica's tree"


def test_a_replica_killed_mid_answer_ends_it_unavailable_and_comes_back(served) -> None:
    import ray

    addr, _, _, _ = served
    with RagClient(addr, token=TOKEN) as client:
        answer = client.query(QUESTION, collection="docs", mode="full", max_new_tokens=1000)
        stream = iter(answer)
        next(stream)  # the answer has begun
        replicas = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith(f"SERVE_REPLICA::{cluster.APP_NAME}#EngineReplica#")]
        assert len(replicas) == 2
        for name in replicas:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        started = time.monotonic()
        with pytest.raises(Exception) as err:
            for _ in stream:
                pass
        assert time.monotonic() - started < 60, "the client waited on a dead replica"
        assert _code(err.value) is grpc.StatusCode.UNAVAILABLE
        assert "mid-answer" in str(err.value)
        # Ray Serve starts new replicas; the cluster answers again
        deadline = time.monotonic() + 120
        while True:
            try:
                text = "".join(client.query(QUESTION, collection="docs", mode="blend", max_new_tokens=4))
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        assert text


# -- the ingress's runner, on its own: retries before the answer begins ------------------------


class _Stream:
    def __init__(self, events: list[object], fail_after: int | None) -> None:
        self._events, self._fail_after, self.cancelled = events, fail_after, False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self):
        for i, event in enumerate(self._events):
            if i == self._fail_after:
                raise ActorDiedError()
            yield event
            await asyncio.sleep(0)


class _Engines:
    """A deployment handle whose replicas die as the test says, one stream per call."""

    def __init__(self, streams: list[_Stream]) -> None:
        self.streams, self.calls = streams, []

    def options(self, **_: object) -> _Engines:
        return self

    @property
    def answer(self) -> _Engines:
        return self

    def remote(self, asked: cluster.Asked, hits: object, route: RouteKeys) -> _Stream:
        self.calls.append(route)
        return self.streams[len(self.calls) - 1]


class _Backend:
    def search(self, query: object) -> tuple[list[object], RouteKeys]:
        return [], RouteKeys()


def _events() -> list[object]:
    chunk = RetrievedChunk("c1", 1.0, "text", {}, None, 3)
    stats = QueryStats(Usage(10, 2, 0), ttft_seconds=9.0, total_seconds=9.0, phase_seconds={}, recompute_fraction=0.2,
                       mode=Mode.BLEND, finish_reason=FinishReason.LENGTH, text="ab")
    return [ChunksEvent((chunk,)), TokenEvent("a"), TokenEvent("b"), stats]


def _run(engines: _Engines, retries: int = 2) -> list[object]:
    from concurrent.futures import ThreadPoolExecutor

    runner = cluster.RoutedRunner(engines=engines, admission=Admission(4), metrics=ServerMetrics(),
                                  pool=ThreadPoolExecutor(1), retries=retries)

    async def collect() -> list[object]:
        return [e async for e in runner.run(_Backend(), Query("q"), arrived=time.perf_counter(),
                                            cancel=threading.Event())]

    return asyncio.run(collect())


def test_a_request_whose_replica_dies_before_its_first_token_is_answered_by_another() -> None:
    engines = _Engines([_Stream(_events(), fail_after=1), _Stream(_events(), fail_after=None)])
    events = _run(engines)
    assert len(engines.calls) == 2
    # the client sees one answer: the lost replica's chunks were held back, never sent
    assert [type(e).__name__ for e in events] == ["ChunksEvent", "TokenEvent", "TokenEvent", "QueryStats"]
    assert events[-1].ttft_seconds < 9.0  # timed by the ingress, from the request's arrival


def test_a_request_whose_replica_dies_mid_answer_is_unavailable_not_retried() -> None:
    engines = _Engines([_Stream(_events(), fail_after=2), _Stream(_events(), fail_after=None)])
    with pytest.raises(ReplicaLostError, match="mid-answer") as err:
        _run(engines)
    assert len(engines.calls) == 1
    assert status_for(err.value)[0] is grpc.StatusCode.UNAVAILABLE


def test_retries_end_unavailable_when_every_replica_dies() -> None:
    engines = _Engines([_Stream(_events(), fail_after=0) for _ in range(3)])
    with pytest.raises(Exception) as err:
        _run(engines, retries=2)
    assert len(engines.calls) == 3
    assert status_for(err.value)[0] is grpc.StatusCode.UNAVAILABLE


class _ConversationBackend(_Backend):
    """Routes as the ingress does: no chunks, the conversation `route_keys` names."""

    modes = frozenset(Mode)

    def search(self, query: Query) -> tuple[list[object], RouteKeys]:
        return [], cluster.route_keys(query, [])


def test_previous_response_id_goes_to_the_replica_that_answered_its_conversation() -> None:
    """The Responses API over the ingress's runner: a response's continuation is routed pinned
    to the replica that answered it (its `Answering`); another conversation is not."""
    from concurrent.futures import ThreadPoolExecutor

    from starlette.testclient import TestClient

    from ragkv.server.openai_api import OpenAIApi
    from ragkv.server.responses_api import with_responses
    from ragkv.server.validation import RequestLimits

    engines = _Engines([_Stream([cluster.Answering(f"replica-{i}"), *_events()], None) for i in range(4)])
    runner = cluster.RoutedRunner(engines=engines, admission=Admission(4), metrics=ServerMetrics(),
                                  pool=ThreadPoolExecutor(1), retries=0)
    backend = _ConversationBackend()
    api = OpenAIApi(runner=runner, admission=Admission(4), limits=RequestLimits(), metrics=ServerMetrics(),
                    backend=lambda: backend)
    with TestClient(with_responses(api)) as http:
        def create(**body: object) -> dict:
            response = http.post("/v1/responses", json={"model": "default", **body})
            assert response.status_code == 200, response.text
            return response.json()

        first = create(input="who wrote it")
        second = create(input="and when", previous_response_id=first["id"])
        create(input="and where", previous_response_id=second["id"])
        create(input="something else entirely")
    routes = engines.calls
    assert routes[0].pinned is None  # a new conversation: routing decides
    assert routes[1].conversation == routes[0].conversation and routes[1].pinned == "replica-0"
    assert routes[2].pinned == "replica-1"  # the replica that answered the conversation last
    assert routes[3].conversation != routes[0].conversation and routes[3].pinned is None
    # `Answering` is the ingress's: the client's events are the answer's alone
    assert first["output"][0]["content"][0]["text"] == "ab"


def test_the_ingress_serves_a_hybrids_one_mode(tmp_path: Path) -> None:
    """The ingress never loads the model: it reads a model directory's type, and a hybrid's
    replicas serve FULL only (its default mode falls back to it, others are refused there)."""
    hybrid, dense, multimodal = tmp_path / "hybrid", tmp_path / "dense", tmp_path / "qwen3.5"
    for d, model_type in ((hybrid, "qwen3_next"), (dense, "llama")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    multimodal.mkdir()
    (multimodal / "config.json").write_text(json.dumps({"model_type": "qwen3_5",
                                                        "text_config": {"model_type": "qwen3_5_text"}}))
    assert cluster._served_modes(str(hybrid)) == {Mode.FULL} == cluster._served_modes(str(multimodal))
    assert cluster._served_modes(str(dense)) == set(Mode)
    assert cluster._served_modes("smollm2-135m-instruct") == set(Mode)  # a shipped name: not a hybrid
    assert cluster._served_modes(None) == set(Mode)
