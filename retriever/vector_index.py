"""The FAISS index over chunk embeddings: chosen by size, built, saved and loaded.

Vectors are L2-normalized, so inner product is cosine similarity. Each vector's
FAISS id is its chunk's row in the chunk database (an ``IndexIDMap2``), so the
saved file carries its own id map.

Size threshold (measured on this project's 2-core CPU box, d=384, one query at a
time): exact search costs 0.9 ms at 10k vectors, 5.3 ms at 50k and 15.7 ms at
100k, growing linearly, while HNSW (M=32) stays under 1 ms. Past
``HNSW_THRESHOLD`` = 50k chunks exact search would dominate the retrieval part
of time to first token, so larger indexes use HNSW with a high ``efSearch``.

On a machine where FAISS sees a GPU (the ``gpu`` extra's ``faiss-gpu``), a large
corpus gets an inverted-file index instead (IVF: ``4 sqrt(N)`` k-means lists, trained
on the GPU, ``IVF_NPROBE`` lists searched): HNSW has no GPU build, and k-means is the
part of IVF a GPU makes cheap. The file written is always a CPU index, so any server
can load it; ``load(..., device="cuda")`` moves it to the GPU only when asked
(``ragkv serve --faiss-device cuda``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ragkv.atomic import write_bytes
from ragkv.errors import RagKVError
from ragkv.retriever.manifest import VectorIndexKind

FAISS_NAME = "vectors.faiss"
HNSW_THRESHOLD = 50_000  # chunks; at or past this, HNSW instead of exact search
HNSW_M = 32  # graph neighbours per node
HNSW_EF_CONSTRUCTION = 200  # build-time beam width (recall over build speed)
HNSW_EF_SEARCH = 256  # query-time beam width
IVF_NPROBE = 32  # inverted lists searched per query (of 4 sqrt(N): 894 at 50k vectors)
FAISS_DEVICES = ("cpu", "cuda")  # where a loaded index searches


def gpu_count() -> int:
    """GPUs FAISS can use: 0 with faiss-cpu, or with faiss-gpu on a machine without CUDA."""
    import faiss

    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0


def choose_kind(n_vectors: int, threshold: int = HNSW_THRESHOLD, gpu: bool = False) -> VectorIndexKind:
    """Exact inner product for small corpora; at or past ``threshold`` vectors, IVF trained on
    the GPU when ``gpu`` (FAISS sees one: ``gpu_count() > 0``), else HNSW."""
    if n_vectors < threshold:
        return VectorIndexKind.FLAT_IP
    return VectorIndexKind.IVF_FLAT_IP if gpu else VectorIndexKind.HNSW_IP


def ivf_lists(n_vectors: int) -> int:
    """k-means lists of an IVF index over ``n_vectors``: FAISS's 4 sqrt(N), at most N / 39 (the
    fewest training points per list k-means accepts without a warning), at least 1."""
    return max(1, min(int(4 * np.sqrt(n_vectors)), n_vectors // 39))


def build(ids: np.ndarray, xb: np.ndarray, kind: VectorIndexKind, gpu: bool | None = None):  # -> faiss.IndexIDMap2
    """Build a FAISS index of ``kind`` over ``xb: [N, d]`` float32 with ids ``[N]`` int64.

    Args:
        ids: FAISS id of each vector (chunk rows).
        xb: normalized embeddings, one per id.
        kind: which index to build.
        gpu: train IVF's k-means on the GPUs; None = when FAISS sees one. The index returned
            is a CPU index either way.
    """
    import faiss

    nb, d = xb.shape
    if ids.shape != (nb,):
        raise ValueError(f"ids has shape {ids.shape}, expected ({nb},) to match xb {xb.shape}")
    xb = np.ascontiguousarray(xb, dtype=np.float32)
    if kind is VectorIndexKind.FLAT_IP:
        base = faiss.IndexFlatIP(d)
    elif kind is VectorIndexKind.HNSW_IP:
        base = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        base.hnsw.efSearch = HNSW_EF_SEARCH
    elif kind is VectorIndexKind.IVF_FLAT_IP:
        base = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, ivf_lists(nb), faiss.METRIC_INNER_PRODUCT)
        base.nprobe = IVF_NPROBE
        if gpu if gpu is not None else gpu_count() > 0:
            if gpu_count() == 0:
                raise ValueError("gpu=True but FAISS sees no GPU: install the gpu extra's faiss-gpu "
                                 "(pip install 'ragkv[gpu]') on a machine with CUDA, or pass gpu=False")
            # k-means on the GPUs: FAISS's own way to train a CPU IVF there (its clustering index)
            clustering = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(d))
            base.clustering_index = clustering
        if nb:
            base.train(xb)
        base.clustering_index = None  # SWIG holds no reference to it: never leave it dangling
    else:  # pragma: no cover - enum is closed
        raise RuntimeError(f"unhandled vector index kind {kind}: a bug")
    index = faiss.IndexIDMap2(base)
    if nb:
        index.add_with_ids(xb, ids.astype(np.int64))
    return index


def save(index, index_dir: Path) -> str:  # index: faiss.Index
    """Atomically write ``index`` into ``index_dir``; returns the file's sha256 (hex), which the
    manifest records (`Manifest.faiss_sha256`)."""
    import faiss

    data = faiss.serialize_index(index).tobytes()  # the file's bytes
    write_bytes(Path(index_dir) / FAISS_NAME, data)
    return hashlib.sha256(data).hexdigest()


def file_sha256(index_dir: Path) -> str:
    """The sha256 (hex) of ``index_dir``'s FAISS file, as `save` returned it."""
    h = hashlib.sha256()
    with open(Path(index_dir) / FAISS_NAME, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load(index_dir: Path, device: str = "cpu", sha256: str | None = None):  # -> faiss.Index
    """Read the FAISS index of ``index_dir``, on the CPU or moved to every GPU FAISS sees. FAISS
    parses only bytes whose sha256 is ``sha256`` (the manifest's record): whoever could write the
    index folder (the indexing job, which parses untrusted documents) cannot hand FAISS's
    parser other bytes.

    Raises:
        FileNotFoundError: ``index_dir`` holds no FAISS index.
        ValueError: ``device`` is not one of FAISS_DEVICES, or is cuda where FAISS sees no GPU.
        RagKVError: ``sha256`` is None (an index written before checksums were recorded), or the
            file does not match it.
    """
    import faiss

    if device not in FAISS_DEVICES:
        raise ValueError(f"FAISS device must be one of {', '.join(FAISS_DEVICES)}, got {device!r}")
    if device == "cuda" and gpu_count() == 0:
        raise ValueError("FAISS device cuda, but FAISS sees no GPU: install the gpu extra's faiss-gpu "
                         "(pip install 'ragkv[gpu]') on a machine with CUDA, or search on the cpu")
    path = Path(index_dir) / FAISS_NAME
    if not path.exists():
        raise FileNotFoundError(f"no FAISS index at {path}: finish the index with `ragkv index`")
    if sha256 is None:
        raise RagKVError(f"the manifest of {index_dir} records no checksum of its FAISS index (written by an older "
                         f"ragkv), and FAISS parses only checked bytes: rerun `ragkv index` on it to record one")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RagKVError(f"{path} does not match the checksum its manifest records: the file was changed or "
                         f"damaged after the index was built; rebuild it with `ragkv index`")
    index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    base = faiss.downcast_index(index.index) if hasattr(index, "index") else index
    if isinstance(base, faiss.IndexHNSW):
        base.hnsw.efSearch = HNSW_EF_SEARCH
    elif isinstance(base, faiss.IndexIVF):
        base.nprobe = IVF_NPROBE
    if device == "cuda":
        index = faiss.index_cpu_to_all_gpus(index)  # HNSW has no GPU form: FAISS raises naming it
    return index


def search_params(index, allowed: np.ndarray):  # index: faiss.IndexIDMap2 -> faiss.SearchParameters
    """Search parameters that restrict ``index`` to the ids in ``allowed`` (``[M]`` int64, sorted):
    metadata filters applied inside FAISS, before its top-k."""
    import faiss

    sel = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
    base = faiss.downcast_index(index.index) if hasattr(index, "index") else index
    if isinstance(base, faiss.IndexHNSW):
        params = faiss.SearchParametersHNSW(sel=sel, efSearch=HNSW_EF_SEARCH)
    elif isinstance(base, faiss.IndexIVF):
        params = faiss.SearchParametersIVF(sel=sel, nprobe=IVF_NPROBE)
    else:
        params = faiss.SearchParameters(sel=sel)
    params._ragkv_sel = sel  # the selector must outlive the search: SWIG does not hold it
    return params
