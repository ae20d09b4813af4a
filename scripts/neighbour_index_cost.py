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
    ap.add_argument("--budget", default="1024", help="context tokens before a chunk; comma list to compare")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pool-embeddings", type=Path, required=True, help="from ragkv eval --pool-embeddings")
    args = ap.parse_args()

    from ragkv.cli.dataset import DEFAULT_INSTRUCTION, load_dataset
    from ragkv.engine import Engine, load_model, tune_host_allocator
    from ragkv.engine.prefill import context_segments
    from ragkv.indexer.neighbours import context_ids, select_neighbours
    from ragkv.retriever.chunk_keys import NeighbourOptions

    tune_host_allocator()
    cases, pool = load_dataset(args.dataset, args.n, args.ctxs)
    xb = np.load(args.pool_embeddings)
    if xb.shape[0] != len(pool):
        raise SystemExit(f"{args.pool_embeddings} has {xb.shape[0]} rows, the file {len(pool)} passages")
    eng = Engine(load_model(args.model), system_prompt=DEFAULT_INSTRUCTION)
    p = eng.prompt
    prefix = p.prefix_ids()
    row = {t: i for i, t in enumerate(pool)}
    chunks = [c for case in cases for c in case.chunks]
    budgets = [int(b) for b in args.budget.split(",")]
    variants = [(int(m), b) for m in args.m.split(",") for b in budgets]
    name = {v: f"m{v[0]}" if len(budgets) == 1 else f"m{v[0]}-b{v[1]}" for v in variants}
    nbrs = {m: select_neighbours(xb, NeighbourOptions(m), [row[c] for c in chunks]) for m, _ in variants}
    secs = {None: 0.0, **{v: 0.0 for v in variants}}
    kv_secs = {v: 0.0 for v in variants}
    ctx_tokens = {v: 0 for v in variants}
    plain_kv: dict[int, object] = {}

    def plain(j: int):
        if j not in plain_kv:
            plain_kv[j] = eng.prefill(prefix, p.chunk_ids(pool[j]))
        return plain_kv[j]

    eng.prefill(prefix, p.chunk_ids(chunks[0]))  # warm-up
    for i, c in enumerate(chunks):
        ids = p.chunk_ids(c)
        for v in [None, *variants]:
            ctx = [] if v is None else context_ids([p.chunk_ids(pool[j]) for j in nbrs[v[0]][i]], v[1])
            t = time.perf_counter()
            eng.prefill(prefix, ids, ctx)
            secs[v] += time.perf_counter() - t
            if v is not None:
                ctx_tokens[v] += len(ctx)
                context = context_segments([plain(j) for j in nbrs[v[0]][i]], v[1])
                t = time.perf_counter()
                eng.prefill(prefix, ids, context_kv=context)
                kv_secs[v] += time.perf_counter() - t
    out = {"model": args.model, "chunks": len(chunks), "plain_s": round(secs[None], 2),
           **{name[v]: {"s": round(secs[v], 2), "x_plain": round(secs[v] / secs[None], 2),
                        "kv_pass_s": round(kv_secs[v], 2),
                        "kv_x_plain": round((secs[None] + kv_secs[v]) / secs[None], 2),
                        "context_tokens_mean": round(ctx_tokens[v] / len(chunks))} for v in variants}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
