"""``ragkv index merge``: one index from the shard outputs of ``--shard i/N`` runs.

Every shard must be complete and built with the same models and settings. The
merged chunk database holds the documents in document-id order, as a single run
would, and the FAISS index is built from it once. The KV needs no merging: every
shard wrote into the same kvstore tiers.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

from ragkv.errors import IndexMismatchError, RagKVError
from ragkv.retriever import vector_index
from ragkv.retriever.chunk_db import DB_NAME, ChunkDB
from ragkv.retriever.lexical import LEXICAL_DIR, LexicalIndex
from ragkv.retriever.manifest import (
    SHARD_DIR,
    IndexState,
    Manifest,
    portable_kv_uris,
    read_manifest,
    resolve_kv_uris,
    write_manifest,
)

_SAME = ("model_fp", "tokenizer_fp", "embedder_fp", "embedding_dim", "prefix_ids", "chunk_size",
         "chunk_overlap", "kv_uris")


def find_shards(out: Path) -> list[tuple[Path, Manifest]]:
    """The complete shard outputs under ``out``, in shard order.

    Raises:
        RagKVError: no shard, shards of different counts, a missing or incomplete shard.
        IndexMismatchError: shards built with different models or settings.
    """
    dirs = sorted(p for p in Path(out).iterdir() if p.is_dir() and SHARD_DIR.fullmatch(p.name)) \
        if Path(out).is_dir() else []
    if not dirs:
        raise RagKVError(f"no shard-*-of-* folders in {out}: run `ragkv index CORPUS --out {out} --shard i/N` first")
    counts = {int(SHARD_DIR.fullmatch(p.name).group(2)) for p in dirs}  # type: ignore[union-attr]
    if len(counts) != 1:
        raise RagKVError(f"{out} holds shards of different counts {sorted(counts)}: keep one set of shards")
    n = counts.pop()
    have = {int(SHARD_DIR.fullmatch(p.name).group(1)): p for p in dirs}  # type: ignore[union-attr]
    missing = [i for i in range(n) if i not in have]
    if missing:
        raise RagKVError(f"shards {missing} of {n} are missing in {out}: run them with --shard i/{n}")
    out_list = []
    for i in range(n):
        m = read_manifest(have[i])
        if m is None or m.state is not IndexState.COMPLETE:
            raise RagKVError(f"shard {have[i]} is not complete: rerun it with --shard {i}/{n} to finish it")
        out_list.append((have[i], m))
    first = out_list[0][1]
    for path, m in out_list[1:]:
        for name in _SAME:
            if getattr(m, name) != getattr(first, name):
                raise IndexMismatchError(
                    f"shard {path} differs from {out_list[0][0]} in {name}: rebuild the shards with "
                    f"the same models and options"
                )
    return out_list


def merge_shards(out: str | Path, *, hnsw_threshold: int = vector_index.HNSW_THRESHOLD,
                 progress: bool = True) -> Manifest:
    """Merge ``out/shard-*`` into an index in ``out``; replaces a previous merge.

    Returns:
        The merged index's manifest.
    """
    out = Path(out)
    shards = find_shards(out)
    first = shards[0][1]
    tmp = out / ".merge-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    merged = ChunkDB.open(tmp)
    try:
        sources = [ChunkDB.open(path, readonly=True) for path, _ in shards]
        try:
            docs = sorted((d for db in sources for d in db.export_documents()), key=lambda d: d[0].doc_id)
        finally:
            for db in sources:
                db.close()
        merged.import_documents(docs)
        n_docs, n_chunks, n_tokens = merged.stats()
        kind = vector_index.choose_kind(n_chunks, hnsw_threshold, gpu=vector_index.gpu_count() > 0)
        ids, xb = merged.all_vectors()
        if xb.size == 0:
            xb = xb.reshape(0, first.embedding_dim)
        faiss_sha256 = vector_index.save(vector_index.build(ids, xb, kind), tmp)
        merged.mark_faiss_built(merged.vectors_version())
        LexicalIndex.build(*merged.texts()).save(tmp)
        merged.mark_lexical_built(merged.vectors_version())
        kv_done = merged.count_kv_pending() == 0
    finally:
        merged.close(compact=True)
    now = time.time()
    old = read_manifest(out)
    manifest = replace(
        first, state=IndexState.COMPLETE, vector_index=kind, n_documents=n_docs, n_chunks=n_chunks,
        n_tokens=n_tokens, shard=None, kv_precomputed=kv_done, faiss_sha256=faiss_sha256,
        # the shards name their KV relative to their own folders; the merge, relative to out
        kv_uris=portable_kv_uris(resolve_kv_uris(first.kv_uris, shards[0][0]), out, out),
        created_at=old.created_at if old else min(m.created_at for _, m in shards), updated_at=now,
        # the calibration is the first shard's: a sample of the same corpus, served by the same model
    )
    # readers see "building" while the files are swapped, then the complete manifest
    if old is not None:
        write_manifest(out, replace(old, state=IndexState.BUILDING))
    for name in (DB_NAME, vector_index.FAISS_NAME):
        (tmp / name).replace(out / name)
    shutil.rmtree(out / LEXICAL_DIR, ignore_errors=True)
    (tmp / LEXICAL_DIR).rename(out / LEXICAL_DIR)
    write_manifest(out, manifest)
    shutil.rmtree(tmp, ignore_errors=True)
    return manifest
