"""`ragkv bench --replicas 2 --routing chunk,pow2`: where requests land, and what it costs.

One run on one machine (local Ray, CPU): build an index whose chunk KV lives on a disk tier
every replica shares, then for each routing policy deploy `--replicas` engine replicas
(fresh, cold tiers) with a CPU tier that holds a quarter of the corpus's KV
(`--cpu-share`), and run the same workload against each:

- questions with locality: a Zipf over topics (each topic is one stdlib module's documentation,
  about four chunks, `--topics` of them; a question is a few words of one of its chunks), from
  several client threads at once;
- agent loops among them: a question, then tool calls with their results, in one conversation.

Per policy it prints the fast-tier hit rate (chunks whose KV came from a replica's GPU or
CPU tier, over every chunk not served by the KV tree: disk reads and computes count as
slow), server-side TTFT p50/p95, the calls the KV tree served (`kv_tree_hits`) and the
share of agent calls after the first that found their conversation's tree. Beside each, the
bounds placement alone sets on that policy's own loads (`one_tier_hit_rate`: one replica's
CPU tier seeing every load; `pooled_tiers_hit_rate`: one tier as large as all replicas'
together, i.e. perfect placement): on N replicas, no router beats pow2 by more than their
ratio, whatever it scores. Then, with
the chunk policy deployed again, one replica is killed while requests run: every request
must end (answered, or UNAVAILABLE), none hangs.

With `--peer-tier on,off` each policy runs with the replicas' peer tier and without it
(`kvstore.tiers.peer`): beside the fast-tier hit rate, the local-plus-peer hit rate and its share
of the pooled bound, and TTFT with peers over without. With `--shared-tier s3` the corpus's KV
lives in an S3 bucket (moto on loopback) and no disk is shared, as a deploy keeps it
(`--s3-latency-ms` and `--s3-mbps` make each S3 answer come as from a bucket a network away,
first byte late and bytes paced: loopback answers at memory speed, which no deploy sees); with the
default (the index's own folder, shared on this host) a replica's misses are local disk reads,
which the peer tier, looked at after the local disk, never sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.types import ChatRole, ChatTurn, Mode, Tier, ToolCall

_FAST = (Tier.GPU, Tier.CPU)


@dataclass(slots=True)
class _Tally:
    ttft: list[float] = field(default_factory=list)  # server-side seconds
    fast: int = 0  # chunks from a GPU or CPU tier
    slow: int = 0  # chunks read from disk/S3 or computed, or from a peer
    peer: int = 0  # ... of them, chunks read from another replica's host tier (the peer tier)
    by_tier: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # chunks by where their KV came from
    tree_hits: int = 0  # calls with prompt tokens from the KV tree
    agent_later: int = 0  # agent calls after a loop's first
    agent_later_on_tree: int = 0  # ... that found their conversation's KV tree
    errors: int = 0
    loads: list[tuple[str, int]] = field(default_factory=list)  # (KV read, tokens) per load
    lock: threading.Lock = field(default_factory=threading.Lock)


# Topics of their own vocabulary: one stdlib module's documentation each (about 4,000
# characters of it, four 256-token chunks), so a question about one retrieves mostly its chunks.
TOPIC_MODULES = ("argparse", "collections", "json", "inspect", "statistics", "itertools", "subprocess",
                 "asyncio", "logging", "re", "shutil", "tempfile", "os", "socket", "unittest", "typing",
                 "textwrap", "difflib", "pickle", "http.client", "urllib.request", "configparser", "ssl",
                 "optparse", "uuid", "io", "traceback", "smtplib", "imaplib")


def _build_index(out: Path, model: str, device: str | None, dtype: str | None, topics: int) -> Path:
    """`topics` documents, each about 4,000 characters of one stdlib module's documentation
    (four 256-token chunks), KV precomputed on the index's disk tier.

    Raises:
        ValueError: more topics asked for than `TOPIC_MODULES` has.
    """
    from ragkv.evals.synthetic import module_paragraphs
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    if not 2 <= topics <= len(TOPIC_MODULES):
        raise ValueError(f"--topics must be in [2, {len(TOPIC_MODULES)}] (one stdlib module each), got {topics}")
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(TOPIC_MODULES[:topics]):
        (corpus / f"topic{i:02d}-{name}.txt").write_text(" ".join(module_paragraphs(name))[:4000])
    index = out / "index"
    run_index(IndexJobConfig(corpus, index, model=model, chunking=ChunkingConfig(size=256, overlap=0),
                             **({"device": device} if device else {}), **({"dtype": dtype} if dtype else {})))
    return index


def _topics(index: Path) -> tuple[list[list[str]], int]:
    """Each document's chunk texts (a topic), and the index's chunk tokens in all."""
    from ragkv.retriever.chunk_db import ChunkDB

    db = ChunkDB.open(index, readonly=True)
    tokens = 0
    try:
        by_doc: dict[str, list[str]] = defaultdict(list)
        for rec in db.iter_chunks():
            by_doc[rec.doc_id].append(rec.text)
            tokens += len(rec.token_ids)
    finally:
        db.close()
    return [by_doc[d] for d in sorted(by_doc)], tokens


def _workload(topics: list[list[str]], n: int, agent_every: int, zipf_s: float, seed: int) -> list[tuple]:
    """n work items: ("ask", question) or ("loop", question), topics drawn by Zipf."""
    rng = random.Random(seed)
    order = list(range(len(topics)))
    rng.shuffle(order)  # which topic is popular is arbitrary
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(order))]
    items = []
    for i in range(n):
        topic = topics[rng.choices(order, weights)[0]]
        words = rng.choice(topic).split()
        start = rng.randrange(max(1, len(words) - 12))
        question = f"Question {i}: what does this say: " + " ".join(words[start:start + 12]) + "?"
        items.append(("loop" if agent_every and i % agent_every == agent_every - 1 else "ask", question))
    return items


def _loop_turns(step: int) -> list[ChatTurn]:
    turns: list[ChatTurn] = []
    for i in range(step):
        call = ToolCall(f"call_{i}", "lookup", json.dumps({"page": i + 1}))
        turns += [ChatTurn(ChatRole.ASSISTANT, "", (call,)),
                  ChatTurn(ChatRole.TOOL, f"Page {i + 1} of the documentation says the same.", tool_call_id=call.id)]
    return turns


def plain_reads(neighbours: dict | None, mode: Mode, focus_handover: bool) -> tuple[bool, bool]:
    """Whether the prompt's first chunk, and a later one, read their plain KV on an index whose
    manifest records `neighbours` (None: built without), in `mode`; else the neighbour KV the
    index recorded. The server's own rule (`NeighbourOptions.serves_plain`)."""
    from ragkv.retriever.chunk_keys import NeighbourOptions

    opts = NeighbourOptions.from_dict(neighbours)
    return opts.serves_plain(mode, focus_handover, first=True), opts.serves_plain(mode, focus_handover, first=False)


