"""KV precompute throughput (prefill + writing to the disk tier) vs plain prefill, one run.

    python bench/indexer_bench.py [--model smollm2-135m-instruct] [--chunks 16] [--chunk-size 512]

Chunks come from the demo corpus. The baseline prefills the chunks after the shared
prefix and drops the KV; the indexer's path (indexer.kv_job.KVWriter) prefills the
same chunks and writes each to a fresh disk tier, overlapping the writes with the
next prefill. Prints both throughputs in tokens/s and the ratio (target >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--chunks", type=int, default=16, help="chunks to prefill in each arm")
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="chunks per KV batch")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each arm; best counts")
    args = ap.parse_args()

    import torch

    from ragkv.engine import Engine, load_model
    from ragkv.indexer.chunking import ChunkingConfig, chunk_document
    from ragkv.indexer.corpus import load_corpus
    from ragkv.indexer.demo_corpus import build_demo_corpus
    from ragkv.indexer.kv_job import KVItem, KVWriter, open_store
    from ragkv.retriever.chunk_keys import chunk_key

    lm = load_model(args.model, device="cpu", dtype=torch.float32)
    eng = Engine(lm)
    prefix = eng.prompt.prefix_ids()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = load_corpus(build_demo_corpus(Path(tmp) / "corpus"))
        chunks = [c for d in corpus.documents
                  for c in chunk_document(d.doc_id, d.text, eng.prompt.chunk_ids, ChunkingConfig(args.chunk_size, 32))]
        chunks = chunks[: args.chunks]
        tokens = sum(len(c.token_ids) for c in chunks)
        items = [KVItem(i, chunk_key(lm.fingerprint, lm.tokenizer_fingerprint, prefix, c.token_ids), c.token_ids)
                 for i, c in enumerate(chunks)]
        batches = [items[i : i + args.batch] for i in range(0, len(items), args.batch)]
        for it in items:  # warm up: touch every weight page, memoize the prefix KV
            [eng.prefill(prefix, ids) for ids in [it.token_ids]]

        base_s = kv_s = float("inf")
        written = [0]
        for r in range(args.repeats):  # alternate the arms; keep each arm's best (least disturbed) run
            t = time.perf_counter()
            for b in batches:
                [eng.prefill(prefix, ids) for ids in [it.token_ids for it in b]]
            base_s = min(base_s, time.perf_counter() - t)

            store = open_store([f"disk:{Path(tmp) / f'kv{r}'}"], lm.fingerprint, lm.tokenizer_fingerprint)
            written[0] = 0
            t = time.perf_counter()
            KVWriter(eng, store, prefix).run(batches, lambda b, n: written.__setitem__(0, written[0] + n))
            kv_s = min(kv_s, time.perf_counter() - t)
            store.close()

    base, ours = tokens / base_s, tokens / kv_s
    print(f"chunks: {len(chunks)}, tokens: {tokens}, KV written: {written[0] / 1e6:.1f} MB, "
          f"threads: {torch.get_num_threads()}")
    print(f"baseline  plain prefill           : {base:8.0f} tokens/s ({base_s:.2f} s)")
    print(f"ragkv     prefill + disk-tier write: {ours:8.0f} tokens/s ({kv_s:.2f} s)")
    print(f"ratio: {ours / base:.3f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
