"""Fused projections (issue 70): q, k and v in one matmul, and the MLP's gate and up in one, fused
at load; the model's own modules keep views of the fused weights (no byte held twice), and an MLP
that only shares the names keeps its own forward."""

from __future__ import annotations

from pathlib import Path

import torch

from ragkv.engine.family import Adapter


def test_every_plain_layer_is_fused_and_its_modules_read_the_fused_weights(tiny_lm) -> None:
    ad = tiny_lm.adapter
    n = len(ad.layers)
    assert set(ad._qkv) == set(range(n)) and set(ad._gate_up) == set(range(n))
    for i, layer in enumerate(ad.layers):
        w, _ = ad._qkv[i]
        attn = layer.self_attn
        rows = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        assert w.shape[0] == sum(rows)
        ptrs = [attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr(), attn.v_proj.weight.data_ptr()]
        size = w.element_size() * w.shape[1]
        assert ptrs == [w.data_ptr(), w.data_ptr() + rows[0] * size, w.data_ptr() + (rows[0] + rows[1]) * size]
        gu, _ = ad._gate_up[i]
        assert layer.mlp.gate_proj.weight.data_ptr() == gu.data_ptr()
    x = torch.randn(5, ad.hidden, generator=torch.Generator().manual_seed(0))
    layer = ad.layers[1]
    q, k, v = ad.qkv(1, x)  # [H, S, D], [Hkv, S, D] x 2: the fused matmul, as the three modules compute
    assert torch.allclose(q.transpose(0, 1).reshape(5, -1), layer.self_attn.q_proj(x), atol=1e-6)
    assert torch.allclose(v.transpose(0, 1).reshape(5, -1), layer.self_attn.v_proj(x), atol=1e-6)
    assert torch.allclose(ad.mlp(1, x), layer.mlp(x[None])[0], atol=1e-6)


def test_an_mlp_with_another_forward_behind_the_same_names_is_not_fused(tiny_llama_dir: Path) -> None:
    from ragkv.engine import load_model

    lm = load_model(str(tiny_llama_dir), device="cpu", dtype="float32")
    mlp = lm.adapter.layers[0].mlp
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) + mlp.up_proj(x))  # not gate * up
    ad = Adapter(lm.model, lm.adapter.family)
    assert 0 not in ad._gate_up and 1 in ad._gate_up
    x = torch.randn(3, ad.hidden, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(ad.mlp(0, x), mlp(x[None])[0], atol=1e-6)  # the module's own forward serves it
