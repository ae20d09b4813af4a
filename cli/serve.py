"""`ragkv serve`: the argument parser and entry point of the query server.

Imports only argparse at module level; grpc, torch and the pipeline load when the
command runs, so `ragkv --help` works on a client-only install.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# flag dest -> help; every dest is a ServerSettings field (or named in _SETTING). Defaults are None so a
# missing flag leaves the value to the environment, the config file or the default.
_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("host", str, "gRPC and HTTP bind address (default 127.0.0.1); any other address needs --api-keys or "
                  "--auth-token-file, or --insecure-no-auth"),
    ("port", int, "gRPC port, 0 = any free port (default 50051)"),
    ("metrics_port", str, "Prometheus /metrics port, 'off' to disable (default 9464)"),
    ("metrics_host", str, "/metrics bind address; it takes no credentials (default 127.0.0.1)"),
    ("http_port", str, "OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/models, /health), "
                       "0 = any free port (default off)"),
    ("model", str, "model spec (HF dir, hub id, .gguf); default: the index's model"),
    ("device", str, "torch device; auto = cuda when torch sees a GPU, else cpu (default auto)"),
    ("dtype", str, "auto, float32, bfloat16 or float16; auto = bfloat16 on cuda, float32 on cpu (default auto)"),
    ("max_queue", int, "queries admitted at once; more get RESOURCE_EXHAUSTED (default 16)"),
    ("kv_budget_bytes", int, "KV cache bytes of all queries in flight; past it RESOURCE_EXHAUSTED (default 4 GiB)"),
    ("max_batch", int, "queries decoding together in one batched step at most (default 16)"),
    ("prompt_share", float, "while queries decode, the share of the engine's time prompt passes get: each slice "
                            "of prompt work between two decode steps lasts a decode step x share / (1 - share); "
                            "a step goes in when it would end within it (default 0.6)"),
    ("prompt_slice_s", float, "the shortest slice of prompt work between decode steps, seconds (default 0.05)"),
    ("prompt_step_tokens", str, "prompt tokens one step computes at most: a longer prompt's layers run in pieces, "
                                "so decode steps run between them (chunked prefill); 0 = whole layers; auto (the "
                                "default) = the tokens of one layer that take --prompt-slice-s at the engine's "
                                "measured speed (2048 until it has measured it)"),
    ("prompt_batch_rows", int, "prompt rows one step may carry from several queries' prompt passes that stand at "
                               "the same layer, run as one forward (the layer's weights read once for all); a "
                               "pass longer than that runs alone; 0 = one pass per step (default 512)"),
    ("decode_pool", str, "decode over one KV pool, every step of a batch bucket the same shapes: auto (on CUDA, "
                         "where a step of many small kernels is launch-bound), on, or off (ragged decode, each "
                         "request its own cache: the CPU's faster path); the pool holds --kv-budget-bytes, "
                         "requests' prompt caches are runs of it, and the KV tree keeps its --kv-tree-bytes "
                         "in it, so a conversation's KV passes between its calls and the tree with no copy"),
    ("cuda_graphs", str, "capture each batch bucket's pooled decode step as a CUDA graph (1, 2, 4 ... 64 rows): "
                         "auto (wherever CUDA is) or off"),
    ("retrieve_workers", int, "threads for retrieval and KV prefetch (default 1)"),
    ("grace_seconds", float, "seconds in-flight requests get on SIGTERM (default 30)"),
    ("auth_token_file", Path, "one shared bearer token, in a file (else $RAGKV_AUTH_TOKEN)"),
    ("api_keys", Path, "named API keys: a JSON list of {name, key or key_sha256, collections, requests_per_minute, "
                       "prompt_tokens_per_minute} (docs/security.md)"),
    ("max_request_bytes", int, "largest request (gRPC message or HTTP body) in bytes; larger ones are refused "
                               "unparsed (default 8 MiB)"),
    ("kv_tree_key_share", float, "the largest share of --kv-tree-bytes one API key's conversations may hold "
                                 "while another key's need room, (0, 1] (default 0.5)"),
    ("tls_cert", Path, "PEM certificate chain (TLS with --tls-key)"),
    ("tls_key", Path, "PEM private key"),
    ("kv_cpu_bytes", int, "bytes of KV kept in the CPU tier (default 2 GiB)"),
    ("kv_gpu_bytes", int, "bytes of KV kept in the GPU tier (default 0)"),
    ("kv_tree_bytes", int, "bytes of the KV tree: served prompts' KV kept on the engine's device, so a "
                           "conversation's next call computes only its new tokens; counted in --kv-budget-bytes (admission "
                           "evicts what no request holds); 0 = off (default 1 GiB)"),
    ("kv_tree_retain_max_s", float, "an answer that may end in tool calls keeps its KV-tree path ahead of LRU "
                                     "eviction until the agent's next call, at most this many seconds: a request's "
                                     "retain_seconds, else the tool latency learned (p90 of the gaps seen); 0 = plain "
                                     "LRU (default 60)"),
    ("kv_tree_retain_default_s", float, "the pins' time-to-live before any tool latency is seen (default 10)"),
    ("kv_tree_host_bytes", int, "KV-tree conversations moved off the device (least recently used first) are kept in "
                                "CPU memory up to this many bytes, then on disk (--kv-tree-dir); 0 = none "
                                "(default 2 GiB)"),
    ("kv_tree_dir", Path, "the KV tree's disk tier: conversations spilled past --kv-tree-host-bytes, and all of "
                          "them at shutdown, as checksummed KV files that the next server over this folder finds "
                          "again (default off)"),
    ("kv_tree_disk_bytes", int, "bytes the KV tree may keep in --kv-tree-dir (default 16 GiB)"),
    ("kv_tree_follow_ups", str, "on: a follow-up question that retrieves other chunks carries the conversation's "
                                "earlier turns from the KV tree as one more chunk, blended (blend mode); off: "
                                "they are computed again (default on)"),
    ("responses_dir", Path, "keep the Responses API's stored responses (store, previous_response_id) in this "
                            "directory too, one file each, so a restarted server finds them; one server per "
                            "directory (default off: in memory only, lost on restart)"),
    ("responses_max_count", int, "stored responses at most; the least recently used go first (default 10000)"),
    ("responses_max_bytes", int, "bytes of all stored responses' conversations, as JSON (default 256 MiB)"),
    ("responses_key_share", float, "while other API keys hold stored responses, a key past this share of "
                                   "--responses-max-count or --responses-max-bytes drops its own least recently used "
                                   "first, (0, 1] (default 0.5)"),
    ("responses_max_age_s", float, "seconds a stored response is found after it was stored; older ones are "
                                   "deleted (default 2592000: 30 days)"),
    ("kv_disk_dir", Path, "disk tier directory (default: the index's own)"),
    ("kv_s3_uri", str, "s3://bucket/prefix of the S3 tier (default off)"),
    ("kv_s3_writeback", str, "on: KV computed at serve time is written back to the S3 tier too; off: S3 is "
                             "read only (default on)"),
    ("kv_compression", str, "how KV computed at serve time is written back: auto (as the index was built, "
                            "see ragkv index --kv-compression), none, int8, fp8, int4 or int2 (default auto)"),
    ("kv_layered", str, "on: blend starts once a disk/S3 file's header is checked and reads each layer as it "
                        "arrives; off: read and verify whole files first (default on)"),
    ("kv_controller", str, "on: per chunk, read its KV or recompute it, whichever the tier's measured speed "
                           "and the prefill rate say is cheaper, abandoning a read that overruns; off: always "
                           "read what a tier holds (default on)"),
    ("default_mode", str, "mode when a request leaves it unspecified (default blend)"),
    ("default_recompute_ratio", float, "recompute ratio of blend (and of focus over several chunks) for a request "
                                       "that sets none; wins over the index's calibration (default: the "
                                       "calibrated choice at --fidelity-kl, else 0.15)"),
    ("fidelity_kl", str, "each collection serves the cheapest recompute ratio whose next-token KL to full "
                           "prefill its index's calibration (ragkv index --calibrate) predicts at most this, in "
                           "nats; logged at start-up; off = the default ratio (default 0.01)"),
    ("focus_keep", float, "focus mode keeps chunks scoring at least this x the best, (0, 1] (default 0.5)"),
    ("focus_handover", str, "on: focus keeping several chunks blends over all of them instead (and reads a "
                            "neighbour index's neighbour KV); off: it blends over the kept ones (default on)"),
    ("focus_spread", float, "with --focus-handover on: hand over only when the two runners-up score on average at "
                            "least this x the best, [0, 1]; 0 = whenever several are kept (default 0.66)"),
    ("focus_several", int, "with --focus-handover on: hand over also when at least this many chunks score within "
                           "--focus-keep of the best; 0 = never (default 3)"),
    ("focus_lookup_ratio", float, "focus answering a lookup over a neighbour index's KV (no handover): the share of "
                                  "its kept chunks' tokens recomputed, [0, 1]; 0 = none, their KV reused as stored; "
                                  "1 = all of them, exact over those chunks (default 0)"),
    ("focus_lookup_keep", float, "focus answering a lookup (no handover): keep the chunks scoring at least this x "
                                 "the best, (0, 1]; 1 = the best alone, beside a first chunk read from its plain KV "
                                 "(default 1)"),
    ("quality_guard_mass", float, "quality guard: blend runs a request as full prefill when holding this share of "
                                  "the question's attention needs more tokens than its recompute ratio, (0, 1] "
                                  "(default off; the fallbacks are the ragkv_quality_fallbacks_total metric)"),
    ("default_top_k", int, "chunks retrieved by default (default 4)"),
    ("max_top_k", int, "largest top_k accepted (default 32)"),
    ("default_max_new_tokens", int, "answer length of a request that sets no max_tokens (default: none, as OpenAI's "
                                    "API: until the model stops, up to the context left and --max-new-tokens)"),
    ("max_new_tokens", int, "the longest answer: the largest max_tokens accepted, and the cap on an answer "
                            "that sets none (default 1024)"),
    ("system_prompt_recompute_ratio", float, "blend's recompute ratio for a request with its own system prompt "
                                             "(--system-prompt-policy prefix) that sets none: none of its chunks' KV "
                                             "is exact after another prefix (default: --default-recompute-ratio)"),
    ("system_prompt_policy", str, "a request whose system message is not the one its index was built with: "
                                  "prefix computes it in front of the chunks (their KV moved after it and "
                                  "blended; each tenant's are kept in its KV tree), suffix places it after the "
                                  "chunks, strict refuses it (default prefix)"),
    ("log_level", str, "logging level (default INFO)"),
    ("default_search_mode", str, "search when a request names none: dense, lexical or hybrid (default hybrid)"),
    ("fusion", str, "hybrid fusion: rrf (reciprocal rank fusion) or weighted (default rrf)"),
    ("dense_weight", float, "hybrid: weight of dense results (default 1.0)"),
    ("lexical_weight", float, "hybrid: weight of lexical (BM25) results (default 1.0)"),
    ("search_candidates", int, "chunks each search hands to fusion and the reranker (default 50)"),
    ("reranker", Path, "a sentence-transformers cross-encoder folder: rerank the fused candidates (default off)"),
    ("faiss_device", str, "where the FAISS index searches: cpu, or cuda (the gpu extra's faiss-gpu; the index "
                          "is moved to every GPU FAISS sees) (default cpu)"),
)


_SETTING = {"api_keys": "api_keys_file"}  # flag dest -> its ServerSettings field, where they differ


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the `ragkv` subcommand parser."""
    p = sub.add_parser(
        "serve",
        help="run the gRPC query server",
        description="Serve Query/Retrieve over gRPC for one or more index directories. "
        "Every option can also come from RAGKV_<OPTION> in the environment or a --config file; "
        "flags win over the environment, which wins over the file.",
    )
    p.add_argument(
        "--index", dest="indexes", action="append", default=[], metavar="[NAME=]DIR",
        help="index directory (or s3://bucket/prefix, synced into $RAGKV_CACHE_DIR/indexes first) to "
             "serve as collection NAME (a bare DIR is 'default'); repeatable",
    )
    p.add_argument("--config", type=Path, default=None, help="TOML or JSON settings file")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-loopback --host with no credentials (logged as a warning); without it "
                        "ragkv serve refuses to start there")
    p.add_argument("--skip-model-check", action="store_true",
                   help="serve the model without the start-up correctness gate (ragkv check-model); logged "
                        "as a warning: answers of a model the engine computes wrongly are wrong")
    for dest, kind, text in _FLAGS:
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, type=kind, default=None, help=text)
    cluster = p.add_argument_group(
        "many replicas (the ray extra: pip install 'ragkv[ray]')",
        "With --replicas the same server runs as Ray Serve deployments: an ingress (gRPC through Ray "
        "Serve's gRPC proxy on --port, the OpenAI HTTP API on --http-port, default 8000) that retrieves "
        "and routes each request to the engine replica holding most of its chunks (docs/architecture.md). "
        "Without it, one process and no Ray.")
    cluster.add_argument("--replicas", type=int, default=None, metavar="N",
                         help="engine replicas: one per GPU (per process on a CPU host)")
    cluster.add_argument("--ray-address", default=None, metavar="ADDR",
                         help="join this Ray cluster ('auto' on a node started with `ray start`); "
                              "default: start a local one")
    cluster.add_argument("--gpus-per-replica", type=float, default=0.0, metavar="G",
                         help="GPUs Ray gives each replica: 1 on GPU workers (one replica per GPU); 0 runs "
                              "them on CPUs (default 0)")
    cluster.add_argument("--cpus-per-replica", type=float, default=1.0, metavar="C",
                         help="CPUs Ray gives each replica (default 1)")
    cluster.add_argument("--route-slack", type=float, default=1.0, metavar="PASSES",
                         help="chunk routing prices each replica's expected time to first token (its backlog plus "
                              "its chunk loads); replicas within this many prompt passes of the soonest count as "
                              "soon, and among them the one holding the request (or its chunk set's home) wins: "
                              "lower spreads load sooner, higher keeps chunk sets together (default 1.0)")
    cluster.add_argument("--routing", default="chunk", choices=("chunk", "pow2"),
                         help="chunk: to the replica expected to answer soonest by its backlog and where it holds "
                              "the request's chunks (and its conversation), chunk sets placed by rendezvous hashing; "
                              "pow2: power-of-two choices only (default chunk)")
    cluster.add_argument("--peer-tier", default="on", choices=("on", "off"),
                         help="pool the replicas' host tiers: each publishes the chunk KV it computes or reads from "
                              "disk or S3 to Ray's object store, and a replica missing a chunk reads a peer's copy "
                              "(verified by its checksums) before S3 or computing it (default on)")
    cluster.add_argument("--peer-tier-bytes", type=_byte_count, default=None, metavar="BYTES",
                         help="bytes of chunk KV each replica publishes at most, least recently used out first "
                              "(e.g. 8GiB; default: its --kv-cpu-bytes). They live in Ray's object store (shared "
                              "memory): size the object store for them. On a host without CUDA the CPU tier holds "
                              "what is published there, once; a GPU host's CPU tier (pinned) keeps a copy of its own")
    p.set_defaults(func=run_serve)
    return p


