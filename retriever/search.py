"""Retriever: open an index, embed questions, search FAISS, return chunks with their KV keys.

Knows nothing of the engine or of KV tensors: a hit carries the chunk's token ids
and ``kv_key`` so the caller can fetch the KV from kvstore.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragkv.errors import IndexMismatchError, RagKVError
from ragkv.retriever import vector_index
from ragkv.retriever.chunk_db import ChunkDB
from ragkv.retriever.embedder import Embedder
from ragkv.retriever.manifest import IndexState, Manifest, read_manifest


@dataclass(frozen=True, slots=True)
class Hit:
    """One retrieved chunk."""

    chunk_id: str  # the chunk's stable id
    score: float  # cosine similarity to the question, in [-1, 1]
    text: str  # the chunk's text
    metadata: Mapping[str, Any]  # its document's metadata
    token_ids: list[int]  # the LLM's token ids of `text` (no special tokens)
    kv_key: str  # the kvstore ChunkKey string of this chunk's KV
    doc_id: str  # the document it came from
    ordinal: int  # its position in that document, from 0


class Retriever:
    """A searchable index: manifest, chunk database, FAISS index and the embedder.

    Use ``Retriever.open(index_dir)``; safe to call from several threads.
    """

    def __init__(self, index_dir: Path, manifest: Manifest, db: ChunkDB, index, embedder: Embedder) -> None:
        self.index_dir = index_dir  # the folder the index lives in
        self.manifest = manifest  # what built it
        self.embedder = embedder  # the query embedder (same fingerprint as the index's)
        self._db = db
        self._index = index  # faiss.IndexIDMap2 over chunk rows
        self._lock = threading.Lock()

    @classmethod
    def open(cls, index_dir: str | Path, *, embedder: Embedder | None = None, device: str = "cpu") -> Retriever:
        """Open a complete index for search.

        Args:
            index_dir: a folder written by ``ragkv index``.
            embedder: an already loaded embedder; by default the one the manifest names.
            device: where to load the embedder when it is not given.

        Raises:
            FileNotFoundError: ``index_dir`` holds no index.
            RagKVError: the index is not complete (an interrupted run).
            IndexMismatchError: ``embedder`` is not the one the index was built with.
        """
        index_dir = Path(index_dir)
        manifest = read_manifest(index_dir)
        if manifest is None:
            raise FileNotFoundError(
                f"no index at {index_dir} (no manifest.json): build one with "
                f"`ragkv index CORPUS --out {index_dir}`"
            )
        if manifest.state is not IndexState.COMPLETE:
            raise RagKVError(
                f"index at {index_dir} is {manifest.state.value}, not complete: rerun the same "
                f"`ragkv index` command to resume it (or `ragkv index merge` for shards)"
            )
        if embedder is None:
            embedder = Embedder.load(manifest.embedder, device=device)
        if embedder.fingerprint != manifest.embedder_fp:
            raise IndexMismatchError(
                f"index at {index_dir} was built with embedder {manifest.embedder!r} "
                f"(fingerprint {manifest.embedder_fp[:16]}), but embedder {embedder.spec!r} has "
                f"fingerprint {embedder.fingerprint[:16]}: use the same embedder or re-index"
            )
        db = ChunkDB.open(index_dir, readonly=True)
        index = vector_index.load(index_dir)
        if index.ntotal != db.count():
            db.close()
            raise RagKVError(
                f"index at {index_dir} is inconsistent: FAISS holds {index.ntotal} vectors but the "
                f"chunk database {db.count()} chunks; rerun `ragkv index` to rebuild it"
            )
        return cls(index_dir, manifest, db, index, embedder)

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def check_model(self, model_fp: str, tokenizer_fp: str) -> None:
        """Raise IndexMismatchError unless the index was built for this model and tokenizer."""
        self.manifest.check_model(model_fp, tokenizer_fp)

    def search(self, query: str, top_k: int) -> list[Hit]:
        """The ``top_k`` chunks most similar to ``query``, best first."""
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        return self.search_batch([query], top_k)[0]

    def search_batch(self, queries: Sequence[str], top_k: int) -> list[list[Hit]]:
        """For each query, its ``top_k`` hits, best first.

        Raises:
            ValueError: ``top_k`` is not in [1, len(self)], or a query is empty.
        """
        if isinstance(queries, str):
            raise TypeError("search_batch takes a sequence of queries, not a str; use search()")
        n = len(self)
        if not isinstance(top_k, int) or top_k <= 0:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        if top_k > n:
            raise ValueError(f"top_k={top_k} is beyond the index size: it holds {n} chunks")
        if any(not q.strip() for q in queries):
            raise ValueError("a query is empty: give each query some text")
        if not queries:
            return []
        xq = self.embedder.encode_queries(list(queries))  # [nq, dim]
        D, I = self._index.search(np.ascontiguousarray(xq), top_k)  # [nq, top_k] each
        records = self._db.chunks_by_rows(sorted({int(i) for i in I.ravel() if i >= 0}))
        out: list[list[Hit]] = []
        for drow, irow in zip(D, I):
            hits = []
            for score, row in zip(drow, irow):
                rec = records.get(int(row))
                if rec is None:
                    continue  # HNSW may return -1 when the graph is short of neighbours
                hits.append(Hit(
                    chunk_id=rec.chunk_id, score=float(score), text=rec.text,
                    metadata=dict(rec.metadata), token_ids=list(rec.token_ids),
                    kv_key=rec.kv_key, doc_id=rec.doc_id, ordinal=rec.ordinal,
                ))
            out.append(hits)
        return out

    def close(self) -> None:
        """Release the database; the retriever is unusable afterwards."""
        self._db.close()

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
