"""Host-to-GPU copies of chunk KV on a CUDA machine (run by `make gpu-check`): the CPU tier
pins what it holds, so a copy to the GPU is asynchronous, and the bytes arrive unchanged."""

from __future__ import annotations

import pytest
import torch

from ragkv.kvstore.tiers.memory import CpuTier, GpuTier
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, assert_same, make_entry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_cpu_tier_pins_and_a_non_blocking_copy_arrives_whole() -> None:
    cpu = CpuTier(MODEL_FP, TOKENIZER_FP)
    entry = make_entry(3, shape=(4, 2, 256, 64))  # [L, Hkv, T, D]
    assert cpu.put(entry)
    held = cpu.get(entry.key)
    assert held.k.is_pinned() and held.v.is_pinned(), "the CPU tier must pin KV when CUDA is there"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        k = held.k.to("cuda", non_blocking=True)  # [L, Hkv, T, D]
        v = held.v.to("cuda", non_blocking=True)  # [L, Hkv, T, D]
    stream.synchronize()
    assert torch.equal(k.cpu(), entry.k) and torch.equal(v.cpu(), entry.v)


def test_the_gpu_tier_holds_kv_on_the_device_and_gives_it_back_equal() -> None:
    gpu = GpuTier(MODEL_FP, TOKENIZER_FP)
    entry = make_entry(4)
    assert gpu.put(entry)
    held = gpu.get(entry.key)
    assert held.k.device.type == "cuda" and held.v.device.type == "cuda"
    assert_same(held, entry)
