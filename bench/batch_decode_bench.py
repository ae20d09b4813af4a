"""Batched decode against one request at a time: the step the scheduler runs for B requests.

Baseline: B single-token forwards (what one engine thread did per token for B requests).
Arm: one `decode_batch` over the same B caches of different lengths (weights read once).
Second arm (`pooled`): the same step over one decode pool (`engine.decode_graphs`, eager on a
CPU): the GPU's shape-static step, whose attention is one call per layer over gathered runs.
All run interleaved in the same process; prints ms per step of each and the ratios.

Also the ceiling of batching on this host: a step of one request over a 16-token cache is the
weights' time W (its attention is next to nothing), each request's own step less W its
attention, so no batched step can beat W plus every request's attention:
`ceiling = one_at_a_time / (one_at_a_time - (B - 1) * W)`. On a CPU whose one-row products
already run at memory speed, that bounds `speedup` whatever the attention does.

    python bench/batch_decode_bench.py --batch 1,4,8 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", default="1,4,8", help="batch sizes")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per arm")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the longest cache (others shorter)")
    return ap


def main() -> None:
    args = build_parser().parse_args()

    from ragkv.engine.kv.host_allocator import tune_host_allocator

    tune_host_allocator()
    import torch

    from ragkv.engine import Engine, Prompt, SamplingParams, load_model
    from ragkv.engine.decode import decode_batch
    from ragkv.engine.decode_graphs import PooledDecoder
    from ragkv.types import Mode

    engine = Engine(load_model(args.model))
    vocab = engine.lm.tokenizer.vocab_size
    out = {}
    for b in [int(x) for x in args.batch.split(",")]:
        g = torch.Generator().manual_seed(b)
        lens = [max(16, args.context * (j + 1) // b) for j in range(b)]
        prompts = [engine.run(Prompt(torch.randint(0, vocab, (n,), generator=g).tolist()), Mode.FULL,
                              reserve_tokens=2 * args.steps + 4) for n in lens]
        streams = [engine.decode(p, SamplingParams(max_new_tokens=4 * args.steps)) for p in prompts]
        pooled_caches = [copy.deepcopy(s.cache) for s in streams]
        dec = PooledDecoder(engine.lm, pool_tokens=sum(lens) + b * (3 * args.steps + 16) + 64, graphs=False)
        weights = engine.decode(engine.run(Prompt(torch.randint(0, vocab, (16,), generator=g).tolist()), Mode.FULL,
                                           reserve_tokens=2 * args.steps + 4),
                                SamplingParams(max_new_tokens=4 * args.steps))  # W: a step whose attention is ~0
        single, batched, pooled, weight = [], [], [], []
        with torch.inference_mode():
            dec.step(pooled_caches, [7] * b)  # admits the caches into the pool (one copy each)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                weights._forward(7)
                weight.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for s in streams:
                    s._forward(7)
                single.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                decode_batch(engine.lm, [s.cache for s in streams], [7] * b)
                batched.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                dec.step(pooled_caches, [7] * b)
                pooled.append(time.perf_counter() - t0)
        one, many, pool = statistics.median(single), statistics.median(batched), statistics.median(pooled)
        w = min(statistics.median(weight), one / b)  # a request's step is at least the weights' time
        ceiling = one / (one - (b - 1) * w)  # no step beats W plus every request's attention
        out[str(b)] = {"one_at_a_time_ms": round(1e3 * one, 2), "batched_ms": round(1e3 * many, 2),
                       "speedup": round(one / many, 2), "pooled_ms": round(1e3 * pool, 2),
                       "pooled_speedup": round(one / pool, 2), "weights_ms": round(1e3 * w, 2),
                       "ceiling": round(ceiling, 2), "of_ceiling": round(one / many / ceiling, 2),
                       "cache_tokens": lens}
    print(json.dumps({"model": args.model, "steps": args.steps, "batch": out}))


if __name__ == "__main__":
    main()
