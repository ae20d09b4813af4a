"""The FAISS index past the size threshold: IVF trained on the GPU where FAISS sees one,
HNSW elsewhere; the file is a CPU index, moved to the GPU only when asked."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from ragkv.retriever import vector_index
from ragkv.retriever.manifest import VectorIndexKind


def _vectors(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    xb = rng.standard_normal((n, d)).astype(np.float32)  # [N, d]
    return xb / np.linalg.norm(xb, axis=1, keepdims=True)


def test_large_corpora_get_ivf_on_a_gpu_and_hnsw_without() -> None:
    assert vector_index.choose_kind(49_999, gpu=True) is VectorIndexKind.FLAT_IP
    assert vector_index.choose_kind(50_000, gpu=True) is VectorIndexKind.IVF_FLAT_IP
    assert vector_index.choose_kind(50_000, gpu=False) is VectorIndexKind.HNSW_IP
    assert vector_index.ivf_lists(50_000) == 894 and vector_index.ivf_lists(1_000) == 25


def test_ivf_finds_what_exact_search_finds_and_round_trips(tmp_path) -> None:
    xb, ids = _vectors(4000, 16), np.arange(10, 4010, dtype=np.int64)
    xq = _vectors(50, 16, seed=1)
    ivf = vector_index.build(ids, xb, VectorIndexKind.IVF_FLAT_IP, gpu=False)
    base = faiss.downcast_index(ivf.index)
    assert base.nlist == 102 and base.nprobe == vector_index.IVF_NPROBE < 102  # not every list is searched
    _, exact = vector_index.build(ids, xb, VectorIndexKind.FLAT_IP).search(xq, 10)
    _, found = ivf.search(xq, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, found)])
    assert recall >= 0.9, f"IVF recall@10 {recall:.2f} against exact search"
    digest = vector_index.save(ivf, tmp_path)
    again = vector_index.load(tmp_path, sha256=digest)
    assert np.array_equal(again.search(xq, 10)[1], found)  # nprobe kept: the same lists searched
    allowed = ids[::3]
    _, kept = again.search(xq, 10, params=vector_index.search_params(again, allowed))
    assert set(kept[kept >= 0].tolist()) <= set(allowed.tolist())  # a filter holds inside IVF too


def test_asking_for_a_gpu_faiss_does_not_see_is_one_clear_error(tmp_path) -> None:
    if vector_index.gpu_count():
        pytest.skip("FAISS sees a GPU here: the error is for machines without one")
    xb, ids = _vectors(200, 8), np.arange(200, dtype=np.int64)
    with pytest.raises(ValueError, match=r"faiss-gpu.*ragkv\[gpu\]"):
        vector_index.build(ids, xb, VectorIndexKind.IVF_FLAT_IP, gpu=True)
    digest = vector_index.save(vector_index.build(ids, xb, VectorIndexKind.FLAT_IP), tmp_path)
    with pytest.raises(ValueError, match=r"sees no GPU.*ragkv\[gpu\]"):
        vector_index.load(tmp_path, device="cuda", sha256=digest)
    with pytest.raises(ValueError, match="cpu, cuda, got 'tpu'"):
        vector_index.load(tmp_path, device="tpu", sha256=digest)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and the gpu extra's faiss-gpu)")
def test_ivf_trained_on_the_gpu_searches_on_either_device(tmp_path) -> None:
    assert vector_index.gpu_count() > 0, "CUDA is here but FAISS sees no GPU: pip install 'ragkv[gpu]'"
    xb, ids = _vectors(60_000, 64), np.arange(60_000, dtype=np.int64)
    xq = _vectors(100, 64, seed=1)
    kind = vector_index.choose_kind(len(xb), gpu=True)
    assert kind is VectorIndexKind.IVF_FLAT_IP
    digest = vector_index.save(vector_index.build(ids, xb, kind), tmp_path)  # k-means on the GPU
    cpu, gpu = vector_index.load(tmp_path, sha256=digest), vector_index.load(tmp_path, device="cuda", sha256=digest)
    _, exact = vector_index.build(ids, xb, VectorIndexKind.FLAT_IP).search(xq, 10)
    _, on_cpu = cpu.search(xq, 10)
    _, on_gpu = gpu.search(xq, 10)
    agree = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(on_cpu, on_gpu)])
    assert agree >= 0.99, f"the GPU copy finds {agree:.2f} of what the CPU index finds"
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, on_cpu)])
    assert recall >= 0.5, f"IVF trained on the GPU: recall@10 {recall:.2f}"  # 64-d noise is IVF's worst case


def test_faiss_parses_only_the_bytes_the_manifest_records(tmp_path: Path) -> None:
    """Issue 71: whoever can write an index folder (the indexing job, which parses untrusted
    documents) must not hand FAISS's parser other bytes than the build wrote."""
    from ragkv.errors import RagKVError

    ids = np.arange(8, dtype=np.int64)
    xb = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    digest = vector_index.save(vector_index.build(ids, xb, VectorIndexKind.FLAT_IP), tmp_path)
    assert digest == vector_index.file_sha256(tmp_path)
    assert vector_index.load(tmp_path, sha256=digest).ntotal == 8
    with pytest.raises(RagKVError, match="records no checksum .* rerun `ragkv index`"):
        vector_index.load(tmp_path)
    path = tmp_path / vector_index.FAISS_NAME
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(RagKVError, match="does not match the checksum"):
        vector_index.load(tmp_path, sha256=digest)
