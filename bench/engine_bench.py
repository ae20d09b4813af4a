"""TTFT of full prefill vs blend vs reuse for one RAG prompt, in one process and one run.

    python -m bench.engine_bench --chunks 8 --chunk-tokens 512 --ratio 0.15 --repeats 5

Chunk KVs are precomputed once (the indexer's job) and kept in memory; each repeat
times prompt processing up to the first token's logits. Prints the median per mode
and the speedup over full prefill, plus the max logit difference of blend at ratio 1.0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch

from engine import BlendMode, Engine, load_model


def corpus_ids(eng: Engine, n_tokens: int) -> list[int]:
    """Real text (the standard library's own docstrings), tokenized, at least n_tokens long."""
    import collections, json as js, pathlib, argparse as ap, inspect as ins, statistics as st  # noqa: E401

    text = "\n\n".join(inspect.getdoc(m) or "" for m in (collections, js, pathlib, ap, ins, st, time, torch.nn))
    ids = eng.lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    eng = Engine(load_model(args.model, device=args.device, dtype=args.dtype))
    ids = corpus_ids(eng, args.chunks * args.chunk_tokens)
    chunk_ids = [ids[i * args.chunk_tokens:(i + 1) * args.chunk_tokens] for i in range(args.chunks)]
    prefix_ids = eng.prompt.prefix_ids()
    question = eng.prompt.question_ids("Which module describes how to parse command-line arguments?")
    prefix = eng.prefix_kv(prefix_ids)
    kvs = eng.prefill_chunks(prefix_ids, chunk_ids)
    full_ids = prefix_ids + ids + question

    runs = {
        "full": lambda: eng.full_prefill(full_ids),
        "reuse": lambda: eng.blend(prefix, kvs, question, mode=BlendMode.REUSE),
        "blend": lambda: eng.blend(prefix, kvs, question, mode=BlendMode.BLEND, recompute_ratio=args.ratio),
    }
    times: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(args.repeats):
        for mode, fn in runs.items():  # interleaved, so drift hits every mode alike
            t = time.perf_counter()
            res = fn()
            res.logits.cpu()
            times[mode].append(time.perf_counter() - t)
    med = {m: statistics.median(v) for m, v in times.items()}
    full = eng.full_prefill(full_ids)
    exact = eng.blend(prefix, kvs, question, recompute_ratio=1.0)
    out = {
        "ttft_median_s": med,
        "speedup": {m: med["full"] / s for m, s in med.items()},
        "max_logit_diff_ratio_1": float((exact.logits - full.logits).abs().max()),
        "config": {**vars(args), "prompt_tokens": len(full_ids), "torch_threads": torch.get_num_threads()},
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"prompt: {len(full_ids)} tokens ({args.chunks} x {args.chunk_tokens}), {args.device} {args.dtype}, "
              f"median of {args.repeats}")
        for m in runs:
            print(f"  {m:6s} TTFT {med[m]:7.3f} s   speedup vs full x{out['speedup'][m]:.2f}")
        print(f"  blend@1.0 max |logit diff| vs full: {out['max_logit_diff_ratio_1']:.2e}")
    return out


if __name__ == "__main__":
    main()
