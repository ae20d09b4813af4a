"""Attention on CPU: the engine's paths against plain SDPA, one layer at SmolLM2's shapes.

Selective recompute: the split path vs one masked SDPA call per group. Decode: one
query over the whole cache, folded query heads vs SDPA's GQA path.

    python bench/attention_bench.py [--keys 4136] [--ratio 0.15] [--repeats 20]

SmolLM2-135M's geometry (9 query heads over 3 KV heads, head_dim 64). A `ratio` share
of the keys are the recomputed queries, scattered and sorted as blend picks them; both
arms run the same plan groups over the same cache (engine.forward.plan_attention), one
layer's attention per call. Prints each arm's best time, the max difference of their
outputs, and the ratio (baseline / split).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=4136, help="prompt tokens (8 x 512 chunks + prefix + question)")
    ap.add_argument("--ratio", type=float, default=0.15, help="share of tokens recomputed")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    import torch

    import ragkv.engine.forward as fw

    heads = fw.Heads(num_heads=9, num_kv_heads=3, head_dim=64, scaling=64 ** -0.5, sliding_window=None)
    g = torch.Generator().manual_seed(0)
    n, s = args.keys, int(args.ratio * args.keys)
    q_pos = torch.sort(torch.randperm(n, generator=g)[:s]).values  # [S]
    q = torch.randn(9, s, 64, generator=g)  # [H, S, D]
    k, v = torch.randn(3, n, 64, generator=g), torch.randn(3, n, 64, generator=g)  # [Hkv, N, D]

    split_plan = fw.plan_attention(q_pos, n, heads)
    saved, fw._CPU_FLASH = fw._CPU_FLASH, None  # the same groups, each one masked call
    base_plan = fw.plan_attention(q_pos, n, heads)
    fw._CPU_FLASH = saved
    if saved is None:
        print("this torch has no CPU flash op with LSE: the split path is off, nothing to compare")
        return 1

    def run(plan):
        return torch.cat([fw.attention(q[:, a.rows], k, v, a, heads) for a in plan], 1)  # [H, S, D]

    best = {}
    for name, plan in (("masked", base_plan), ("split", split_plan)) * 2:
        run(plan)
        for _ in range(args.repeats):
            t = time.perf_counter()
            run(plan)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    diff = (run(base_plan) - run(split_plan)).abs().max().item()
    print(f"{s} queries over {n} keys, {len(split_plan)} groups ({sum(a.tail_bias is not None for a in split_plan)} split), "
          f"torch threads {torch.get_num_threads()}")
    print(f"  masked (one SDPA call per group) {best['masked'] * 1e3:7.2f} ms")
    print(f"  split  (open keys + masked span) {best['split'] * 1e3:7.2f} ms")
    print(f"  max |diff| {diff:.2e}; speedup x{best['masked'] / best['split']:.2f}")

    # decode: one query that sees every key, SDPA's GQA path against the engine's folded heads
    import torch.nn.functional as F

    q1 = q[:, -1:]  # [H, 1, D]
    plan = fw.plan_attention(torch.tensor([n - 1]), n, heads)
    arms = {
        "gqa": lambda: F.scaled_dot_product_attention(q1[None], k[None], v[None], scale=heads.scaling,
                                                      enable_gqa=True)[0],
        "folded": lambda: fw.attention(q1, k, v, plan[0], heads),
    }
    dbest = {}
    for name, fn in list(arms.items()) * 2:
        fn()
        for _ in range(args.repeats * 5):
            t = time.perf_counter()
            fn()
            dbest[name] = min(dbest.get(name, float("inf")), time.perf_counter() - t)
    ddiff = (arms["gqa"]() - arms["folded"]()).abs().max().item()
    print(f"decode: 1 query over {n} keys")
    print(f"  SDPA enable_gqa (repeats K, V)    {dbest['gqa'] * 1e3:7.3f} ms")
    print(f"  folded query heads (engine)       {dbest['folded'] * 1e3:7.3f} ms")
    print(f"  max |diff| {ddiff:.2e}; speedup x{dbest['gqa'] / dbest['folded']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
