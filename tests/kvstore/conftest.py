"""Fixtures for the kvstore tests: tiny random entries, a moto S3 server on loopback, tier factories."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import boto3
import pytest
import torch

from ragkv.kvstore import (
    ChunkKey,
    Compression,
    CpuTier,
    DiskTier,
    GpuTier,
    KVEntry,
    Policy,
    S3Settings,
    S3Tier,
    StorageTier,
    Tier,
    hash_prefix,
)

MODEL_FP = "model-a"
TOKENIZER_FP = "tok-a"
PREFIX_IDS = [1, 2, 3]
SHAPE = (2, 2, 8, 4)  # [L, Hkv, T, D]: tiny, so the suite stays fast


def make_entry(
    seed: int,
    *,
    shape: tuple[int, int, int, int] = SHAPE,
    dtype: torch.dtype = torch.float32,
    model_fp: str = MODEL_FP,
    tokenizer_fp: str = TOKENIZER_FP,
) -> KVEntry:
    """A random entry whose token ids (and so key) depend on `seed`."""
    g = torch.Generator().manual_seed(seed)
    n_layers, n_heads, n_tokens, head_dim = shape
    token_ids = torch.randint(0, 50_000, (n_tokens,), generator=g, dtype=torch.int64)  # [T]
    return KVEntry(
        key=ChunkKey.build(model_fp, tokenizer_fp, PREFIX_IDS, token_ids.tolist()),
        k=torch.randn(shape, generator=g).to(dtype),  # [L, Hkv, T, D]
        v=torch.randn(shape, generator=g).to(dtype),  # [L, Hkv, T, D]
        token_ids=token_ids,
        positions=torch.arange(len(PREFIX_IDS), len(PREFIX_IDS) + n_tokens),  # [T]
        model_fp=model_fp,
        tokenizer_fp=tokenizer_fp,
        prefix_hash=hash_prefix(PREFIX_IDS),
    )


def assert_same(a: KVEntry, b: KVEntry) -> None:
    """Bit-exact equality of two entries (tensors compared on CPU)."""
    assert a.key == b.key
    for name in ("k", "v", "token_ids", "positions"):
        x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point() else x,
                           y.view(-1).view(torch.uint8) if y.is_floating_point() else y), name
    assert (a.model_fp, a.tokenizer_fp, a.prefix_hash, a.rope_mode) == (
        b.model_fp, b.tokenizer_fp, b.prefix_hash, b.rope_mode)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server in this process, on 127.0.0.1 at a free port (real HTTP through boto3)."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_SESSION_TOKEN", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.delenv("AWS_PROFILE", raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_settings(s3_endpoint: str) -> S3Settings:
    return S3Settings(endpoint_url=s3_endpoint, region="us-east-1", max_attempts=2,
                      connect_timeout_s=2.0, read_timeout_s=10.0)


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket."""
    name = f"kv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_client(s3_endpoint: str):
    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


TierFactory = Callable[..., StorageTier]

ALL_TIERS = [
    pytest.param(Tier.GPU, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
    Tier.CPU,
    Tier.DISK,
    Tier.S3,
]


@pytest.fixture
def make_tier(request: pytest.FixtureRequest, tmp_path) -> TierFactory:
    """Build a tier of a given kind: make_tier(Tier.DISK, budget_bytes=..., compression=...)."""
    made: list[StorageTier] = []

    def factory(
        tier: Tier,
        *,
        budget_bytes: int | None = None,
        policy: Policy = Policy.LRU,
        compression: Compression = Compression.NONE,
        model_fp: str = MODEL_FP,
        tokenizer_fp: str = TOKENIZER_FP,
    ) -> StorageTier:
        if tier is Tier.GPU:
            t: StorageTier = GpuTier(model_fp, tokenizer_fp, budget_bytes, policy)
        elif tier is Tier.CPU:
            t = CpuTier(model_fp, tokenizer_fp, budget_bytes, policy)
        elif tier is Tier.DISK:
            t = DiskTier(tmp_path / "kv", model_fp, tokenizer_fp, budget_bytes, policy, compression)
        else:
            settings = request.getfixturevalue("s3_settings")
            bucket = request.getfixturevalue("bucket")
            t = S3Tier(bucket, "p/q", model_fp, tokenizer_fp, settings, compression)
        made.append(t)
        return t

    yield factory
    for t in made:
        t.close()