def load_key(chunk_id: str, plain: bool) -> str:
    """The tier entry a load reads: a chunk's plain KV and its neighbour KV are two entries."""
    return chunk_id if plain else f"{chunk_id}#neighbours"


def _ask(client, question: str, tally: _Tally, max_new: int, top_k: int,  # RagClient
         step: int | None = None, plain: tuple[bool, bool] = (True, True)) -> None:
    try:
        stream = client.query(question, top_k=top_k, max_new_tokens=max_new,
                              agent_turns=_loop_turns(step or 0))
        for _ in stream:
            pass
        stats = stream.result()
    except Exception:  # counted; the bench goes on
        with tally.lock:
            tally.errors += 1
        return
    # a load is of the KV a chunk is served from (`plain`: the prompt's first chunk's, a later one's)
    loaded = [(c, load_key(c.chunk_id, plain[i > 0])) for i, c in enumerate(stream.chunks)
              if c.kv_tier is not Tier.TREE]
    tiers = [c.kv_tier for c, _ in loaded]
    with tally.lock:
        tally.loads += [(key, c.num_tokens) for c, key in loaded]
        tally.ttft.append(stats.ttft_seconds)
        tally.fast += sum(t in _FAST for t in tiers)
        tally.slow += sum(t not in _FAST for t in tiers)
        tally.peer += sum(t is Tier.PEER for t in tiers)
        for t in tiers:
            tally.by_tier["computed" if t is None else t.value] += 1
        tally.tree_hits += stats.usage.tree_prompt_tokens > 0
        if step:
            tally.agent_later += 1
            tally.agent_later_on_tree += stats.usage.tree_prompt_tokens > 0


