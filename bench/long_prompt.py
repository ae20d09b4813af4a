"""Three streaming clients beside one that sends long prompts, at each prompt step size, in one run.

    python -m bench.long_prompt --duration 30 --step-tokens 0,2048,1024,auto

Builds the `ragkv bench --concurrency` index (40 documents, 256-token chunks, KV on disk) and,
for each `--step-tokens` value in turn, serves it from one in-process server with that
`--prompt-step-tokens` (0: a prompt pass runs whole layers, one per step; N: a longer prompt's
layers run in pieces of at most N tokens, one per step: chunked prefill; auto: pieces sized
from the engine's measured speed, the server's default, whose size at the end is reported). The KV tree is off and
nothing is kept in the CPU tier. Three bystanders ask for long answers (reuse, 4 chunks) back to
back, first alone, then while a fourth client asks, one question after another, for full
prefill over `--long-top-k` chunks (16: about 4.2K prompt tokens).

It reports, for each step size, the bystanders' inter-token latency p50/p95/p99 with the long
prompts over alone, and the fourth client's time to first token; and, against the first step
size (the baseline), the ratio of each: what chunking the long prompts' layers spares the
streams, and what it costs the long prompts themselves.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

from bench import slow_client
from bench.slow_client import _ratio


def _phase(addr: str, long_top_k: int | None, duration: float, questions: list[str], max_new: int) -> dict:
    """The three bystanders for `duration` seconds, with the long-prompt client (None: alone)."""
    return slow_client._phase(addr, None if long_top_k is None else "bench", duration, questions, max_new, 4,
                              bystanders_on="bench", fourth_mode="full", fourth_top_k=long_top_k or 0)


def _kept(pipelines: list, settings: object) -> object:
    """`build_pipeline`, the pipeline kept in `pipelines` (to read its engine after)."""
    from ragkv.server.assembly import build_pipeline

    pipelines.append(build_pipeline(settings))  # type: ignore[arg-type]
    return pipelines[-1]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: the shipped SmolLM2)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per phase (default 30)")
    ap.add_argument("--step-tokens", default="0,2048,1024,auto", metavar="N,N,...",
                    help="the servers' --prompt-step-tokens, run in turn; the first is the baseline "
                         "(default 0,2048,1024,auto: whole layers, two fixed sizes, then the default)")
    ap.add_argument("--long-top-k", type=int, default=16, help="the long prompts' chunks (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the bystanders' answers (default 64)")
    ap.add_argument("--index", type=Path, default=None, help="an existing index (default: build the bench's)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    words = [s.strip() for s in args.step_tokens.split(",")]
    try:
        steps: list[int | None] = [None if w == "auto" else int(w) for w in words]
    except ValueError:
        raise SystemExit(f"--step-tokens takes whole numbers or auto separated by commas, got "
                         f"{args.step_tokens!r}") from None
    if not steps or any(n is not None and n < 0 for n in steps):
        raise SystemExit(f"--step-tokens takes token counts >= 0 (0 = whole layers) or auto, got {args.step_tokens!r}")
    from ragkv.cli.load_bench import _build_index, _questions
    from ragkv.server.inprocess import InProcessServer
    from ragkv.server.pipeline import Pipeline
    from ragkv.server.settings import CollectionSpec, ServerSettings

    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ragkv-long-prompt-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, None, None)
        questions = _questions(index, 64, seed=0)
        for n, word in zip(steps, words):
            pipelines: list[Pipeline] = []
            settings = ServerSettings(
                indexes=(CollectionSpec("bench", index),), host="127.0.0.1", port=0, metrics_port=None,
                kv_cpu_bytes=1, kv_tree_bytes=0, max_queue=8, max_batch=4, prompt_step_tokens=n,
                **({} if args.index else {"model": args.model}))
            server = InProcessServer(settings, functools.partial(_kept, pipelines), load_timeout=600)
            try:
                _phase(server.addr, args.long_top_k, min(6.0, args.duration), questions, args.max_new_tokens)  # warm
                print(f"step tokens {word}: alone ...", file=sys.stderr, flush=True)
                alone = _phase(server.addr, None, args.duration, questions, args.max_new_tokens)
                print(f"step tokens {word}: with long prompts ...", file=sys.stderr, flush=True)
                long = _phase(server.addr, args.long_top_k, args.duration, questions, args.max_new_tokens)
                rows = pipelines[-1].engine.step_rows()  # what auto came to, at the end
            finally:
                server.stop()
            report[word] = {"alone": alone, "long": long, "step_rows_at_end": rows, "itl over alone": {
                f"p{q}": _ratio(long["bystanders"][f"itl_p{q}_s"], alone["bystanders"][f"itl_p{q}_s"])
                for q in (50, 95, 99)}}
    base = report[words[0]]
    ratios = {}
    for word in words[1:]:
        r = report[word]
        for q in (95, 99):
            ratios[f"bystanders itl_p{q} over alone, {word} vs {words[0]}"] = _ratio(
                r["itl over alone"][f"p{q}"], base["itl over alone"][f"p{q}"])
        for q in (50, 95):
            ratios[f"long ttft_p{q}, {word} vs {words[0]}"] = _ratio(r["long"]["fourth"][f"ttft_p{q}_s"],
                                                                    base["long"]["fourth"][f"ttft_p{q}_s"])
    out = {"step_tokens": report, "ratios": ratios,
           "config": {"duration_s": args.duration, "step_tokens": words, "long_top_k": args.long_top_k,
                      "max_new_tokens": args.max_new_tokens, "model": args.model, "bystanders": "reuse, 4 chunks",
                      "long": "full prefill", "baseline": f"the same run's step tokens {words[0]}"}}
    if args.json:
        print(json.dumps(out))
    else:
        for n, r in report.items():
            print(f"step tokens {n:>6s} ({r['step_rows_at_end']} at the end): bystanders itl over alone "
                  f"{r['itl over alone']}  long {r['long']['fourth']}")
        for k, v in ratios.items():
            print(f"{k:48s} {v}")
    errors = sum(p[who]["errors"] for r in report.values() for p in (r["alone"], r["long"])
                 for who in ("bystanders", "fourth") if who in p)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
