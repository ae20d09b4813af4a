"""Host allocator: glibc's defaults against engine.kv.host_allocator's tuning, in the same run.

Each arm runs in its own process (glibc's parameters hold for a whole process): one
with RAGKV_HOST_ALLOCATOR=default (transparent huge pages on, glibc as shipped), one
tuned (freed blocks stay in the heap for reuse). Each times, best of --repeats:
- a blend-sized MLP step at SmolLM2's width: linear 576 -> 1536, silu, product, linear
  back, on 633 rows (the 15% of an 8 x 512 prompt that blend recomputes);
- a request's KV cache: two [30, 3, 4402, 64] fp32 tensors allocated and filled (202 MB).
Prints both arms and the ratio default / tuned.

    python bench/host_memory_bench.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_ARM = r"""
import json, time, sys
sys.path.insert(0, {root!r})
# applies (or, with RAGKV_HOST_ALLOCATOR=default, skips) the tuning first
from ragkv.engine.kv.host_allocator import tune_host_allocator; tune_host_allocator()  # noqa: E702 - before torch loads
import torch
import torch.nn.functional as F

torch.manual_seed(0)
x = torch.randn(633, 576)  # [S, hidden]
w_gate, w_up, w_down = torch.randn(1536, 576), torch.randn(1536, 576), torch.randn(576, 1536)

def mlp():
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)  # [S, hidden]

def cache():
    k = torch.empty(30, 3, 4402, 64)  # [L, Hkv, cap, D]
    v = torch.empty_like(k)
    k.fill_(1.0)
    v.fill_(1.0)

def best(f, n):
    f()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return min(out) * 1e3

print(json.dumps({{"mlp_ms": best(mlp, {repeats}), "cache_ms": best(cache, {repeats})}}))
"""


def _arm(mode: str, repeats: int) -> dict[str, float]:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "RAGKV_HOST_ALLOCATOR": mode}
    out = subprocess.run([sys.executable, "-c", _ARM.format(root=root, repeats=repeats)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    base, tuned = _arm("default", args.repeats), _arm("tuned", args.repeats)
    for name, what in (("mlp_ms", "MLP step, 633 rows"), ("cache_ms", "KV cache alloc+fill, 202 MB")):
        print(f"{what:30s} default {base[name]:7.2f} ms  tuned {tuned[name]:7.2f} ms  "
              f"ratio {base[name] / tuned[name]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
