"""The FAISS index over chunk embeddings: chosen by size, built, saved and loaded.

Vectors are L2-normalized, so inner product is cosine similarity. Each vector's
FAISS id is its chunk's row in the chunk database (an ``IndexIDMap2``), so the
saved file carries its own id map.

Size threshold (measured on this project's 2-core CPU box, d=384, one query at a
time): exact search costs 0.9 ms at 10k vectors, 5.3 ms at 50k and 15.7 ms at
100k, growing linearly, while HNSW (M=32) stays under 1 ms. Past
``HNSW_THRESHOLD`` = 50k chunks exact search would dominate the retrieval part
of time to first token, so larger indexes use HNSW with a high ``efSearch``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ragkv.retriever.manifest import VectorIndexKind, atomic_write_bytes

FAISS_NAME = "vectors.faiss"
HNSW_THRESHOLD = 50_000  # chunks; at or past this, HNSW instead of exact search
HNSW_M = 32  # graph neighbours per node
HNSW_EF_CONSTRUCTION = 200  # build-time beam width (recall over build speed)
HNSW_EF_SEARCH = 256  # query-time beam width


def choose_kind(n_vectors: int, threshold: int = HNSW_THRESHOLD) -> VectorIndexKind:
    """Exact inner product for small corpora, HNSW at or past ``threshold`` vectors."""
    return VectorIndexKind.FLAT_IP if n_vectors < threshold else VectorIndexKind.HNSW_IP


def build(ids: np.ndarray, xb: np.ndarray, kind: VectorIndexKind):  # -> faiss.IndexIDMap2
    """Build a FAISS index of ``kind`` over ``xb: [N, d]`` float32 with ids ``[N]`` int64.

    Args:
        ids: FAISS id of each vector (chunk rows).
        xb: normalized embeddings, one per id.
        kind: which index to build.
    """
    import faiss

    nb, d = xb.shape
    if ids.shape != (nb,):
        raise ValueError(f"ids has shape {ids.shape}, expected ({nb},) to match xb {xb.shape}")
    if kind is VectorIndexKind.FLAT_IP:
        base = faiss.IndexFlatIP(d)
    elif kind is VectorIndexKind.HNSW_IP:
        base = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        base.hnsw.efSearch = HNSW_EF_SEARCH
    else:  # pragma: no cover - enum is closed
        raise RuntimeError(f"unhandled vector index kind {kind}: a bug")
    index = faiss.IndexIDMap2(base)
    if nb:
        index.add_with_ids(np.ascontiguousarray(xb, dtype=np.float32), ids.astype(np.int64))
    return index


def save(index, index_dir: Path) -> None:  # index: faiss.Index
    """Atomically write ``index`` into ``index_dir``."""
    import faiss

    data = faiss.serialize_index(index)  # uint8 [nbytes]
    atomic_write_bytes(Path(index_dir) / FAISS_NAME, data.tobytes())


def load(index_dir: Path):  # -> faiss.Index
    """Read the FAISS index of ``index_dir``."""
    import faiss

    path = Path(index_dir) / FAISS_NAME
    if not path.exists():
        raise FileNotFoundError(f"no FAISS index at {path}: finish the index with `ragkv index`")
    index = faiss.read_index(str(path))
    base = faiss.downcast_index(index.index) if hasattr(index, "index") else index
    if isinstance(base, faiss.IndexHNSW):
        base.hnsw.efSearch = HNSW_EF_SEARCH
    return index


def search_params(index, allowed: np.ndarray):  # index: faiss.IndexIDMap2 -> faiss.SearchParameters
    """Search parameters that restrict ``index`` to the ids in ``allowed`` (``[M]`` int64, sorted):
    metadata filters applied inside FAISS, before its top-k."""
    import faiss

    sel = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
    base = faiss.downcast_index(index.index) if hasattr(index, "index") else index
    if isinstance(base, faiss.IndexHNSW):
        params = faiss.SearchParametersHNSW(sel=sel, efSearch=HNSW_EF_SEARCH)
    else:
        params = faiss.SearchParameters(sel=sel)
    params._ragkv_sel = sel  # the selector must outlive the search: SWIG does not hold it
    return params
