"""Prompt passes side by side: several requests' same layer run as one forward
(`ragkv serve --prompt-batch-rows`), against one pass per step.

N requests come in at once to one scheduler, as N clients' would, each over its own `--chunks`
chunks of about `--chunk-tokens` tokens (synthetic needle-in-a-haystack cases over stdlib
docstrings: one corpus, no tuning) with their KV ready, in `--mode` (blend, the default mode,
or reuse, ...). Each arm serves the same N requests: `alone` with `prompt_batch_rows` 0 (the
baseline), `side` with `--rows`. Per arm: the layer steps that carried several passes, the
mean and the largest time to first token (from submission: the largest is when all N prompt
passes were done), and the ratios side / alone, below 1 where side by side is faster. The
arms run interleaved, `--repeats` times, medians reported. Greedy answers must be equal
between the arms (the bench fails otherwise).

On a CPU a layer's time grows with its rows, so sharing a step gains what reading the
weights once saves (about 1.25x over 4 blend passes here), and passes that finish together
decode together instead of stretching each other's prompt work between decode steps; on a
GPU a layer over a few hundred rows is bound by reading its weights and launching its
kernels, which a shared step pays once (`scripts/gpu_bench.py` times that).

    python bench/prompt_batch_bench.py --clients 4 --mode blend,reuse --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: the shipped SmolLM2)")
    ap.add_argument("--clients", type=int, default=4, help="requests that come in at once (default 4)")
    ap.add_argument("--mode", default="blend,reuse", help="modes, each run in turn (default blend,reuse)")
    ap.add_argument("--chunks", type=int, default=5, help="chunks per request (default 5)")
    ap.add_argument("--chunk-tokens", type=int, default=128, help="tokens per chunk, about (default 128)")
    ap.add_argument("--rows", type=int, default=512,
                    help="the side arm's prompt_batch_rows: rows a shared step carries at most (default 512, "
                         "CUDA's auto)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="answer length (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both arms, interleaved (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="the synthetic cases' seed (default 0)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object on the last line")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.repeats < 1 or args.rows < 1:
        raise SystemExit(f"--clients, --repeats and --rows must be >= 1, got {args.clients}, {args.repeats}, "
                         f"{args.rows}")
    from ragkv.engine import Engine, load_model
    from ragkv.engine.blend import BlendOptions
    from ragkv.engine.decode import SamplingParams
    from ragkv.engine.request import Finished, LoadedKV, PromptChunk, Request, TokenOut
    from ragkv.engine.scheduler import Scheduler, SchedulerConfig
    from ragkv.evals.synthetic import make_cases
    from ragkv.types import Mode, Tier

    engine = Engine(load_model(args.model))
    fmt, tok = engine.prompt, engine.lm.tokenizer
    cases = make_cases("niah", args.clients, args.chunks, args.chunk_tokens, lambda t: len(tok.encode(t)), args.seed)
    prefix_ids = tuple(fmt.prefix_ids())
    built = []  # per client: (chunk ids, their KV, question ids)
    for case in cases:
        ids = [tuple(fmt.chunk_ids(c)) for c in case.chunks]
        built.append((ids, [engine.prefill(prefix_ids, list(i)) for i in ids], tuple(fmt.question_ids(case.question))))

    def serve(mode: Mode, rows: int) -> tuple[list[float], list[list[int]], int]:
        """The N requests at once through a scheduler with `prompt_batch_rows` = rows: each one's
        seconds to its first token, its tokens, and the layer steps that carried several passes."""
        sched = Scheduler(SchedulerConfig(prompt_batch_rows=rows))
        first: list[float | None] = [None] * len(built)
        tokens: list[list[int]] = [[] for _ in built]
        ended = [threading.Event() for _ in built]
        requests = []
        for ids, kvs, q_ids in built:
            sizes = (mode, len(prefix_ids), sum(len(i) for i in ids), len(q_ids), BlendOptions())
            requests.append(Request(
                mode=mode, prefix_ids=prefix_ids, question_ids=q_ids,
                chunks=tuple(PromptChunk(i, LoadedKV(kv, Tier.CPU, kv.nbytes)) for i, kv in zip(ids, kvs)),
                sampling=SamplingParams(max_new_tokens=args.max_new_tokens),
                prompt_cost=engine.prompt_cost(*sizes), prompt_rows=engine.prompt_rows(*sizes)))

        def sink_of(n: int, t0: float):
            def sink(out: object) -> None:
                if isinstance(out, TokenOut):
                    if first[n] is None:
                        first[n] = time.perf_counter() - t0
                    tokens[n].append(out.token_id)
                elif isinstance(out, Finished):
                    if out.error is not None:
                        raise SystemExit(f"a request failed: {out.error!r}")
                    ended[n].set()
            return sink

        t0 = time.perf_counter()
        for n, req in enumerate(requests):
            sched.submit(req, engine.work(req), sink_of(n, t0))
        for e in ended:
            if not e.wait(600):
                raise SystemExit("a request did not finish within 600 s")
        sched.close()
        assert all(f is not None for f in first)
        return [f for f in first if f is not None], tokens, sched.stats.shared_layers

    report: dict = {"config": vars(args), "modes": {}}
    for name in [m.strip() for m in args.mode.split(",") if m.strip()]:
        mode = Mode(name)
        serve(mode, 0)  # warm-up: the engine's measured rates, the allocator
        arms: dict[str, dict[str, list[float]]] = {"alone": {}, "side": {}}
        answers: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for arm, rows in (("alone", 0), ("side", args.rows)):
                ttft, answers[arm], shared = serve(mode, rows)
                got = arms[arm]
                got.setdefault("shared_layer_steps", []).append(shared)
                got.setdefault("mean_ttft_s", []).append(statistics.fmean(ttft))
                got.setdefault("max_ttft_s", []).append(max(ttft))
        if answers["alone"] != answers["side"]:
            raise SystemExit(f"{name}: answers side by side differ from one pass per step")
        row = {arm: {k: statistics.median(v) for k, v in got.items()} for arm, got in arms.items()}
        row["side_over_alone"] = {k: row["side"][k] / row["alone"][k] for k in ("mean_ttft_s", "max_ttft_s")}
        report["modes"][name] = row
        if not args.json:
            r = row["side_over_alone"]
            print(f"{name}: {args.clients} at once, mean TTFT {row['alone']['mean_ttft_s']:.3f} -> "
                  f"{row['side']['mean_ttft_s']:.3f} s ({r['mean_ttft_s']:.2f}x), last first token "
                  f"{row['alone']['max_ttft_s']:.3f} -> {row['side']['max_ttft_s']:.3f} s ({r['max_ttft_s']:.2f}x)")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
