"""Gemma 3 270M, the second real model (the `gemma` extra): its sliding-window layers are
crossed by the prompt, and ragkv computes it as transformers does."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import BlendOptions, Engine, Prompt
from ragkv.engine.check import check_model
from ragkv.types import Mode

pytestmark = pytest.mark.real_model

FACTS = [
    "The lighthouse on Varn Island was built in 1874 and its lamp burns whale oil.",
    "Marta Kell, the keeper, logged every passing ship in a green ledger.",
    "The secret number kept in the keeper's ledger is 4721.",
]


def test_gemma3_is_served_with_its_windows(gemma3) -> None:
    assert gemma3.adapter.family.model_type == "gemma3_text"
    assert (gemma3.num_layers, gemma3.num_heads, gemma3.num_kv_heads, gemma3.head_dim) == (18, 4, 1, 256)
    windows = [a.window for a in gemma3.adapter.attention]
    assert windows.count(512) == 15 and windows[5::6] == [None, None, None], windows  # 5 local : 1 global
    assert all(c.passed for c in check_model(gemma3, quick=True)), "the start-up gate refuses Gemma 3 270M"


@torch.inference_mode()
def test_gemma3_past_its_window_equals_transformers(gemma3) -> None:
    eng = Engine(gemma3)
    fmt = eng.prompt
    chunks = [" ".join([f] * 12) for f in FACTS]  # ~650 chunk tokens: the local layers' 512 are crossed
    prefix, q = fmt.prefix_ids(), fmt.question_ids("What is the secret number?")
    chunk_ids = [fmt.chunk_ids(c) for c in chunks]
    ids = [*prefix, *(t for c in chunk_ids for t in c), *q]
    assert len(ids) > 600, len(ids)
    ref = gemma3.model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]  # [V]
    scale = float(ref.abs().max())
    full = eng.run(Prompt(q, prefix, chunk_ids, None), Mode.FULL)
    diff = float((full.logits - ref).abs().max())
    assert diff <= 1e-4 * scale, f"full prefill vs transformers past the window: {diff:.3g} > {1e-4 * scale:.3g}"
    kvs = [eng.prefill(prefix, c) for c in chunk_ids]
    blend = eng.run(Prompt(q, prefix, chunk_ids, kvs), Mode.BLEND, BlendOptions(recompute_ratio=1.0))
    diff = float((blend.logits - full.logits).abs().max())
    assert diff <= 1e-5 * scale, f"blend at 1.0 vs full past the window: {diff:.3g} > {1e-5 * scale:.3g}"