def _byte_count(text: str) -> int:
    """A byte count with a unit (8GiB, 512MiB, 1000000), > 0."""
    from ragkv.kvstore.config import parse_bytes

    n = parse_bytes(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a byte count must be > 0")
    return n


def settings_from_args(args: argparse.Namespace, env: dict[str, str] | None = None):  # -> ServerSettings
    """The ServerSettings that parsed `serve` arguments, the environment and --config give."""
    from ragkv.server.settings import load_settings

    flags = {_SETTING.get(dest, dest): getattr(args, dest) for dest, _, _ in _FLAGS}
    flags["insecure_no_auth"] = True if getattr(args, "insecure_no_auth", False) else None
    flags["indexes"] = tuple(args.indexes)
    flags["model_check"] = False if getattr(args, "skip_model_check", False) else None
    return load_settings(flags, env=env, config_file=args.config)


def as_server_process() -> None:
    """Set this process up as a server's, before any torch op: glibc keeps freed blocks for reuse
    (`engine/kv/host_allocator.py`), and the scheduler's thread computes on the cores, every other
    thread on one (`engine/host_threads.py`). `ragkv serve` and the benches that start a server."""
    from ragkv.engine.host_threads import compute_on_one_thread
    from ragkv.engine.kv.host_allocator import tune_host_allocator

    tune_host_allocator()
    compute_on_one_thread()


def run_serve(args: argparse.Namespace) -> int:
    """Load settings, then serve until SIGTERM; returns the exit status."""
    import asyncio
    import logging

    as_server_process()
    from ragkv.server.app import run

    settings = settings_from_args(args)
    if not settings.indexes:
        raise ValueError("no index to serve: pass --index [NAME=]DIR (or set RAGKV_INDEXES)")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ragkv.server.api_keys import check_exposure

    # fail closed before anything is fetched or loaded: no credentials, no network listener
    check_exposure(settings.host, settings.key_ring(), settings.insecure_no_auth)
    settings.served_model("")  # an s3:// index needs --model: refused before anything is fetched
    if args.replicas is not None and settings.tls_cert is not None:
        logging.getLogger(__name__).warning(
            "--replicas with --tls-cert: Ray Serve's HTTP proxy serves HTTPS on --http-port; its gRPC proxy "
            "speaks no TLS, so gRPC is not served (terminate TLS in front of it instead: docs/security.md)")
    from ragkv.server.assembly import fetch_indexes

    fetch_indexes(settings)

    if args.replicas is not None:
        return _run_cluster(settings, args)

    from ragkv.server.assembly import build_pipeline

    return asyncio.run(run(settings, build_pipeline))


def _run_cluster(settings, args: argparse.Namespace) -> int:  # settings: ServerSettings
    """`ragkv serve --replicas N`: deploy on Ray Serve, then wait until SIGTERM/SIGINT."""
    import logging
    import signal
    import threading

    try:
        from ragkv.server import cluster
    except ImportError as exc:
        raise SystemExit(f"ragkv serve --replicas needs Ray Serve ({exc}): pip install 'ragkv[ray]'") from None
    from ragkv.server.routing import Policy

    plan = cluster.ClusterSettings(args.replicas, args.ray_address, Policy(args.routing), args.route_slack,
                                   cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                                   peer_tier=args.peer_tier == "on", peer_tier_bytes=args.peer_tier_bytes)
    cluster.start(settings, plan)
    logging.getLogger(__name__).info(
        "ragkv serving %d replica(s) on Ray Serve: gRPC :%d, HTTP :%d, routing %s, peer tier %s", plan.replicas,
        settings.port, settings.http_port or 8000, plan.routing.value,
        f"on ({plan.peer(settings).budget_bytes} bytes a replica)" if plan.peer(settings) else "off")
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    cluster.stop()
    return 0
