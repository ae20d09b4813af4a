"""Index to and from S3 as the deploy runs it, against moto's S3 server on loopback.

Two "hosts" (separate staging folders) each index one shard of a corpus that lives in
S3 and upload it; a third merges; a fresh server syncs the merged index into its cache
and serves every chunk's KV from the disk tier (the KV travelled with the index).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import boto3
import pytest

from ragkv.cli.main import main
from ragkv.client import RagClient
from ragkv.server.assembly import fetch_indexes
from ragkv.server.settings import CollectionSpec
from ragkv.types import Mode, Tier
from tests.kvstore.conftest import s3_endpoint  # noqa: F401  (the moto server fixture)
from tests.server.fakes import ServerThread, settings
from tests.server.test_relocate import CORPUS


@pytest.fixture
def s3(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    """A fresh bucket, with boto3 (ours and the CLI's) pointed at moto, and a private cache dir."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"ix-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def keys(client, bucket: str, prefix: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):] for p in pages for o in p.get("Contents", ())}


def test_sharded_index_to_s3_then_serve_from_s3(s3, tmp_path: Path, tiny_llama_dir: Path) -> None:
    from ragkv.server.assembly import build_pipeline

    client, bucket = s3
    for name, text in CORPUS.items():
        client.put_object(Bucket=bucket, Key=f"corpus/{name}", Body=text.encode())
    out = f"s3://{bucket}/index/v1"
    common = ["--model", str(tiny_llama_dir), "--chunk-size", "32", "--chunk-overlap", "0", "--no-progress"]
    for i in range(2):  # the Batch array job: one host per shard
        assert main(["index", f"s3://{bucket}/corpus", "--out", out, "--shard", f"{i}/2",
                     "--staging", str(tmp_path / f"host{i}"), *common]) == 0
    assert main(["index", "merge", "--out", out, "--staging", str(tmp_path / "merge-host")]) == 0

    stored = keys(client, bucket, "index/v1/")
    assert {"manifest.json", "chunks.sqlite", "shard-00000-of-00002/manifest.json",
            "shard-00001-of-00002/manifest.json"} <= stored
    kv = {k for k in stored if k.startswith("kv/")}
    manifest = json.loads(client.get_object(Bucket=bucket, Key="index/v1/manifest.json")["Body"].read())
    assert manifest["kv_uris"] == ["disk:kv"] and manifest["state"] == "complete"
    # both shards' KV went up beside the index: each chunk's neighbour KV and its plain copy (the default)
    assert len(kv) == 2 * manifest["n_chunks"] > 0

    spec = CollectionSpec.parse(out)
    assert spec.source == out and spec.index_dir == tmp_path / "cache" / "indexes" / bucket / "index" / "v1"
    served = settings(indexes=(spec,), model=str(tiny_llama_dir))  # an s3:// index does not choose it
    fetch_indexes(served)
    assert (spec.index_dir / "manifest.json").is_file()
    assert not any(spec.index_dir.glob("shard-*"))  # the shards stay in S3
    st = ServerThread(served, build_pipeline)
    try:
        with RagClient(st.addr, timeout=60) as rag:
            stream = rag.query("What is the secret number?", mode=Mode.REUSE, top_k=manifest["n_chunks"],
                               max_new_tokens=2)
            list(stream)
            tiers = [c.kv_tier for c in stream.chunks]
    finally:
        st.stop()
    assert len(tiers) == manifest["n_chunks"] and set(tiers) == {Tier.DISK}, tiers


def test_serve_from_an_empty_prefix_says_what_to_run(s3) -> None:
    from ragkv.errors import RagKVError

    _, bucket = s3
    with pytest.raises(RagKVError, match=rf"s3://{bucket}/nothing holds no index files: build one with"):
        fetch_indexes(settings(indexes=(CollectionSpec.parse(f"docs=s3://{bucket}/nothing"),)))


def test_interrupted_shard_uploads_its_checkpoint_and_the_retry_resumes(
        s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Spot reclaim: the first host checkpoints, uploads and exits 75; the retry on another
    host starts from the uploaded checkpoint, not from nothing."""
    import ragkv.indexer.job as job
    from ragkv.indexer.spot import EXIT_INTERRUPTED, IndexInterrupted, StopReason

    client, bucket = s3
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text")
    seen: list[bytes] = []

    def interrupted(config, stop):
        config.index_dir().mkdir(parents=True)
        (config.index_dir() / "chunks.sqlite").write_bytes(b"checkpoint")
        raise IndexInterrupted(StopReason.SPOT_NOTICE)

    def resumed(config, stop):
        seen.append((config.index_dir() / "chunks.sqlite").read_bytes())
        return job.IndexSummary(config.index_dir(), 1, 1, 1, 0, 0, 0, 0, 0, 0, 0.0, 0.0, ())

    argv = ["index", str(corpus), "--out", f"s3://{bucket}/ix", "--shard", "1/2", "--no-progress"]
    monkeypatch.setattr(job, "run_index", interrupted)
    assert main([*argv, "--staging", str(tmp_path / "reclaimed")]) == EXIT_INTERRUPTED
    assert keys(client, bucket, "ix/") == {"shard-00001-of-00002/chunks.sqlite"}
    monkeypatch.setattr(job, "run_index", resumed)
    assert main([*argv, "--staging", str(tmp_path / "retry-host")]) == 0
    assert seen == [b"checkpoint"]
