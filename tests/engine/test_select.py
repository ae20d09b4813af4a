"""Picking tokens from scores: the global and the per-chunk budget."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import BlendOptions, Budget, Prompt
from ragkv.engine.select import layer_mean, select_tokens
from ragkv.types import Mode


def test_chunk_budget_gives_each_chunk_its_share_of_its_own_best():
    torch.manual_seed(0)
    lens = [50, 30, 20]
    score = torch.rand(100)
    score[80:] += 10  # the last chunk would take every pick under a global budget
    glob = select_tokens(score, lens, BlendOptions(0.2))
    per = select_tokens(score, lens, BlendOptions(0.2, budget="chunk"))
    assert glob.tolist() == list(range(80, 100))
    assert per.numel() == 20 and per.tolist() == sorted(per.tolist())
    off = 0
    for t, share in zip(lens, [10, 6, 4]):
        mine = per[(per >= off) & (per < off + t)]
        assert mine.numel() == share
        assert set(mine.tolist()) == set((torch.topk(score[off:off + t], share).indices + off).tolist())
        off += t


@pytest.mark.parametrize("lens,ratio", [([7, 7, 7], 0.5), ([1, 2, 97], 0.13), ([33], 0.3), ([5, 5], 1.0)])
def test_chunk_budget_spends_exactly_the_global_budget(lens, ratio):
    n = sum(lens)
    picked = select_tokens(torch.rand(n), lens, BlendOptions(ratio, budget=Budget.CHUNK, sink_tokens=1))
    assert picked.numel() == round(ratio * n) and picked.unique().numel() == picked.numel()


def test_scores_must_match_the_chunks():
    with pytest.raises(ValueError, match="sum to 9"):
        select_tokens(torch.rand(10), [4, 5], BlendOptions(0.2))
    with pytest.raises(ValueError, match="'sideways' is not a valid Budget"):
        BlendOptions(budget="sideways")


def test_chunk_budget_blend_recomputes_every_inexact_chunk(tiny_llama_engine):
    from tests.engine.test_blend import _parts

    prefix, kvs, q, _ = _parts(tiny_llama_engine)
    res = tiny_llama_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND,
                                options=BlendOptions(0.3, budget="chunk", selector="query"))
    starts = torch.tensor([len(prefix) + sum(k.num_tokens for k in kvs[:i]) for i in range(len(kvs) + 1)])
    per_chunk = torch.bucketize(res.recomputed, starts[1:], right=True).bincount(minlength=len(kvs))
    # plain KV: the first chunk's is exact in the prompt, so the whole budget is shared by the others
    assert per_chunk.sum() == round(0.3 * sum(k.num_tokens for k in kvs))
    assert per_chunk[0] == 0 and (per_chunk[1:] > 0).all()


@pytest.fixture(scope="module")
def tiny_llama_engine(tmp_path_factory):
    from ragkv.engine import Engine, load_model
    from ragkv.evals.testing import tiny_model_dir

    d = tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=7)
    return Engine(load_model(str(d), device="cpu", dtype="float32"))


def test_layer_mean_weighs_every_layer_alike():
    attn = torch.tensor([[1.0, 3.0, 0.0, 0.0], [0.0, 0.0, 50.0, 50.0]])  # [L=2, n=4]: the second layer 25x louder
    torch.testing.assert_close(layer_mean(attn), torch.tensor([0.125, 0.375, 0.25, 0.25]))
    assert torch.equal(layer_mean(attn[:1]), attn[0])  # one layer: its row, unscaled (picks unchanged)


def test_score_depths_choose_the_tokens_and_stay_exact_at_ratio_one(tiny_llama_engine):
    from tests.engine.test_blend import _parts

    eng = tiny_llama_engine
    prefix, kvs, q, _ = _parts(eng)
    prompt = Prompt.of(prefix, kvs, q)
    default = eng.run(prompt, Mode.BLEND, options=BlendOptions(0.3, selector="query"))
    named = eng.run(prompt, Mode.BLEND, options=BlendOptions(0.3, selector="query", score_depths=(0.25, 0.5, 0.75)))
    assert torch.equal(default.recomputed, named.recomputed) and torch.equal(default.logits, named.logits)
    mid = eng.run(prompt, Mode.BLEND, options=BlendOptions(0.3, selector="query", score_depths=(0.5,)))
    assert mid.recomputed.numel() == default.recomputed.numel()
    assert not torch.equal(mid.recomputed, default.recomputed)  # other layers' attention picks others
    full = eng.run(Prompt(list(prompt.prefix_ids) + [t for c in prompt.chunk_ids for t in c] + list(q)), Mode.FULL)
    whole = eng.run(prompt, Mode.BLEND, options=BlendOptions(1.0, selector="query", score_depths=(0.0, 0.9)))
    assert (whole.logits - full.logits).abs().max() <= 1e-4
    for bad in ((), (1.0,), (-0.1, 0.5)):
        with pytest.raises(ValueError, match="score_depths"):
            BlendOptions(score_depths=bad)
