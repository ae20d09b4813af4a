"""Extra indexing cost of neighbour-conditioned chunk KV: plain vs m neighbours, interleaved.

Prefills the first passages of the first questions of a CacheBlend-format file, each chunk
plain and after its m nearest neighbours (over every passage of the file), alternating
per chunk so that a busy shared machine slows both alike; prints total seconds per
variant and the ratio to plain.

    python scripts/neighbour_index_cost.py /work/shared/data/musique_dev.json --n 2 --ctxs 5 \
        --m 1,2,4 --pool-embeddings pool.npy
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--ctxs", type=int, default=5)
    ap.add_argument("--m", default="1,2,4")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--pool-embeddings", type=Path, required=True, help="from ragkv eval --pool-embeddings")
    args = ap.parse_args()

    from ragkv.cli.dataset import DEFAULT_INSTRUCTION, load_dataset
    from ragkv.engine import Engine, load_model, tune_host_allocator
    from ragkv.engine.prefill import context_segments
    from ragkv.indexer.neighbours import NeighbourOptions, context_ids, select_neighbours

    tune_host_allocator()
    cases, pool = load_dataset(args.dataset, args.n, args.ctxs)
    xb = np.load(args.pool_embeddings)
    if xb.shape[0] != len(pool):
        raise SystemExit(f"{args.pool_embeddings} has {xb.shape[0]} rows, the file {len(pool)} passages")
    eng = Engine(load_model("smollm2-135m-instruct"), system_prompt=DEFAULT_INSTRUCTION)
    p = eng.prompt
    prefix = p.prefix_ids()
    row = {t: i for i, t in enumerate(pool)}
    chunks = [c for case in cases for c in case.chunks]
    ms = [int(m) for m in args.m.split(",")]
    nbrs = {m: select_neighbours(xb, NeighbourOptions(m, args.budget), [row[c] for c in chunks]) for m in ms}
    secs = {0: 0.0, **{m: 0.0 for m in ms}}
    kv_secs = {m: 0.0 for m in ms}
    ctx_tokens = {m: 0 for m in ms}
    plain_kv: dict[int, object] = {}

    def plain(j: int):  # noqa: ANN202
        if j not in plain_kv:
            plain_kv[j] = eng.prefill(prefix, p.chunk_ids(pool[j]))
        return plain_kv[j]

    eng.prefill(prefix, p.chunk_ids(chunks[0]))  # warm-up
    for i, c in enumerate(chunks):
        ids = p.chunk_ids(c)
        for m in [0, *ms]:
            ctx = [] if m == 0 else context_ids([p.chunk_ids(pool[j]) for j in nbrs[m][i]], args.budget)
            t = time.perf_counter()
            eng.prefill(prefix, ids, ctx)
            secs[m] += time.perf_counter() - t
            if m:
                ctx_tokens[m] += len(ctx)
                context = context_segments([plain(j) for j in nbrs[m][i]], args.budget)
                t = time.perf_counter()
                eng.prefill(prefix, ids, context_kv=context)
                kv_secs[m] += time.perf_counter() - t
    out = {"chunks": len(chunks), "plain_s": round(secs[0], 2),
           **{f"m{m}": {"s": round(secs[m], 2), "x_plain": round(secs[m] / secs[0], 2),
                        "kv_pass_s": round(kv_secs[m], 2), "kv_x_plain": round((secs[0] + kv_secs[m]) / secs[0], 2),
                        "context_tokens_mean": round(ctx_tokens[m] / len(chunks))} for m in ms}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
