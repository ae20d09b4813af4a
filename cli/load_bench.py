"""`ragkv bench --concurrency 1,4,8`: many clients at once against a live server.

One run: build (or open) an index whose chunk KV lives on the disk tier, start the real
server in this process (gRPC on loopback, the engine's scheduler batching every
request), then for each concurrency level N run N client threads for `--duration`
seconds, each asking questions with the modes in rotation. Reports per level the
generated tokens per second (all clients together) and TTFT p50/p95/p99 per mode (the KV
tree off unless `--kv-tree-bytes` is given, so a repeated question is not served whole), and the
speedup of each level's tokens/s over the first level's, all from the same run.

The CPU tier is kept to nothing, so every chunk's KV is read from disk on every request.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ragkv.types import Mode

MODES = (Mode.FULL, Mode.BLEND, Mode.FOCUS, Mode.REUSE)
_DOCS = 40  # documents of the built index, one chunk each (about 200 tokens)
_BEFORE_FIRST = ("retrieve", "queue", "kv_wait", "kv_compute", "prompt")  # the phases a first token waits on


@dataclass(frozen=True, slots=True)
class _Done:
    mode: Mode  # the request's mode
    ttft_s: float  # server-side TTFT
    tokens: int  # completion tokens
    finished_at: float  # time.perf_counter()
    phases: dict  # server-side seconds per phase (queue, retrieve, kv_load, ..., decode)


def _build_index(out: Path, model: str, device: str | None, dtype: str | None) -> Path:
    """A 40-document index of standard-library documentation, KV precomputed on disk."""
    from ragkv.evals.synthetic import haystack_paragraphs
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    paras = [p for p in haystack_paragraphs() if len(p) > 300]
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i in range(_DOCS):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(paras[(3 * i + k) % len(paras)] for k in range(2))[:1200])
    index = out / "index"
    config = IndexJobConfig(corpus, index, model=model, chunking=ChunkingConfig(size=256, overlap=0),
                            **({"device": device} if device else {}), **({"dtype": dtype} if dtype else {}))
    run_index(config)
    return index


def _questions(index: Path, n: int, seed: int) -> list[str]:
    """Questions made of each chunk's own words, so retrieval finds real chunks."""
    from ragkv.retriever.chunk_db import ChunkDB

    rng = random.Random(seed)
    db = ChunkDB.open(index, readonly=True)
    try:
        texts = [rec.text for rec in db.iter_chunks()]
    finally:
        db.close()
    out = []
    for _ in range(n):
        words = rng.choice(texts).split()
        start = rng.randrange(max(1, len(words) - 8))
        out.append("What does the documentation say about " + " ".join(words[start:start + 8]) + "?")
    return out


def _client(addr: str, questions: list[str], offset: int, stop_at: float, max_new: int, top_k: int,
            out: list[_Done], errors: list[str]) -> None:
    from ragkv.client import RagClient

    i = offset
    with RagClient(addr, timeout=600) as client:
        while time.perf_counter() < stop_at:
            mode = MODES[i % len(MODES)]
            try:
                stats = client.query(questions[i % len(questions)], mode=mode, top_k=top_k,
                                     max_new_tokens=max_new).result()
                out.append(_Done(mode, stats.ttft_seconds, stats.usage.completion_tokens, time.perf_counter(),
                                 dict(stats.phase_seconds)))
            except Exception as exc:  # counted and reported, never hidden
                errors.append(f"{mode.value}: {exc}")
            i += 1


