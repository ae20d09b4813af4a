"""A conversation's KV between its calls and the KV tree: copied, or passed in place over one pool.

Baseline (`copy`): the tree in a pool of its own, as with ragged decode: the insert after an
answer copies the request's KV into the tree, and the next call's lease copies the path into its
new cache. Arm (`shared`): the tree's device tier a share of the engine's decode pool
(`engine.kv.decode_pool.SharedSlots`): the insert takes the request's slots where they lie and
the lease lends the path in place (`TreeLease.lend`). Each timed round is one insert and one
lease of a path of `--tokens` tokens; both arms run interleaved in one process, on the model's
KV shape (no weights: only the KV moves). Prints each arm's median ms per round, the ratio, and
the KV bytes a held conversation takes while its next call runs (the tree's and the request's).

    python bench/tree_lease_bench.py --tokens 512,2048,8192 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SHAPES = {  # [layers, kv heads, head dim], dtype
    "smollm2": ((30, 3, 64), "float32"),
    "llama8b": ((32, 8, 128), "bfloat16"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,2048,8192", help="path lengths (comma list)")
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds per arm and length")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES), help="the model's KV shape and dtype")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    import torch

    from ragkv.engine.kv.cache import KVCache
    from ragkv.engine.kv.decode_pool import DecodePool
    from ragkv.engine.kv.tree import KVTree
    from ragkv.engine.kv.tree_node import TreeContext, TreeKey

    (layers, heads, dim), dtype_name = SHAPES[args.shape]
    dtype, device = getattr(torch, dtype_name), torch.device(args.device)
    token_bytes = 2 * layers * heads * dim * dtype.itemsize
    ctx, extra = TreeContext(0, 0, 0), 64  # the next call's new tokens and answer room

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    out: dict[str, dict[str, float]] = {}
    for n in [int(x) for x in args.tokens.split(",")]:
        budget = 4 * (n + extra) * token_bytes
        own = KVTree(budget)
        pool = DecodePool(layers, heads, dim, 8 * (n + extra), dtype, device)
        shared = KVTree(budget, device_pool=pool.share(budget))
        ids = list(range(1, n + 1))
        times: dict[str, list[float]] = {"copy": [], "shared": []}
        for r in range(args.repeats + 1):  # the first round warms up
            for arm in ("copy", "shared"):
                tree, key = (own, TreeKey.of(f"c{r}")) if arm == "copy" else (shared, TreeKey.of(f"s{r}"))
                if arm == "copy":
                    first = KVCache(layers, heads, dim, n + extra, dtype, device)
                else:
                    first = pool.new_cache(n + extra)
                    assert first is not None
                first.k[:, :, :n].normal_()
                first.v[:, :, :n].normal_()
                first.length = n
                # the copy's next cache is made (and touched) before the clock: any request makes its own
                own_next = KVCache(layers, heads, dim, n + extra, dtype, device) if arm == "copy" else None
                if own_next is not None:
                    own_next.k.zero_()
                    own_next.v.zero_()
                sync()
                t0 = time.perf_counter()
                tree.insert(key, [], ctx, ids, first)
                if arm == "shared":
                    pool.release(first, keep=False)  # as the scheduler gives a finished run back
                lease = tree.match(key, ids + [0])
                assert lease is not None and lease.tokens == n
                nxt = lease.lend(n + extra)
                if nxt is None:  # the copy: a cache of the request's own, the path written into it
                    assert own_next is not None, "the shared pool did not lend the path"
                    nxt = own_next
                    lease.write_into(nxt)
                    lease.release()
                sync()
                if r:
                    times[arm].append(time.perf_counter() - t0)
                if arm == "shared":
                    pool.release(nxt, keep=False)
                del first, nxt, lease, own_next  # freed here, not inside the next arm's timing
                tree.clear()
        copy_ms, shared_ms = (1e3 * statistics.median(times[a]) for a in ("copy", "shared"))
        out[str(n)] = {
            "copy_ms": round(copy_ms, 3), "shared_ms": round(shared_ms, 3),
            "speedup": round(copy_ms / shared_ms, 1) if shared_ms > 0 else float("inf"),
            # while the next call runs: the tree's copy and the request's, against one
            "copy_held_bytes": 2 * n * token_bytes, "shared_held_bytes": n * token_bytes,
        }
        print(f"{n:>6} tokens: copy {copy_ms:8.2f} ms, shared {shared_ms:8.3f} ms "
              f"({out[str(n)]['speedup']}x), KV held {2 * n * token_bytes >> 20} MiB vs {n * token_bytes >> 20} MiB",
              flush=True)
    print(json.dumps({"shape": args.shape, "device": args.device, "repeats": args.repeats, "tokens": out}))


if __name__ == "__main__":
    main()
