"""A follow-up question over other chunks: its earlier turns computed again (blend over the new
chunks, the turns in the question segment) or carried from the first call's KV as one more
chunk (what `ragkv serve` does, `--kv-tree-follow-ups`), both against full prefill of the same
prompt, on a real model.

Each pair of CacheBlend-format questions is one conversation: the first question is answered
over its passages (blend), then the second is asked after it, over its own passages. Per pair:
next-token KL to full prefill at the prompt's end, token F1 of the greedy answers against full
prefill's, the tokens each way computes, and the cost of the turns carried over the cost of
computing them.

    python scripts/follow_up_eval.py --dataset musique_dev.json --pairs 12 --out follow-up.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def run(model: str, dataset: str, pairs: int, ratio: float, ctxs: int, seed: int) -> dict:
    import torch

    from ragkv.engine import BlendOptions, Engine, Prompt, SamplingParams, load_model
    from ragkv.engine.kv.cache import ChunkKV
    from ragkv.engine.kv.conversation import FOLLOW_MIN_TOKENS
    from ragkv.evals.evaluate import kl_divergence, token_f1
    from ragkv.types import Mode

    data = json.load(open(dataset))
    if len(data) < 2 * pairs:
        raise ValueError(f"{dataset} has {len(data)} questions, fewer than the {2 * pairs} that {pairs} pairs need")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    eng = Engine(load_model(model, device="cpu", dtype="float32"))
    fmt, lm, opts = eng.prompt, eng.lm, BlendOptions(recompute_ratio=ratio)
    prefix = fmt.prefix_ids()

    def passages(item: dict) -> tuple[list[list[int]], list[ChunkKV]]:
        ids = [fmt.chunk_ids((c["title"] + "\n" + c["text"]).strip()) for c in item["ctxs"][:ctxs]]
        return ids, [eng.prefill(prefix, x) for x in ids]

    def answer(res: object, n: int = 24) -> tuple[str, list[int]]:
        stream = eng.decode(res, SamplingParams(max_new_tokens=n))
        return "".join(stream), list(stream.token_ids)

    rows = []
    for p in range(pairs):
        a, b = data[order[2 * p]], data[order[2 * p + 1]]
        a_ids, a_kv = passages(a)
        b_ids, b_kv = passages(b)
        first = fmt.question_ids(a["question"])
        r1 = eng.run(Prompt(first, prefix, a_ids, a_kv), Mode.BLEND, opts, reserve_tokens=40)
        a1, a1_ids = answer(r1)
        c1 = r1.n_prompt_tokens - len(first)  # the first call's context
        held = [*first, *a1_ids]  # what the tree keeps of it past its context
        seg = fmt.turn_ids(b["question"], [("user", a["question"]), ("assistant", a1)])
        if seg is None:
            raise ValueError(f"{model} has no chat template: its follow-ups are computed again, nothing to compare")
        m = 0
        while m < min(len(held), len(seg) - 1, r1.cache.length - c1) and held[m] == seg[m]:
            m += 1
        if m < FOLLOW_MIN_TOKENS:
            continue
        positions = torch.arange(c1, c1 + m)  # [m]
        k = r1.cache.k[:, :, c1:c1 + m].clone()  # [L, Hkv, m, D] after RoPE
        inverse = lm.adapter.rotary(positions, k).inverse()
        for layer in range(k.shape[0]):
            k[layer] = inverse.apply(k[layer], layer)
        turns = ChunkKV(torch.tensor(seg[:m]), k, r1.cache.v[:, :, c1:c1 + m].clone(), positions, after_context=True)
        t0 = time.perf_counter()
        full = eng.run(Prompt(seg, prefix, b_ids, b_kv), Mode.FULL, opts, reserve_tokens=40)
        t1 = time.perf_counter()
        again = eng.run(Prompt(seg, prefix, b_ids, b_kv), Mode.BLEND, opts, reserve_tokens=40)
        t2 = time.perf_counter()
        carried = eng.run(Prompt(seg[m:], prefix, [*b_ids, seg[:m]], [*b_kv, turns], fmt.question_ids(b["question"])),
                          Mode.BLEND, opts, reserve_tokens=40)
        t3 = time.perf_counter()
        if not torch.equal(carried.token_ids, full.token_ids):
            raise AssertionError("the carried prompt is not the prompt full prefill ran: a bug")
        ref = answer(full)[0]
        computed_again = int(again.recomputed.numel()) + len(seg)
        computed_carried = int(carried.recomputed.numel()) + len(seg) - m
        rows.append({
            "turn_tokens": m, "prompt_tokens": full.n_prompt_tokens,
            "kl_again": kl_divergence(full.logits, again.logits), "kl_carried": kl_divergence(full.logits, carried.logits),
            "f1_again": token_f1(answer(again)[0], ref), "f1_carried": token_f1(answer(carried)[0], ref),
            "computed_again": computed_again, "computed_carried": computed_carried,
            "turns_cost": (computed_carried - computed_again + m) / m,
            "seconds": {"full": t1 - t0, "again": t2 - t1, "carried": t3 - t2},
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: one line a pair

    def mean(key: str) -> float:
        return round(statistics.mean(r[key] for r in rows), 4) if rows else float("nan")

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 4) if rows else float("nan")

    return {"model": model, "pairs": len(rows), "ratio": ratio, "ctxs": ctxs, "seed": seed,
            "turn_tokens_median": median("turn_tokens"), "prompt_tokens_median": median("prompt_tokens"),
            "kl_again_mean": mean("kl_again"), "kl_carried_mean": mean("kl_carried"),
            "kl_again_median": median("kl_again"), "kl_carried_median": median("kl_carried"),
            "f1_again": mean("f1_again"), "f1_carried": mean("f1_carried"),
            "turns_cost_mean": mean("turns_cost"), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="CacheBlend's QA format: a JSON list of {question, answers, ctxs}")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model with a chat template")
    p.add_argument("--pairs", type=int, default=12, help="conversations: each takes two questions (default 12)")
    p.add_argument("--ratio", type=float, default=0.15, help="blend's recompute ratio (default 0.15, the server's)")
    p.add_argument("--ctxs", type=int, default=3, help="passages per question (default 3)")
    p.add_argument("--seed", type=int, default=0, help="which questions are paired (default 0)")
    p.add_argument("--out", help="write the report here as JSON (default: stdout)")
    args = p.parse_args(argv)
    report = run(args.model, args.dataset, args.pairs, args.ratio, args.ctxs, args.seed)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
