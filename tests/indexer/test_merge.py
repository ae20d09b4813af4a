"""Sharded indexing: shards 0/2 and 1/2, then merge, equal one single run."""

from __future__ import annotations

import dataclasses

import pytest

from ragkv.errors import RagKVError
from ragkv.indexer.job import run_index
from ragkv.indexer.merge import merge_shards
from ragkv.retriever.manifest import ShardSpec
from tests.indexer.helpers import assert_same_index, kv_files


def test_shards_then_merge_equal_single_run(job_config, tiny_lm, embedder, tmp_path):
    sharded = dataclasses.replace(job_config, out=tmp_path / "sharded", precompute_kv=True)
    with pytest.raises(RagKVError, match="no shard"):
        merge_shards(sharded.out)
    s0 = run_index(dataclasses.replace(sharded, shard=ShardSpec(0, 2)), lm=tiny_lm, embedder=embedder)
    with pytest.raises(RagKVError, match=r"shards \[1\] of 2 are missing"):
        merge_shards(sharded.out)
    s1 = run_index(dataclasses.replace(sharded, shard=ShardSpec(1, 2)), lm=tiny_lm, embedder=embedder)
    assert s0.documents and s1.documents and s0.documents + s1.documents == 6
    assert s0.index_dir.name == "shard-00000-of-00002"
    merged = merge_shards(sharded.out, progress=False)
    assert merged.n_chunks == s0.chunks + s1.chunks and merged.shard is None

    single = dataclasses.replace(job_config, out=tmp_path / "single")
    run_index(single, lm=tiny_lm, embedder=embedder)
    assert_same_index(sharded.out, single.out)
    assert kv_files(sharded.out / "kv") == kv_files(single.out / "kv")  # both shards wrote one store

    from ragkv.retriever import Retriever

    with Retriever.open(sharded.out, embedder=embedder) as a, Retriever.open(single.out, embedder=embedder) as b:
        qs = ["How is bread made?", "Which planet has rings?"]
        assert [[h.chunk_id for h in hs] for hs in a.search_batch(qs, 3)] == \
               [[h.chunk_id for h in hs] for hs in b.search_batch(qs, 3)]