def _run_workload(addr: str, items: list[tuple], clients: int, steps: int, max_new: int, top_k: int,
                  plain: tuple[bool, bool], token: str | None = None) -> _Tally:
    from ragkv.client import RagClient

    tally, todo, lock = _Tally(), list(reversed(items)), threading.Lock()

    def worker() -> None:
        with RagClient(addr, timeout=600, token=token) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    kind, question = todo.pop()
                if kind == "ask":
                    _ask(client, question, tally, max_new, top_k, plain=plain)
                else:
                    for step in range(steps):
                        _ask(client, question, tally, max_new, top_k, step, plain=plain)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1], 4) if len(xs) > 1 \
        else round(xs[0], 4)


class LRUTier:
    """A CPU tier as the bounds model it: least recently read out first, `capacity_tokens` of
    chunk KV, every read kept (a chunk larger than the tier is never held)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.held: OrderedDict[str, int] = OrderedDict()  # chunk -> tokens, least recent first
        self._tokens = 0

    def read(self, chunk: str, tokens: int) -> bool:
        """Read `chunk` (`tokens` long): whether the tier held it; it does now, if it fits."""
        if chunk in self.held:
            self.held.move_to_end(chunk)
            return True
        self.held[chunk] = tokens
        self._tokens += tokens
        while self._tokens > self.capacity_tokens and self.held:
            self._tokens -= self.held.popitem(last=False)[1]
        return False


def lru_hit_rate(loads: list[tuple[str, int]], capacity_tokens: int) -> float | None:
    """The hit rate of one LRU cache of `capacity_tokens` over `loads` ((chunk, tokens), in
    order): what a CPU tier of that size, seeing every load, would have held."""
    tier = LRUTier(capacity_tokens)
    hits = sum(tier.read(chunk, tokens) for chunk, tokens in loads)
    return round(hits / len(loads), 3) if loads else None


def _bounds(t: _Tally, replicas: int, cpu_tokens: int) -> dict:
    """What placement alone can do, on this policy's own sequence of loads: one replica's CPU
    tier seeing every load (a policy that does not place: each replica's tier caches the
    whole stream), and one tier as large as all replicas' together (perfect placement, no
    KV held twice). Loads are counted by the tier entry read (`load_key`: one chunk's plain KV
    and its neighbour KV are two, read as the server's mode reads them). Chunk routing moves
    the hit rate from about the first towards the second (`share_of_placement_gain`): one
    request runs on one replica, so the chunks it shares with another replica's sets miss."""
    pooled = lru_hit_rate(t.loads, cpu_tokens * replicas)
    loads = t.fast + t.slow
    return {"one_tier_hit_rate": lru_hit_rate(t.loads, cpu_tokens), "pooled_tiers_hit_rate": pooled,
            "local_plus_peer_of_pooled": round((t.fast + t.peer) / loads / pooled, 2) if loads and pooled else None}


def _summary(t: _Tally) -> dict:
    loads = t.fast + t.slow
    return {"fast_tier_hit_rate": round(t.fast / loads, 3) if loads else None,
            "peer_hit_rate": round(t.peer / loads, 3) if loads else None,
            "local_plus_peer_hit_rate": round((t.fast + t.peer) / loads, 3) if loads else None,
            "ttft_p50_s": _quantile(t.ttft, 0.5), "ttft_p95_s": _quantile(t.ttft, 0.95),
            "ttft_p99_s": _quantile(t.ttft, 0.99),
            "kv_tree_hits": t.tree_hits,
            "agent_calls_on_tree": round(t.agent_later_on_tree / t.agent_later, 3) if t.agent_later else None,
            "chunk_loads": loads, "chunks_by_source": dict(t.by_tier), "requests": len(t.ttft), "errors": t.errors}


def _fault(addr: str, items: list[tuple], max_new: int, top_k: int, app: str, token: str | None = None) -> dict:
    """Kill one engine replica while requests run: count answered, UNAVAILABLE and hung."""
    import ray

    from ragkv.client import RagClient

    outcomes: dict[str, int] = defaultdict(int)
    lock = threading.Lock()

    def one(question: str) -> None:
        try:
            with RagClient(addr, timeout=120, token=token) as client:
                stream = client.query(question, top_k=top_k, max_new_tokens=max_new)
                for _ in stream:
                    pass
                stream.result()
            outcome = "answered"
        except Exception as exc:  # sorted by status
            code = getattr(exc, "code", None)
            outcome = code().name.lower() if callable(code) else type(exc).__name__
        with lock:
            outcomes[outcome] += 1

    threads = [threading.Thread(target=one, args=(q,), daemon=True) for _, q in items]
    for t in threads:
        t.start()
        time.sleep(0.05)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#EngineReplica#")]
    if names:
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 180
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    return {"requests": len(items), "hung": hung, **dict(outcomes)}


_HOST_GAUGES = ("host_tier_bytes", "host_tier_shared_bytes", "peer_published_bytes")


def _scrape(metrics_port: int) -> dict:
    """From the ingress's /metrics: its routing decisions by reason (ragkv_route_decisions_total),
    and with the peer tier the host memory chunk KV takes, over the replicas as they last
    reported it: their host tiers', what they published, how much of the first is the second
    (`MemoryTier.share`), and so what the hosts hold (`held`: each chunk once)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    out: dict = {"route_decisions": {s.labels["reason"]: int(s.value) for f in families
                                     if f.name == "ragkv_route_decisions" for s in f.samples
                                     if s.name.endswith("_total")}}
    gauges = {name: sum(int(s.value) for f in families if f.name == f"ragkv_replica_{name}" for s in f.samples)
              for name in _HOST_GAUGES}
    if any(gauges.values()):
        out["host_kv_bytes"] = {**gauges, "held": gauges["host_tier_bytes"] + gauges["peer_published_bytes"]
                                - gauges["host_tier_shared_bytes"]}
    return out


class NetworkDelay:
    """WSGI middleware that makes a loopback S3 answer as one a network away does: each request
    waits `latency_s` before its first byte, and a body comes at `bytes_per_s` (per request, as
    S3 paces each GET stream; 0 = as fast as it is made). Sleeping costs no CPU, so the replicas
    sharing this host's cores are not slowed by it."""

    def __init__(self, app, latency_s: float, bytes_per_s: float) -> None:
        if latency_s < 0 or bytes_per_s < 0:
            raise ValueError(f"S3 latency and bandwidth must be >= 0, got {latency_s} s and {bytes_per_s} B/s")
        self.app, self.latency_s, self.bytes_per_s = app, latency_s, bytes_per_s

    def __call__(self, environ, start_response):
        if self.latency_s:
            time.sleep(self.latency_s)
        body = self.app(environ, start_response)
        return body if not self.bytes_per_s else self._paced(body)

    def _paced(self, body):
        try:
            for piece in body:
                time.sleep(len(piece) / self.bytes_per_s)
                yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


def _moto_server(port: int, latency_s: float = 0.0, bytes_per_s: float = 0.0):
    """moto's S3 server on loopback `port`, its answers delayed as a network's (`NetworkDelay`)."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # its access log: a line per S3 call
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    class _Delayed(ThreadedMotoServer):
        def _server_entry(self) -> None:  # moto's own, with the app wrapped
            app = NetworkDelay(DomainDispatcherApplication(create_backend_app), latency_s, bytes_per_s)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return _Delayed(ip_address="127.0.0.1", port=port, verbose=False)


def _s3_index(index: Path, tmp: Path, latency_s: float = 0.0, bytes_per_s: float = 0.0):
    """A copy of `index` whose chunk KV lives only in an S3 bucket (moto's server on loopback, its
    answers delayed by `latency_s` and paced at `bytes_per_s` when given: `NetworkDelay`), as a
    deploy keeps it: each replica reads S3 below its own tiers, and no disk is shared. Sets the
    AWS variables the replicas' boto3 reads (they inherit this process's environment)."""
    import shutil

    import boto3

    port = _free_port()
    server = _moto_server(port, latency_s, bytes_per_s)
    server.start()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "ragkv-bench",
                       "AWS_SECRET_ACCESS_KEY": "ragkv-bench", "AWS_REGION": "us-east-1"})
    bucket = "ragkv-bench"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    kv = index / "kv"
    for f in sorted(kv.rglob("*")):
        if f.is_file():  # the disk tier's layout is S3's: <model fp>/<shard>/<key>.safetensors
            client.upload_file(str(f), bucket, f"kv/{f.relative_to(kv).as_posix()}")
    copy = tmp / "s3-index"
    shutil.copytree(index, copy, ignore=shutil.ignore_patterns("kv"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["kv_uris"] = [f"s3://{bucket}/kv"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy, server


def _stop_directory() -> None:
    """The peer directory goes with its deploy: the next one's replicas publish afresh."""
    from ragkv.kvstore.tiers.peer_ray import kill_directory

    kill_directory()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _over_pow2(r: dict) -> dict:
    """Chunk routing against pow2 in the same run: hit rate, TTFT quantiles, and the share of the
    gain perfect placement allows over pow2 (chunk's own pooled bound) that chunk routing got."""
    chunk, pow2 = r["chunk"], r["pow2"]
    out = {"fast_tier_hit_rate": round(chunk["fast_tier_hit_rate"] / pow2["fast_tier_hit_rate"], 2)}
    for q in ("p50", "p95", "p99"):
        if chunk.get(f"ttft_{q}_s") and pow2.get(f"ttft_{q}_s"):
            out[f"ttft_{q}"] = round(chunk[f"ttft_{q}_s"] / pow2[f"ttft_{q}_s"], 2)
    room = (chunk.get("pooled_tiers_hit_rate") or 0.0) - pow2["fast_tier_hit_rate"]
    if room > 0:
        out["share_of_placement_gain"] = round((chunk["fast_tier_hit_rate"] - pow2["fast_tier_hit_rate"]) / room, 2)
    return out


