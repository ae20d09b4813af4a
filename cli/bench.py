"""`ragkv bench`: TTFT of full prefill vs the blend modes, with KV read from a tier.

Everything runs in one process and one run: chunk KVs are precomputed once and put in
the named tier; each repeat reads them back from that tier (timed as kv_load) and runs
every mode, interleaved, so drift on the machine hits every mode alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ragkv.types import DType, Mode


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time full prefill against the blend modes, KV read from a tier",
        description="Precompute the KV of --chunks chunks of --chunk-tokens tokens (stdlib text), "
        "store them in --tier, then per repeat read them back and time each mode up to the first "
        "token. Prints the median TTFT per mode and the speedup over full prefill. Example: "
        "ragkv bench --chunks 8 --chunk-tokens 512 --modes full,reuse,blend --ratio 0.15 --tier disk --json")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--modes", default="full,reuse,blend", help="comma list of full, prefix, reuse, blend, focus")
    p.add_argument("--ratio", type=float, default=0.15, help="blend recompute ratio")
    p.add_argument("--selector", default="query", help="blend selector: query (default) or deviation")
    p.add_argument("--budget", default="global", help="blend: global (default) or chunk (each chunk its share)")
    p.add_argument("--tier", default="disk", help="where the KV is read from: cpu, disk, or disk:/path")
    p.add_argument("--kv-compression", default="none", choices=["none", "int8", "fp8", "int4", "int2"],
                   help="how the disk tier's files store K and V (docs/kv-compression.md; default none)")
    p.add_argument("--load", default="layered",
                   help="how chunk KV is read: layered (blend starts once headers are checked and each layer "
                        "waits for its own bytes; default), whole (every file read and verified first), or "
                        "whole,layered to compare them in one run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=[d.value for d in DType],
                   help="model dtype (default: auto, float32 on cpu)")
    p.add_argument("--decode-tokens", type=int, default=0, metavar="N",
                   help="also decode N greedy tokens after each prompt and report ms per token (default 0: off)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--plot", type=Path, nargs="+", metavar="EVAL.json",
                   help="instead of timing: plot accuracy against TTFT from `ragkv eval --json` results")
    p.add_argument("--plot-out", type=Path, default=Path("accuracy_vs_ttft.png"), metavar="FILE.png",
                   help="where --plot writes the PNG (default accuracy_vs_ttft.png)")
    load = p.add_argument_group(
        "concurrency", "instead of one request at a time: N gRPC clients at once against an in-process server "
        "(the scheduler batching them), modes full,blend,focus,reuse in rotation, KV from the disk tier. "
        "Example: ragkv bench --concurrency 1,4,8 --duration 60 --json")
    load.add_argument("--concurrency", metavar="N,N,...",
                      help="client counts to run in turn; the first is the baseline of the speedup")
    load.add_argument("--duration", type=float, default=60.0, help="seconds per level (default 60)")
    load.add_argument("--index", type=Path, default=None,
                      help="an index to serve (default: build a 40-document one in a temporary folder)")
    load.add_argument("--max-new-tokens", type=int, default=16, help="answer length per request (default 16)")
    load.add_argument("--top-k", type=int, default=4, help="chunks per request (default 4)")
    load.add_argument("--prompt-share", type=float, default=None, metavar="F",
                      help="the server's --prompt-share: the engine's share prompt passes get while requests "
                           "decode (default: the server's)")
    load.add_argument("--prompt-batch-rows", type=int, default=None, metavar="N",
                      help="the server's --prompt-batch-rows: rows a prompt step carries from several passes at "
                           "the same layer, 0 = one pass per step (default: the server's)")
    load.add_argument("--prompt-slice-s", type=float, default=None, metavar="S",
                      help="the server's --prompt-slice-s: the shortest slice of prompt work between decode "
                           "steps (default: the server's)")
    agent = p.add_argument_group(
        "agent loop", "instead: an agent's tool loop (the question, then a tool call and its result per step) "
        "against two in-process servers on one index, with the KV tree and without it; prints each step's TTFT "
        "over step 0's and the loop's total. Example: ragkv bench --agent-loop --agent-steps 9 "
        "--tool-result-chars 1200 --json")
    agent.add_argument("--agent-loop", action="store_true", help="run the agent loop bench")
    agent.add_argument("--agent-steps", type=int, default=9, help="calls in the loop (default 9)")
    agent.add_argument("--tool-result-chars", type=int, default=1200,
                       help="characters of each tool result (default 1200)")
    agent.add_argument("--kv-tree-bytes", type=int, default=None,
                       help="the tree server's --kv-tree-bytes (default 1 GiB; with --agents: the bounded "
                            "policies' budget, default --tree-share of the working set the unbounded tree held)")
    agents = p.add_argument_group(
        "agents at scale", "instead: N agents' tool loops at once (each its own question, then tool calls and "
        "results, the tool sleeping a seeded random latency) against in-process servers whose KV tree is "
        "unbounded, plain LRU at --kv-tree-bytes, and retention at --kv-tree-bytes (paths kept for the agent's "
        "next call); prints per policy the share of prompt tokens from the tree, TTFT p50/p95 after a tool "
        "result and the total time, against the unbounded tree's. Example: ragkv bench --agents 8 --calls 5 "
        "--tool-latency 0.5,3 --json")
    agents.add_argument("--agents", type=int, default=None, metavar="N", help="concurrent agents")
    agents.add_argument("--calls", type=int, default=5, help="calls per agent (default 5)")
    agents.add_argument("--tool-latency", default="0.5,3", metavar="LO,HI",
                        help="seconds each tool runs, uniform in [LO, HI] (default 0.5,3)")
    agents.add_argument("--retain-max-s", type=float, default=60.0,
                        help="the retention server's --kv-tree-retain-max-s (default 60)")
    agents.add_argument("--tree-share", type=float, default=0.25,
                        help="without --kv-tree-bytes: the bounded policies' budget as this share of the working set "
                             "the unbounded tree held (default 0.25)")
    agents.add_argument("--policies", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                        default=["unbounded", "lru", "retention", "spill"],
                        help="policies to run beside the unbounded baseline (default all: lru,retention,spill)")
    agents.add_argument("--seed", type=int, default=0,
                        help="seeds questions, tool latencies and starts (and --replicas' workload) (default 0)")
    cluster = p.add_argument_group(
        "many replicas (--replicas N; the ray extra)",
        "Deploy N engine replicas on a local Ray (ragkv serve --replicas) once per routing policy, fresh each "
        "time, and run the same workload against each: Zipf-popular topics and agent loops from several "
        "clients. Prints per policy the fast-tier hit rate (chunk KV from a replica's GPU/CPU tier) beside the "
        "bounds placement sets, TTFT p50/p95/p99, KV-tree hits and the router's decisions by reason, then kills "
        "a replica under load and counts hung requests.")
    cluster.add_argument("--replicas", type=int, default=None, metavar="N", help="engine replicas (>= 2)")
    cluster.add_argument("--routing", default="chunk,pow2", help="policies to compare: chunk, pow2 (default both)")
    cluster.add_argument("--requests", type=int, default=80, help="work items per policy (default 80)")
    cluster.add_argument("--topics", type=int, default=24,
                         help="documents of the built index: one stdlib module's docs each, about four 256-token chunks "
                              "(default 24, at most 29)")
    cluster.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    cluster.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of topic popularity (default 1.0)")
    cluster.add_argument("--agent-every", type=int, default=5,
                         help="every Nth work item is an agent loop, 0 = none (default 5)")
    cluster.add_argument("--loop-steps", type=int, default=3, help="calls per agent loop (default 3)")
    cluster.add_argument("--cpu-share", type=float, default=0.25,
                         help="each replica's CPU tier as a share of the corpus's KV bytes (default 0.25)")
    cluster.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per replica (default 1)")
    cluster.add_argument("--route-slack", type=float, default=1.0, metavar="PASSES",
                         help="chunk routing's slack, in prompt passes of expected time to first token (default "
                              "1.0, ragkv serve's)")
    cluster.add_argument("--peer-tier", default="on", metavar="on,off",
                         help="the replicas' peer tier (ragkv serve --peer-tier): on, off, or on,off to run each policy "
                              "both ways and print what pooling adds apart from what routing does (default on)")
    cluster.add_argument("--shared-tier", default="disk", choices=("disk", "s3"),
                         help="where every replica finds the corpus's chunk KV below its own tiers: disk (the index's "
                              "own folder, shared on this host) or s3 (an S3 bucket on loopback, moto, as a deploy "
                              "keeps it: no disk is shared, so a replica's misses read S3; the test extra) "
                              "(default disk)")
    cluster.add_argument("--s3-latency-ms", type=float, default=0.0, metavar="MS",
                         help="with --shared-tier s3: each S3 request waits this long before its first byte, as "
                              "a bucket a network away does (same-region S3: about 20-30 ms; default 0, loopback)")
    cluster.add_argument("--s3-mbps", type=float, default=0.0, metavar="MB/S",
                         help="with --shared-tier s3: each S3 response's bytes come at this many MB/s, as one "
                              "GET stream from S3 does (about 90; default 0 = loopback speed)")
    cluster.add_argument("--fault", type=int, default=8, metavar="N",
                         help="requests in flight when a replica is killed, 0 = skip (default 8)")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from ragkv.cli.cluster_bench import run_cluster_bench

        return run_cluster_bench(args)
    if args.plot:
        from ragkv.cli.plot import plot_accuracy_vs_ttft

        print(plot_accuracy_vs_ttft(args.plot, args.plot_out))
        return 0
    if args.agents is not None:
        from ragkv.cli.agents_bench import run_agents_bench
        from ragkv.cli.serve import as_server_process

        as_server_process()  # the in-process server's, as `ragkv serve` sets it up
        return run_agents_bench(args)
    if args.agent_loop:
        if args.kv_tree_bytes is None:
            args.kv_tree_bytes = 1024**3
        from ragkv.cli.agent_bench import run_agent_bench
        from ragkv.cli.serve import as_server_process

        as_server_process()  # the in-process server's, as `ragkv serve` sets it up
        return run_agent_bench(args)
    if args.concurrency:
        from ragkv.cli.load_bench import run_concurrency_bench
        from ragkv.cli.serve import as_server_process

        as_server_process()  # the in-process server's, as `ragkv serve` sets it up
        return run_concurrency_bench(args)
    from ragkv.engine.kv.host_allocator import tune_host_allocator

    tune_host_allocator()  # before torch's first large allocation
    import torch

    from ragkv.engine import BlendOptions, ChunkKV, Engine, Prompt, SamplingParams, load_model
    from ragkv.evals.synthetic import haystack_paragraphs
    from ragkv.kvstore import KVEntry, StoreConfig, TieredStore, hash_prefix
    from ragkv.retriever.chunk_keys import chunk_key

    if args.repeats < 1 or args.chunks < 1 or args.chunk_tokens < 1 or args.decode_tokens < 0:
        raise ValueError("--repeats, --chunks and --chunk-tokens must be >= 1, --decode-tokens >= 0")
    modes = [Mode(m.strip()) for m in args.modes.split(",") if m.strip()]
    eng = Engine(load_model(args.model, device=args.device, dtype=args.dtype))
    lm = eng.lm
    ids = lm.tokenizer("\n\n".join(haystack_paragraphs()), add_special_tokens=False)["input_ids"]
    need = args.chunks * args.chunk_tokens
    ids = (ids * (need // len(ids) + 1))[:need]
    chunk_ids = [ids[i * args.chunk_tokens:(i + 1) * args.chunk_tokens] for i in range(args.chunks)]
    prefix_ids = eng.prompt.prefix_ids()
    question = eng.prompt.question_ids("Which module describes how to parse command-line arguments?")
    full_ids = prefix_ids + ids + question

    tmp = tempfile.TemporaryDirectory(prefix="ragkv-bench-")
    uri = f"disk:{tmp.name}" if args.tier == "disk" else args.tier
    store = TieredStore(StoreConfig.from_uris([uri], compression=getattr(args, "kv_compression", "none"),
                                              device=str(lm.device)), lm.fingerprint, lm.tokenizer_fingerprint)
    keys = []
    for cids, kv in zip(chunk_ids, [eng.prefill(prefix_ids, ids) for ids in chunk_ids]):
        key = chunk_key(lm.fingerprint, lm.tokenizer_fingerprint, prefix_ids, cids)
        store.put(KVEntry.of(kv, key, lm.fingerprint, lm.tokenizer_fingerprint, hash_prefix(prefix_ids)))
        keys.append(key)
    first = store.read(keys[0])
    kv_bytes = (first.entry.k.nbytes + first.entry.v.nbytes) * len(keys)
    kv_file_bytes = first.stored_bytes * len(keys)  # as stored (compressed or not), header included

    def load(layered: bool):
        hits = [h.hit() for h in store.prefetch(keys, layered=layered)]
        if any(h is None for h in hits):
            raise RuntimeError("a chunk stored by this bench is missing from its tier: this is a bug")
        return [ChunkKV.from_stored(h.entry, lm.device, lm.dtype, h.layers) for h in hits]

    loads = [x.strip() for x in args.load.split(",") if x.strip()]
    if not loads or set(loads) - {"whole", "layered"}:
        raise ValueError(f"--load takes whole, layered or both, got {args.load!r}")
    runs = [(m, None) if m is Mode.FULL else (m, ld) for m in modes for ld in loads]
    runs = list(dict.fromkeys(runs))  # full once, however many loads
    label = {r: r[0].value if r[1] is None or len(loads) == 1 else f"{r[0].value}-{r[1]}" for r in runs}
    opts = BlendOptions(recompute_ratio=args.ratio, selector=args.selector, budget=args.budget)
    ttft: dict[str, list[float]] = {label[r]: [] for r in runs}
    phases: dict[str, dict[str, list[float]]] = {label[r]: {} for r in runs}  # run -> phase -> s per repeat
    per_token: dict[str, list[float]] = {label[r]: [] for r in runs}  # decode s/token per repeat
    kv_load: dict[str, list[float]] = {ld: [] for ld in loads}  # until the chunks are handed to the engine
    for _ in range(args.repeats):
        for run in runs:
            mode, how = run
            t = time.perf_counter()
            if mode is Mode.FULL:
                res = eng.run(Prompt(full_ids), Mode.FULL)
            else:
                kvs = load(how == "layered")
                kv_load[how].append(time.perf_counter() - t)
                res = eng.run(Prompt.of(prefix_ids, kvs, question), mode, options=opts)
            res.logits.cpu()
            ttft[label[run]].append(time.perf_counter() - t)
            for name, sec in res.timings.items():
                phases[label[run]].setdefault(name, []).append(sec)
            if args.decode_tokens:  # greedy; an answer that ends early (EOS) is timed per token it made
                t = time.perf_counter()
                stream = eng.decode(res, SamplingParams(max_new_tokens=args.decode_tokens))
                for _ in stream:
                    pass
                per_token[label[run]].append((time.perf_counter() - t) / max(1, len(stream.token_ids)))
            del res
    med = {m: statistics.median(v) for m, v in ttft.items()}
    load_med = {ld: statistics.median(v) for ld, v in kv_load.items() if v}
    out = {
        "ttft_median_s": med,
        "speedup": {m: med["full"] / s for m, s in med.items()} if "full" in med else {},
        "kv_load_s": load_med.get(loads[0], 0.0),  # the first --load's: with layered, until headers pass
        "kv_load_s_per_load": load_med,
        "phases_median_s": {m: {k: statistics.median(v) for k, v in ph.items()} for m, ph in phases.items()},
        "decode_ms_per_token": {m: statistics.median(v) * 1e3 for m, v in per_token.items() if v},
        "config": {**{k: v for k, v in vars(args).items() if k not in ("func", "plot", "plot_out")},
                   "prompt_tokens": len(full_ids),
                   "kv_bytes": kv_bytes, "kv_file_bytes": kv_file_bytes, "device": str(lm.device),
                   "dtype": str(lm.dtype),
                   "torch_threads": torch.get_num_threads()},
    }
    tmp.cleanup()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"prompt {len(full_ids)} tokens ({args.chunks} x {args.chunk_tokens}) on {lm.device} {lm.dtype}; "
          f"KV from {args.tier} ({kv_bytes / 1e6:.0f} MB), median of {args.repeats}", file=sys.stdout)
    for m, s in med.items():
        speed = f"x{out['speedup'][m]:.2f} vs full" if out["speedup"] else ""
        print(f"  {m:7s} TTFT {s:7.3f} s  {speed}")
    for ld, sec in load_med.items():
        print(f"  kv load {ld} (median, until handed to the engine) {sec:.3f} s")
    for m, ms in out["decode_ms_per_token"].items():
        print(f"  {m:7s} decode {ms:.1f} ms/token")
    for m, ph in out["phases_median_s"].items():
        print(f"  {m:7s} phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in ph.items()))
    return 0
