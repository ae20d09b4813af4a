"""Retriever: open an index, search it (dense, lexical or hybrid), return chunks with their KV keys.

Dense search embeds the question and asks FAISS; lexical search asks the BM25 index
(``retriever.lexical``); hybrid fuses both lists (``retriever.fusion``), and an
optional cross-encoder (``retriever.rerank``) reorders the fused candidates.
Metadata filters restrict every search to the allowed rows before its top-k.
Knows nothing of the engine or of KV tensors: a hit carries the chunk's token ids
and ``kv_key`` so the caller can fetch the KV from kvstore.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ragkv.errors import IndexMismatchError, RagKVError
from ragkv.retriever import vector_index
from ragkv.retriever.chunk_db import ChunkDB
from ragkv.retriever.embedder import Embedder
from ragkv.retriever.fusion import DEFAULT_SEARCH_MODE, FusionConfig, Ranked, allowed_rows, filters_key, fuse
from ragkv.retriever.lexical import LexicalIndex
from ragkv.retriever.manifest import IndexState, Manifest, read_manifest
from ragkv.types import MetadataFilter, SearchMode

if TYPE_CHECKING:
    from ragkv.kvstore import ChunkKey

log = logging.getLogger(__name__)
_FILTER_CACHE = 64  # filter sets whose allowed rows are remembered


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One retrieved chunk."""

    chunk_id: str  # the chunk's stable id
    score: float  # dense: cosine in [-1, 1]; lexical: BM25; hybrid: fused; reranked: cross-encoder score
    text: str  # the chunk's text
    metadata: Mapping[str, Any]  # its document's metadata, JSON types kept
    token_ids: list[int]  # the LLM's token ids of `text` (no special tokens)
    kv_key: ChunkKey  # names this chunk's KV in the store
    doc_id: str  # the document it came from
    ordinal: int  # its position in that document, from 0
    found_by: tuple[SearchMode, ...] = ()  # the searches whose candidate lists held it


