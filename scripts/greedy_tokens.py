"""Greedy answer tokens of fixed prompts in every mode, alone and batched, as JSON.

The before/after check for engine changes that must not change answers: run it before a
change and after it, and compare the two files (`--compare OLD.json`). The prompts are the
demo questions over passages of the demo corpus's kind; every mode and selector runs, and
each answer is decoded alone (`DecodeStream`), with the others in one batch
(`decode_batch` through the scheduler's path), and with the others in one batch over one
decode pool (`PooledDecoder`, CUDA's path, eager here), so every decode path is covered;
and the prompt passes run side by side, each layer they stand at together run as one
forward (`drain_together`, the scheduler's `--prompt-batch-rows`), each then decoded alone.

    python scripts/greedy_tokens.py --out before.json
    python scripts/greedy_tokens.py --out after.json --compare before.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

PASSAGES = (
    "json.dumps(obj) serializes obj to a JSON formatted str. If indent is a non-negative integer, "
    "JSON array elements and object members are pretty-printed with that indent level.",
    "tempfile.TemporaryDirectory() creates a temporary directory; on completion of the context or "
    "destruction of the object, the directory and everything in it are removed.",
    "The secret number of the archive is 4721. It was chosen by Alice when she met Bob in Paris.",
    "os.path.join joins one or more path segments intelligently, inserting a separator between them.",
)
QUESTIONS = (
    "What does the json module's dumps function do?",
    "How do I create a temporary directory that is removed automatically?",
    "What is the secret number of the archive?",
)
RUNS = (("full", "query"), ("prefix", "query"), ("reuse", "query"), ("blend", "query"),
        ("blend", "deviation"), ("focus", "query"))


def record(model: str, max_new_tokens: int) -> dict[str, list[int]]:
    import torch

    from ragkv.engine import Prompt, load_model
    from ragkv.engine.blend import BlendOptions
    from ragkv.engine.decode import SamplingParams, decode_batch
    from ragkv.engine.decode_graphs import PooledDecoder
    from ragkv.engine.forward import drain_together
    from ragkv.engine.runtime import Engine

    torch.manual_seed(0)
    engine = Engine(load_model(model, device="cpu"))
    fmt = engine.prompt
    prefix_ids = fmt.prefix_ids()
    chunk_ids = [fmt.chunk_ids(p) for p in PASSAGES]
    chunks = [engine.prefill(prefix_ids, ids) for ids in chunk_ids]
    out: dict[str, list[int]] = {}
    prompts = {}
    steps = {}
    for q_i, question in enumerate(QUESTIONS):
        q_ids = fmt.question_ids(question)
        for mode, selector in RUNS:
            opts = BlendOptions(recompute_ratio=0.15, selector=selector)
            res = engine.run(Prompt(q_ids, prefix_ids, chunk_ids, chunks), mode, opts, reserve_tokens=max_new_tokens + 1)
            name = f"q{q_i}/{mode}/{selector}"
            prompts[name] = res
            steps[name] = (Prompt(q_ids, prefix_ids, chunk_ids, chunks), mode, opts)
    # prompts side by side: every pass at once, each layer they stand at together run as one forward
    # (the scheduler's --prompt-batch-rows); each then decoded alone
    together = drain_together([engine.run_steps(p, m, o, reserve_tokens=max_new_tokens + 1)
                               for p, m, o in steps.values()])
    for name, res in zip(steps, together):
        stream = engine.decode(res, SamplingParams(max_new_tokens=max_new_tokens))
        for _ in stream:
            pass
        out[f"{name}/together"] = list(stream.token_ids)
    # alone: each prompt decoded by itself (its cache is cloned so the batches get fresh ones)
    for name, res in prompts.items():
        stream = engine.decode(copy.deepcopy(res), SamplingParams(max_new_tokens=max_new_tokens))
        for _ in stream:
            pass
        out[f"{name}/alone"] = list(stream.token_ids)
    # batched: every prompt in one ragged batch, step by step; then in one batch over a decode pool
    pool_tokens = sum(res.cache.length + max_new_tokens + 16 for res in prompts.values())
    pooled = PooledDecoder(engine.lm, pool_tokens, graphs=False)
    for arm, step_fn in (("batched", lambda caches, tokens: decode_batch(engine.lm, caches, tokens)),
                         ("pooled", pooled.step)):
        streams = {name: engine.decode(copy.deepcopy(res), SamplingParams(max_new_tokens=max_new_tokens))
                   for name, res in prompts.items()}
        live = dict(streams)
        while live:
            step = {}
            for name, s in list(live.items()):
                token = s.advance()
                if s.finish_reason is not None:
                    del live[name]
                else:
                    step[name] = token
            if step:
                logits = step_fn([live[n].cache for n in step], list(step.values()))  # [B, V]
                for row, name in enumerate(step):
                    live[name].logits = logits[row]
        for name, s in streams.items():
            out[f"{name}/{arm}"] = list(s.token_ids)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: the shipped SmolLM2)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--compare", help="an earlier output: report every answer that differs")
    args = ap.parse_args(argv)
    got = record(args.model, args.max_new_tokens)
    with open(args.out, "w") as f:
        json.dump(got, f, indent=1)
    print(f"{len(got)} answers written to {args.out}")
    side = [k for k in got if k.endswith("/together")]
    same = [k for k in side if got[k] == got[k.removesuffix("/together") + "/alone"]]
    print(f"{len(same)} of {len(side)} prompts run side by side give the tokens they give alone")
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        diff = sorted(k for k in old.keys() & got.keys() if old[k] != got[k])
        print(f"{len(old.keys() & got.keys()) - len(diff)} of {len(old)} answers token-identical to {args.compare}")
        for k in sorted(old.keys() - got.keys()):
            print(f"  missing: {k}")
        for k in diff:
            print(f"  differs: {k}")
        new = got.keys() - old.keys()
        if new:
            print(f"  {len(new)} answers {args.compare} does not have (a newer script's decode paths)")
        return 1 if diff or old.keys() - got.keys() else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