def _level(addr: str, n: int, duration: float, questions: list[str], max_new: int, top_k: int) -> dict:
    done: list[_Done] = []
    errors: list[str] = []
    start = time.perf_counter()
    stop_at = start + duration
    threads = [threading.Thread(target=_client, args=(addr, questions, k, stop_at, max_new, top_k, done, errors))
               for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start  # requests still running at the end finish: count them
    by_mode: dict[str, list[float]] = defaultdict(list)
    for d in done:
        by_mode[d.mode.value].append(d.ttft_s)

    def pct(xs: list[float], q: float) -> float:
        return round(statistics.quantiles(xs, n=100)[q - 1], 3) if len(xs) >= 2 else round(xs[0], 3)

    return {
        "requests": len(done),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": round(wall, 2),
        "tokens_per_s": round(sum(d.tokens for d in done) / wall, 2),
        "ttft_p50_s": {m: round(statistics.median(xs), 3) for m, xs in sorted(by_mode.items())},
        "ttft_p95_s": {m: pct(xs, 95) for m, xs in sorted(by_mode.items())},
        "ttft_p99_s": {m: pct(xs, 99) for m, xs in sorted(by_mode.items())},
        # where the time goes, per mode: the median seconds of each phase the server reports
        "phase_p50_s": {m.value: {ph: round(statistics.median(d.phases.get(ph, 0.0) for d in ds), 3)
                                  for ph in sorted({ph for d in ds for ph in d.phases})}
                        for m in MODES if (ds := [d for d in done if d.mode is m])},
        # the tail: the phases before the first token of each mode's slowest request (its TTFT
        # is the p95's neighbourhood): which wait made it slow
        "slowest_ttft_phases_s": {m.value: {"ttft": round(d.ttft_s, 3),
                                            **{ph: round(d.phases[ph], 3) for ph in _BEFORE_FIRST if ph in d.phases}}
                                  for m in MODES if (d := max((d for d in done if d.mode is m),
                                                              key=lambda d: d.ttft_s, default=None))},
    }


def _ttft_ratios(results: dict[str, dict], baseline: str) -> dict[str, dict[str, dict[str, float]]]:
    """Each level's TTFT p50, p95 and p99 per mode over the baseline level's, from the same run."""
    base = results[baseline]
    return {level: {m: {q: round(r[f"ttft_{q}_s"][m] / base[f"ttft_{q}_s"][m], 2) for q in ("p50", "p95", "p99")}
                    for m in r["ttft_p50_s"] if all(base[f"ttft_{q}_s"].get(m) for q in ("p50", "p95", "p99"))}
            for level, r in results.items() if level != baseline}


def run_concurrency_bench(args) -> int:  # argparse.Namespace from cli.bench
    from ragkv.server.assembly import build_pipeline
    from ragkv.server.inprocess import InProcessServer
    from ragkv.server.settings import CollectionSpec, ServerSettings

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.duration <= 0:
        raise ValueError(f"--concurrency takes client counts >= 1 (e.g. 1,4,8) and --duration seconds > 0, "
                         f"got {args.concurrency!r} and {args.duration}")
    with tempfile.TemporaryDirectory(prefix="ragkv-load-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, args.device, args.dtype)
        questions = _questions(index, 64, seed=0)
        settings = ServerSettings(
            indexes=(CollectionSpec("default", index),), host="127.0.0.1", port=0, metrics_port=None,
            model=None if args.index else args.model, kv_cpu_bytes=1,  # nothing stays in RAM: KV from disk
            # the KV tree off unless asked: it would serve a repeated question whole, and the tails
            # measured would be the tree's, not the scheduler's
            kv_tree_bytes=args.kv_tree_bytes or 0,
            max_queue=max(levels) + 4, max_batch=max(levels),
            **({"device": args.device} if args.device else {}), **({"dtype": args.dtype} if args.dtype else {}),
            **({"prompt_slice_s": args.prompt_slice_s} if args.prompt_slice_s else {}),
            **({"prompt_share": args.prompt_share} if args.prompt_share else {}),
            **({"prompt_batch_rows": args.prompt_batch_rows} if args.prompt_batch_rows is not None else {}),
        )
        server = InProcessServer(settings, build_pipeline, load_timeout=600)
        try:
            _level(server.addr, 1, min(10.0, args.duration), questions, args.max_new_tokens, args.top_k)  # warm up
            results = {str(n): _level(server.addr, n, args.duration, questions, args.max_new_tokens, args.top_k)
                       for n in levels}
        finally:
            server.stop()
    base = results[str(levels[0])]["tokens_per_s"]
    report = {
        "concurrency": results,
        "speedup_tokens_per_s": {k: round(v["tokens_per_s"] / base, 2) if base else None
                                 for k, v in results.items() if k != str(levels[0])},
        "ttft_vs_baseline": _ttft_ratios(results, str(levels[0])),
        "config": {"levels": levels, "duration_s": args.duration, "max_new_tokens": args.max_new_tokens,
                   "top_k": args.top_k, "modes": [m.value for m in MODES], "model": args.model,
                   "index": str(args.index) if args.index else f"built: {_DOCS} docs x 256-token chunks",
                   "kv_tier": "disk", "prompt_slice_s": settings.prompt_slice_s,
                   "prompt_share": settings.prompt_share, "kv_tree_bytes": settings.kv_tree_bytes,
                   "prompt_batch_rows": settings.scheduler().prompt_batch_rows,
                   "baseline": f"{levels[0]} client(s), same run"},
    }
    if args.json:
        print(json.dumps(report))
    else:
        for n, r in results.items():
            print(f"{n:>3} clients: {r['requests']:4d} requests, {r['tokens_per_s']:7.2f} tokens/s, "
                  f"TTFT p50 {r['ttft_p50_s']}, p95 {r['ttft_p95_s']}, p99 {r['ttft_p99_s']}, errors {r['errors']}")
        print(f"tokens/s vs {levels[0]} client(s): {report['speedup_tokens_per_s']}")
        for n, by_mode in report["ttft_vs_baseline"].items():
            print(f"TTFT at {n} clients / at {levels[0]}: " + ", ".join(
                f"{m} p50 {r['p50']:.2f}x p95 {r['p95']:.2f}x p99 {r['p99']:.2f}x" for m, r in by_mode.items()))
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: ragkv bench --concurrency 1,4,8 --duration 60")