class Retriever:
    """A searchable index: manifest, chunk database, FAISS and BM25 indexes, the embedder and
    an optional reranker.

    Use ``Retriever.open(index_dir)``; safe to call from several threads.
    """

    def __init__(self, index_dir: Path, manifest: Manifest, db: ChunkDB, index, embedder: Embedder,
                 lexical: LexicalIndex, *, default_mode: SearchMode = DEFAULT_SEARCH_MODE,
                 fusion: FusionConfig | None = None, reranker=None) -> None:
        self.index_dir = index_dir  # the folder the index lives in
        self.manifest = manifest  # what built it
        self.embedder = embedder  # the query embedder (same fingerprint as the index's)
        self.default_mode = SearchMode(default_mode)  # search mode when a request names none
        self.fusion = fusion or FusionConfig()  # how hybrid fuses, and the candidate depth
        self.reranker = reranker  # retriever.rerank.Reranker or None
        self._db = db
        self._index = index  # faiss.IndexIDMap2 over chunk rows
        self._lexical = lexical  # BM25 over the same rows
        self._metadata = db.metadata_by_row()  # row -> document metadata, for filters
        self._allowed: OrderedDict[str, np.ndarray] = OrderedDict()  # filters_key -> rows
        self._lock = threading.Lock()

    @classmethod
    def open(cls, index_dir: str | Path, *, embedder: Embedder | None = None, device: str = "cpu",
             default_mode: SearchMode = DEFAULT_SEARCH_MODE, fusion: FusionConfig | None = None,
             reranker=None, faiss_device: str = "cpu") -> Retriever:
        """Open a complete index for search.

        Args:
            index_dir: a folder written by ``ragkv index``.
            embedder: an already loaded embedder; by default the one the manifest names.
            device: where to load the embedder when it is not given.
            default_mode: search mode of requests that name none.
            fusion: hybrid fusion settings; None = reciprocal rank fusion, equal weights.
            reranker: a loaded ``retriever.rerank.Reranker`` applied to the candidates, or None.
            faiss_device: where the FAISS index searches: cpu, or cuda (needs faiss-gpu).

        Raises:
            FileNotFoundError: ``index_dir`` holds no index.
            RagKVError: the index is not complete (an interrupted run).
            IndexMismatchError: ``embedder`` is not the one the index was built with.
            ValueError: ``faiss_device`` is not cpu or cuda, or is cuda where FAISS sees no GPU.
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
        index = vector_index.load(index_dir, device=faiss_device, sha256=manifest.faiss_sha256)
        db = ChunkDB.open(index_dir, readonly=True)
        if index.ntotal != db.count():
            db.close()
            raise RagKVError(
                f"index at {index_dir} is inconsistent: FAISS holds {index.ntotal} vectors but the "
                f"chunk database {db.count()} chunks; rerun `ragkv index` to rebuild it"
            )
        lexical = LexicalIndex.load(index_dir)
        if lexical is None or len(lexical) != db.count():  # built before BM25 existed: build it in memory
            log.info("index at %s has no current lexical index: building BM25 from its chunks", index_dir)
            lexical = LexicalIndex.build(*db.texts())
        return cls(index_dir, manifest, db, index, embedder, lexical, default_mode=default_mode,
                   fusion=fusion, reranker=reranker)

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def check_model(self, model_fp: str, tokenizer_fp: str) -> None:
        """Raise IndexMismatchError unless the index was built for this model and tokenizer."""
        self.manifest.check_model(model_fp, tokenizer_fp)

    def search(self, query: str, top_k: int, *, mode: SearchMode | str | None = None,
               filters: Sequence[MetadataFilter] = (), rerank: bool = True) -> list[SearchHit]:
        """The ``top_k`` chunks that best match ``query``, best first (see ``search_batch``)."""
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        return self.search_batch([query], top_k, mode=mode, filters=filters, rerank=rerank)[0]

    def search_batch(self, queries: Sequence[str], top_k: int, *, mode: SearchMode | str | None = None,
                     filters: Sequence[MetadataFilter] = (), rerank: bool = True) -> list[list[SearchHit]]:
        """For each query, its ``top_k`` hits, best first.

        Args:
            queries: the questions.
            top_k: hits per question; fewer come back when the filters allow fewer chunks
                (or, in lexical mode, when fewer chunks share a word with the question).
            mode: dense, lexical or hybrid; None = ``self.default_mode``.
            filters: metadata conditions, all of which a chunk must meet, applied before top-k.
            rerank: reorder the candidates with ``self.reranker`` when there is one.

        Raises:
            ValueError: ``top_k`` is not in [1, len(self)], a query is empty, or ``mode`` is unknown.
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
        try:
            mode = self.default_mode if mode is None else SearchMode(mode)
        except ValueError:
            raise ValueError(f"unknown search mode {mode!r}; use dense, lexical or hybrid") from None
        if not queries:
            return []
        allowed = self._allowed_rows(filters)  # None = every row
        reranker = self.reranker if rerank else None
        pool = top_k if mode is not SearchMode.HYBRID and reranker is None else max(top_k, self.fusion.candidates)
        dense = self._dense(queries, pool, allowed) if mode is not SearchMode.LEXICAL else None
        lexical = ([self._lexical_search(q, pool, allowed, fill=mode is SearchMode.LEXICAL) for q in queries]
                   if mode is not SearchMode.DENSE else None)
        ranked: list[list[tuple[int, float, tuple[SearchMode, ...]]]] = []
        for i in range(len(queries)):
            if mode is SearchMode.HYBRID:
                ranked.append([(f.row, f.score, f.found_by) for f in fuse(dense[i], lexical[i], self.fusion)])
            elif mode is SearchMode.DENSE:
                ranked.append([(r, s, (SearchMode.DENSE,)) for r, s in dense[i]])
            else:
                ranked.append([(r, s, (SearchMode.LEXICAL,)) for r, s in lexical[i]])
        if reranker is None:
            ranked = [r[:top_k] for r in ranked]
        records = self._db.chunks_by_rows(sorted({row for r in ranked for row, _, _ in r}))
        out: list[list[SearchHit]] = []
        for q, cands in zip(queries, ranked):
            cands = [c for c in cands if c[0] in records]  # HNSW may return -1 when short of neighbours
            if reranker is not None and cands:
                cands = cands[: self.fusion.candidates]
                scores = reranker.scores(q, [records[row].text for row, _, _ in cands])  # [n]
                order = np.argsort(-scores, kind="stable")[:top_k]
                cands = [(cands[j][0], float(scores[j]), cands[j][2]) for j in order]
            hits = []
            for row, score, found_by in cands[:top_k]:
                rec = records[row]
                hits.append(SearchHit(
                    chunk_id=rec.chunk_id, score=float(score), text=rec.text,
                    metadata=dict(rec.metadata), token_ids=list(rec.token_ids),
                    kv_key=rec.kv_key, doc_id=rec.doc_id, ordinal=rec.ordinal, found_by=found_by,
                ))
            out.append(hits)
        return out

    def _allowed_rows(self, filters: Sequence[MetadataFilter]) -> np.ndarray | None:
        """Rows meeting every filter, ascending ``[M]`` int64; None when there are no filters."""
        if not filters:
            return None
        for f in filters:
            if not isinstance(f, MetadataFilter):
                raise TypeError(f"filters must be MetadataFilter objects, got {type(f).__name__}")
        key = filters_key(filters)
        with self._lock:
            rows = self._allowed.get(key)
            if rows is not None:
                self._allowed.move_to_end(key)
                return rows
        rows = allowed_rows(self._metadata, filters)
        with self._lock:
            self._allowed[key] = rows
            while len(self._allowed) > _FILTER_CACHE:
                self._allowed.popitem(last=False)
        return rows

    def _dense(self, queries: Sequence[str], k: int, allowed: np.ndarray | None) -> list[Ranked]:
        """FAISS top-``k`` (row, cosine) per query, only among ``allowed`` rows when given."""
        k = min(k, len(self) if allowed is None else len(allowed))
        if k == 0:
            return [[] for _ in queries]
        xq = self.embedder.encode_queries(list(queries))  # [nq, dim]
        params = None
        if allowed is not None:
            params = vector_index.search_params(self._index, allowed)
        dists, ids = self._index.search(np.ascontiguousarray(xq), k, params=params)  # [nq, k] each
        return [[(int(i), float(d)) for d, i in zip(drow, irow) if i >= 0] for drow, irow in zip(dists, ids)]

    def _lexical_search(self, query: str, k: int, allowed: np.ndarray | None, *, fill: bool) -> Ranked:
        """BM25 top-``k`` (row, score), only among ``allowed`` rows when given. Chunks sharing no
        word with the query are left out, unless ``fill`` (lexical-only search) tops the list up."""
        lex = self._lexical
        scores = lex.scores(query)  # [N]
        ok = np.ones(len(lex), dtype=bool) if allowed is None else np.isin(lex.rows, allowed)  # [N]
        if not fill:
            ok &= scores > 0
        idx = np.flatnonzero(ok)  # [M]
        if not len(idx):
            return []
        k = min(k, len(idx))
        top = idx[np.argpartition(-scores[idx], k - 1)[:k]] if k < len(idx) else idx
        top = top[np.lexsort((lex.rows[top], -scores[top]))]  # score desc, then row asc
        return [(int(lex.rows[i]), float(scores[i])) for i in top]

    def neighbours_of(self, chunk_ids: Sequence[str]) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Each chunk's neighbours' token ids as the index recorded them (`ChunkDB.neighbours_of`)."""
        return self._db.neighbours_of(chunk_ids)

    def close(self) -> None:
        """Release the database; the retriever is unusable afterwards."""
        self._db.close()

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
