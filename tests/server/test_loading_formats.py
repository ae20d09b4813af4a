"""The loading controller counts a tier's bytes as stored and its dequantization: a compressed
tier that moves fewer bytes is read where the same tier in bf16 is recomputed, unless
dequantizing costs more than the bytes saved."""

from __future__ import annotations

from ragkv.kvstore.compression import Compression, stored_bytes_per_token
from ragkv.kvstore.timing import ReadEstimate
from ragkv.server.loading_controller import LoadingController
from ragkv.types import KVSource, Tier

SMOLLM2 = (30, 3, 512, 64)  # [L, Hkv, T, D]


class _Store:
    def __init__(self, est: ReadEstimate) -> None:
        self.est, self.prefetch_workers = est, 4

    def where_many(self, keys: list[str]) -> list[Tier | None]:
        return [Tier.S3 for _ in keys]

    def read_estimate(self, tier: Tier) -> ReadEstimate | None:
        return self.est


def _tier(compression: Compression, dequant_s_per_token: float = 0.0) -> _Store:
    """An S3 tier at 100 MB/s holding files of `compression`."""
    per_token = stored_bytes_per_token(compression, SMOLLM2)
    return _Store(ReadEstimate(0.02, 100e6, per_token, 3, dequant_s_per_token))


def test_the_stored_format_and_its_dequantization_decide() -> None:
    c = LoadingController()
    c.speed.observe(5000, 1.0)  # 5000 tokens/s: a 512-token chunk computes in 0.102 s (0.123 s with the margin)
    (bf16,) = c.decide(_tier(Compression.NONE), ["a"], [512])  # 0.02 + 512 * 23040 / 1e8 = 0.138 s
    (int4,) = c.decide(_tier(Compression.INT4), ["a"], [512])  # 0.02 + 0.037 s
    (slow,) = c.decide(_tier(Compression.INT4, dequant_s_per_token=1e-3), ["a"], [512])  # + 0.5 s dequantizing
    assert bf16.source is KVSource.COMPUTED_CHEAPER
    assert int4.load and int4.load_s < 0.06
    assert slow.source is KVSource.COMPUTED_CHEAPER and slow.load_s > 0.5