def run_cluster_bench(args) -> int:  # argparse.Namespace from cli.bench
    from ragkv.retriever.manifest import read_manifest
    from ragkv.server import cluster
    from ragkv.server.routing import Policy
    from ragkv.server.settings import CollectionSpec, ServerSettings

    policies = [Policy(p) for p in args.routing.split(",")]
    if args.replicas < 2:
        raise ValueError(f"--replicas must be >= 2 for a routing bench, got {args.replicas}")
    if not 0.0 < args.cpu_share <= 1.0:
        raise ValueError(f"--cpu-share must be in (0, 1], got {args.cpu_share}")
    with tempfile.TemporaryDirectory(prefix="ragkv-cluster-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, args.device, args.dtype, args.topics)
        kv_bytes = sum(f.stat().st_size for f in (index / "kv").rglob("*") if f.is_file())
        s3_server = None
        if (args.s3_latency_ms or args.s3_mbps) and args.shared_tier != "s3":
            raise ValueError("--s3-latency-ms and --s3-mbps delay the S3 tier: give --shared-tier s3 with them")
        if args.shared_tier == "s3":
            with contextlib.redirect_stdout(sys.stderr):  # moto says it started on stdout: --json keeps stdout
                index, s3_server = _s3_index(index, Path(tmp), args.s3_latency_ms / 1000, args.s3_mbps * 1e6)
        topics, index_tokens = _topics(index)
        cpu_tokens = int(index_tokens * args.cpu_share)  # one replica's CPU tier, in chunk tokens
        items = _workload(topics, args.requests, args.agent_every, args.zipf, seed=args.seed)
        port, metrics_port = _free_port(), _free_port()
        # the cluster serves gRPC only with credentials (its proxy listens on every interface): a
        # token of this run's own, which the bench's clients send
        token = secrets.token_urlsafe(24)
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        settings = ServerSettings(auth_token_file=token_file,
            indexes=(CollectionSpec("default", index),), host="127.0.0.1", port=port, http_port=None,
            metrics_port=metrics_port, model=None if args.index else args.model, kv_cpu_bytes=int(kv_bytes * args.cpu_share),
            **({"device": args.device} if args.device else {}), **({"dtype": args.dtype} if args.dtype else {}))
        addr = f"127.0.0.1:{port}"
        manifest = read_manifest(index)
        plain = plain_reads(manifest.neighbours if manifest else None, settings.default_mode, settings.focus_handover)
        peer_modes = [m.strip() for m in args.peer_tier.split(",") if m.strip()]
        if not peer_modes or set(peer_modes) - {"on", "off"}:
            raise ValueError(f"--peer-tier takes on, off or both (on,off), got {args.peer_tier!r}")
        report: dict = {"routing": {}}
        # Ray's processes write to this process's stdout (a raylet's warnings): while they run,
        # stdout is stderr, so the report stays the one thing on stdout (--json)
        sys.stdout.flush()
        stdout = os.dup(1)
        os.dup2(2, 1)
        try:
            for policy in policies:
                for peers in peer_modes:
                    name = policy.value + ("+peers" if peers == "on" else "")
                    print(f"routing {name}: deploying {args.replicas} replicas ...", file=sys.stderr, flush=True)
                    cluster.start(settings, cluster.ClusterSettings(args.replicas, routing=policy,
                                                                    route_slack=args.route_slack,
                                                                    cpus_per_replica=args.cpus_per_replica,
                                                                    peer_tier=peers == "on"))
                    t0 = time.perf_counter()
                    tally = _run_workload(addr, items, args.clients, args.loop_steps, args.max_new_tokens,
                                          args.top_k, plain, token)
                    report["routing"][name] = {**_summary(tally), **_bounds(tally, args.replicas, cpu_tokens),
                                               **_scrape(metrics_port),
                                               "seconds": round(time.perf_counter() - t0, 1)}
                    print(f"routing {name}: {report['routing'][name]}", file=sys.stderr, flush=True)
                    cluster.undeploy()
                    _stop_directory()  # the next deploy starts with no published copies
            if args.fault:
                cluster.start(settings, cluster.ClusterSettings(args.replicas, routing=Policy.CHUNK,
                                                                cpus_per_replica=args.cpus_per_replica,
                                                                peer_tier="on" in peer_modes))
                report["fault"] = _fault(addr, items[:args.fault], args.max_new_tokens, args.top_k, cluster.APP_NAME,
                                         token)
                print(f"fault: {report['fault']}", file=sys.stderr, flush=True)
        finally:
            cluster.stop()
            if s3_server is not None:
                s3_server.stop()
            sys.stdout.flush()
            os.dup2(stdout, 1)
            os.close(stdout)
    r = report["routing"]
    if "chunk" in r and "pow2" in r and r["pow2"]["fast_tier_hit_rate"]:
        report["chunk_over_pow2"] = _over_pow2(r)
    for policy in ("chunk", "pow2"):  # what the peer tier adds to a policy, in the same run
        on, off = r.get(f"{policy}+peers"), r.get(policy)
        if on and off:
            report[f"{policy}_peers_over_without"] = {
                q: round(on[f"ttft_{q}_s"] / off[f"ttft_{q}_s"], 2) for q in ("p50", "p95", "p99")
                if on.get(f"ttft_{q}_s") and off.get(f"ttft_{q}_s")}
    report["config"] = {"replicas": args.replicas, "requests": args.requests, "clients": args.clients,
                        "topics": len(topics), "top_k": args.top_k, "zipf_s": args.zipf,
                        "agent_every": args.agent_every, "agent_steps": args.loop_steps,
                        "cpu_tier_share_of_corpus": args.cpu_share, "route_slack": args.route_slack,
                        "peer_tier": args.peer_tier,
                        "seed": args.seed,
                        "corpus_kv_bytes": kv_bytes, "model": args.model,
                        "shared_tier": "disk (the index's own)" if args.shared_tier == "disk"
                        else "s3 (moto on loopback; no disk tier)",
                        "s3_latency_ms": args.s3_latency_ms, "s3_mbps": args.s3_mbps or None,
                        "baseline": "pow2 (Ray Serve's default power of two choices), same workload, same run"}
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    return 0


def _print(report: dict) -> None:
    print("routing      fast-tier hit rate  +peer  (one tier, pooled)  TTFT p50   TTFT p95   TTFT p99   tree hits  "
          "agent calls on tree  errors")
    for name, r in report["routing"].items():
        print(f"{name:<12} {r['fast_tier_hit_rate']!s:>18}  {r['local_plus_peer_hit_rate']!s:>5}  "
              f"({r['one_tier_hit_rate']!s:>8}, {r['pooled_tiers_hit_rate']!s:>6})"
              f"  {r['ttft_p50_s']!s:>8} s {r['ttft_p95_s']!s:>8} s {r['ttft_p99_s']!s:>8} s "
              f"{r['kv_tree_hits']:>9}  {r['agent_calls_on_tree']!s:>19}  {r['errors']:>6}")
        print(f"             route decisions: {r.get('route_decisions', {})}")
    for policy in ("chunk", "pow2"):
        if f"{policy}_peers_over_without" in report:
            print(f"{policy} with peers over without: "
                  + ", ".join(f"TTFT {q} {v}x" for q, v in report[f"{policy}_peers_over_without"].items()))
    if "chunk_over_pow2" in report:
        c = report["chunk_over_pow2"]
        print("chunk over pow2: " + ", ".join(f"{k} {v}" + ("" if k == "share_of_placement_gain" else "x")
                                             for k, v in c.items()))
    if "fault" in report:
        print(f"a replica killed under load: {report['fault']}")
