"""Retrieval latency per search mode at N chunks, against dense-only search.

    python -m bench.retrieval_bench --chunks 10000 --queries 200

Builds a chunk database of ``--chunks`` synthetic chunks (~80 words each, fact-style
sentences about differently named items), a FAISS index over random unit vectors
(search cost does not depend on the values) and the BM25 index, then times
``Retriever.search`` one question at a time, top-4, for dense, lexical, hybrid and
hybrid with a metadata filter; the query embedding (the shipped MiniLM) is part of
every dense and hybrid search, as in serving. Prints p50/p95 per mode and each
mode's p50 over dense's, plus the BM25 build time (what an incremental re-index
pays to rebuild the lexical index). The issue's bar: p50 <= 20 ms at 10k chunks.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ragkv.retriever import vector_index
from ragkv.retriever.chunk_db import ChunkDB
from ragkv.retriever.embedder import Embedder
from ragkv.retriever.lexical import LexicalIndex
from ragkv.retriever.records import ChunkRecord, ContentHash, DocId, DocumentRecord, chunk_id
from ragkv.retriever.search import Retriever
from ragkv.types import MetadataFilter, SearchMode

_WORDS = ("system", "release", "budget", "office", "report", "customer", "schedule", "review", "network",
          "storage", "latency", "contract", "invoice", "migration", "backup", "policy", "team", "device",
          "pipeline", "service", "upgrade", "region", "quota", "audit", "license", "vendor", "sensor")


def _texts(n: int, rng: random.Random) -> list[str]:
    out = []
    for i in range(n):
        name = f"{rng.choice(('Kor', 'Vel', 'Tam', 'Ris', 'Olo'))}{rng.choice(('lin', 'den', 'sar'))}-{i}"
        facts = (f"Item {name} is tracked under code QX-{rng.randint(1000, 9999)}. It is owned by team "
                 f"{rng.randint(1, 40)} and started on {rng.randint(1, 28)} May {rng.randint(2015, 2025)}. ")
        out.append(facts + " ".join(rng.choice(_WORDS) for _ in range(60)) + ".")
    return out


def build(dirpath: Path, n: int, dim: int, seed: int) -> tuple[ChunkDB, object, float]:
    """(chunk db, FAISS index, BM25 build seconds) over ``n`` synthetic chunks."""
    rng = random.Random(seed)
    db = ChunkDB.open(dirpath)
    texts = _texts(n, rng)
    docs = []
    for i, text in enumerate(texts):
        doc = DocId(f"doc-{i:06d}")
        meta = {"source": f"part-{i % 10}/doc-{i}.txt", "team": i % 40}
        rec = ChunkRecord(chunk_id(doc, text, 0), doc, 0, text, meta, (1, 2, 3), "k" * 64)
        docs.append((DocumentRecord(doc, ContentHash("0" * 64), doc, 1), [rec]))
    for j in range(0, n, 2000):
        db.replace_documents(docs[j:j + 2000])
    xb = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)  # [N, dim]
    xb /= np.linalg.norm(xb, axis=1, keepdims=True)
    rows, _ = db.texts()
    index = vector_index.build(np.asarray(rows, dtype=np.int64), xb, vector_index.choose_kind(n))
    t0 = time.perf_counter()
    LexicalIndex.build(*db.texts()).save(dirpath)
    return db, index, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--chunks", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    embedder = Embedder.load()
    with tempfile.TemporaryDirectory(prefix="ragkv-retrieval-bench-") as tmp:
        db, index, bm25_s = build(Path(tmp), args.chunks, embedder.dim, args.seed)
        lexical = LexicalIndex.load(Path(tmp))
        r = Retriever(Path(tmp), None, db, index, embedder, lexical)  # type: ignore[arg-type]
        rng = random.Random(args.seed + 1)
        qs = [f"Which code is item {rng.choice(('Korlin', 'Velden', 'Tamsar'))}-{rng.randrange(args.chunks)} "
              f"tracked under?" for _ in range(args.queries)]
        runs = {
            "dense": {"mode": SearchMode.DENSE},
            "lexical": {"mode": SearchMode.LEXICAL},
            "hybrid": {"mode": SearchMode.HYBRID},
            "hybrid+filter": {"mode": SearchMode.HYBRID,
                              "filters": [MetadataFilter("source", "part-3/", "prefix")]},
        }
        for q in qs[:10]:  # warm up: first calls load BLAS, tokenizer caches
            for kw in runs.values():
                r.search(q, args.top_k, **kw)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for q in qs:
            for name, kw in runs.items():
                t0 = time.perf_counter()
                r.search(q, args.top_k, **kw)
                times[name].append(time.perf_counter() - t0)
        db.close()
    print(f"retrieval bench: {args.chunks} chunks, {args.queries} questions one at a time, top-{args.top_k}, "
          f"FAISS {vector_index.choose_kind(args.chunks).value}, query embedding included")
    print(f"BM25 build from the chunk database: {bm25_s * 1e3:.0f} ms")
    base = statistics.median(times["dense"])
    print(f"{'mode':<16}{'p50 ms':>9}{'p95 ms':>9}{'x dense':>9}")
    for name, ts in times.items():
        p50, p95 = statistics.median(ts), float(np.percentile(ts, 95))
        print(f"{name:<16}{p50 * 1e3:>9.2f}{p95 * 1e3:>9.2f}{p50 / base:>9.2f}")
    print("target: hybrid p50 <= 20 ms at 10k chunks")


if __name__ == "__main__":
    main()
