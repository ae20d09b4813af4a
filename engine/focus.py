"""Question-guided focus: which retrieved chunks the question actually attends to.

A short pass of the question over the reused (cached, uncorrected) chunk KV reads the
question's attention at a band of upper-middle layers, where small models carry their
retrieval heads. Each chunk's relevance is how far its strongest token stands above
its mean there. `focus` mode then
answers over the relevant chunks only, so stale KV of chunks that do not hold the
answer cannot distract the question (on SmolLM2-135M it is their staleness, not the
answer chunk's, that loses accuracy under reuse: docs/quality.md).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ragkv.engine.forward import Step
from ragkv.engine.kv.cache import ChunkKV, KVCache
from ragkv.engine.select import layer_mean, question_attention_steps
from ragkv.engine.work import drain

if TYPE_CHECKING:
    from ragkv.engine.model_loading import LoadedModel

_SKIP_TOKENS = 4  # each chunk's first tokens collect sink-like attention under reuse: not relevance


@dataclass(frozen=True, slots=True)
class FocusOptions:
    """How `focus` mode picks the chunks it answers over (`BlendOptions.focus`)."""

    keep: float = 0.5  # keep chunks scoring at least this x the best (docs/quality.md)
    band: tuple[int, int] | None = None  # scoring layers [start, stop); None = `focus_layers`' default
    # when several chunks score within `keep` of the best (and their spread reaches `spread`),
    # the question needs more than one passage: drop none and blend over them all
    # (multi-passage questions lose most to full prefill when chunks are dropped; docs/quality.md)
    handover: bool = False
    # hand over only when the two runners-up score on average at least this x the best
    # (`spread`: a lookup has one chunk far above the rest, a multi-passage question several
    # close to it; 0.66, just above the needle lookups' highest, 0.65: docs/quality.md); 0 = whenever
    # several are kept
    spread: float = 0.66
    # ... or when at least this many chunks score within `keep` of the best: a lookup is over one
    # passage (two with a near-duplicate); three near the best mean the question needs several (MuSiQue's
    # lookups kept 3-5 passages and read 2-10x blend's KL to full prefill, the needles 1 or 2:
    # docs/quality.md); 0 = never
    several: int = 3
    # a lookup (several kept without handover, or one) over neighbour-conditioned KV: the share of
    # its kept chunks' tokens recomputed, picked by the question's attention (their KV attended to
    # neighbours this prompt does not hold). 0.0 = none: the kept chunks' KV is reused as stored (the
    # needles answered 1.00 at 2K and 4K, against 0.92 and 0.88 blended at the request's ratio:
    # docs/quality.md, issue 39); None = the request's recompute ratio, of the kept chunks' tokens;
    # 1.0 = every one, which is full prefill of the prefix, the kept chunks and the question
    lookup_ratio: float | None = 0.0
    # a lookup (no handover) answers over the chunks scoring at least this x the best; None = `keep`;
    # 1.0 = the best alone (neighbour KV lifts a distractor's score: docs/quality.md), beside a first
    # chunk served from its plain KV
    lookup_keep: float | None = 1.0

    def __post_init__(self) -> None:
        if self.lookup_keep is not None and not 0.0 < self.lookup_keep <= 1.0:
            raise ValueError(f"focus_lookup_keep must be in (0, 1], got {self.lookup_keep}")
        if self.lookup_ratio is not None and not 0.0 <= self.lookup_ratio <= 1.0:
            raise ValueError(f"focus_lookup_ratio must be in [0, 1], got {self.lookup_ratio}")
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"focus_keep must be in (0, 1], got {self.keep}")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"focus_spread must be in [0, 1], got {self.spread}")
        if self.several < 0 or self.several == 1:
            raise ValueError(f"focus_several must be 0 (never) or >= 2 chunks, got {self.several}")
        if self.band is not None and not 0 <= self.band[0] < self.band[1]:
            raise ValueError(f"focus_band must be (start, stop) with 0 <= start < stop, got {self.band}")


def focus_layers(num_layers: int, band: tuple[int, int] | None = None) -> range:
    """The layers whose attention scores chunks: `band` = [start, stop), or the default
    [2/3, 4/5) of the depth: layers 20-23 of SmolLM2's 30, each of which alone put the
    needle's chunk first in 75-100% of single-needle cases at 2K and 4K (the middle
    layer: chance)."""
    start, stop = band if band is not None else (round(num_layers * 2 / 3), round(num_layers * 4 / 5))
    start, stop = max(0, min(start, num_layers - 1)), min(num_layers, max(stop, start + 1))
    return range(start, stop)


@dataclass(frozen=True, slots=True)
class FocusScores:
    """What focus's one scoring pass read."""

    relevance: torch.Tensor  # [n_chunks] float32 in [0, 1]; the most relevant chunk scores near 1
    # [n_chunks] float32, summing to 1: each chunk's share of the question's attention onto the chunk
    # tokens at the scoring layers (the prefix aside), averaged over those layers: `kept_attention`
    mass: torch.Tensor | None = None
    # [C-P] float32: the question's attention onto every chunk token at `token_layers` (blend's query
    # selector reads it: a handover or a lookup picks its tokens without a second pass); None if not asked
    tokens: torch.Tensor | None = None


def chunk_relevance(lm: LoadedModel, prefix: ChunkKV | None, chunks: Sequence[ChunkKV],
                    question_ids: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """`score_chunks(...).relevance`: [n_chunks] float32 in [0, 1]."""
    return score_chunks(lm, prefix, chunks, question_ids, layers).relevance


def score_chunks(lm: LoadedModel, prefix: ChunkKV | None, chunks: Sequence[ChunkKV],
                 question_ids: torch.Tensor, layers: Sequence[int], token_layers: Sequence[int] = (),
                 staged: KVCache | None = None) -> FocusScores:
    """`score_steps` to its end (evals and tests)."""
    return drain(score_steps(lm, prefix, chunks, question_ids, layers, token_layers, staged))


def score_steps(lm: LoadedModel, prefix: ChunkKV | None, chunks: Sequence[ChunkKV],
                question_ids: torch.Tensor, layers: Sequence[int], token_layers: Sequence[int] = (),
                staged: KVCache | None = None, step_tokens: int = 0) -> Generator[Step, None, FocusScores]:
    """How strongly the question attends to each chunk over the reused cache, one layer (or a
    piece of `step_tokens` question rows) per step (`question_attention_steps`).

    Per layer in `layers`: the question's attention (summed over heads and question
    tokens) onto each chunk token; a chunk scores its strongest token past the first
    few, divided by its mean token (position-neutral: docs/quality.md); scores are
    normalized by the layer's best chunk and averaged over the layers. The same pass
    also reads the attention at `token_layers` onto every chunk token, when given (the
    scores blend's query selector computes over the same cache: equal to its own pass).

    Args:
        staged: a cache holding the prefix and the chunks staged from slot 0 (every layer the
            pass reads), which the pass then uses (a handover blends over it next: its chunks are
            staged once); None = a cache of the layers the pass reads, made here.
    """
    dev = lm.device
    segments = ([prefix] if prefix is not None else []) + list(chunks)
    ids = torch.cat([s.token_ids.to(dev) for s in segments] + [question_ids.to(dev)])  # [N]
    n, c = ids.shape[0], ids.shape[0] - question_ids.shape[0]
    layers = lm.adapter.scoring_layers(layers)  # global layers only, where the model has windows
    read = list(layers) + list(token_layers)
    top = max(read) + 1  # layers [0, top) are all the pass needs
    rope = lm.adapter.rotary(torch.arange(n, device=dev), torch.empty(0, dtype=lm.dtype, device=dev))
    if staged is None:
        cache = KVCache(top, lm.num_kv_heads, lm.head_dim, n, lm.dtype, dev)
        cache.stage([s.first_layers(top) for s in segments], rope)
    else:  # the question's K/V go past the chunks, where the next pass writes its own
        cache = staged
        cache.ensure(n)
    cache.length = n
    attn = yield from question_attention_steps(lm, ids, cache, rope, c, read, step_tokens)  # [len(read), c]
    p = prefix.num_tokens if prefix is not None else 0
    tokens = layer_mean(attn[len(layers):, p:]) if token_layers else None  # [C-P]
    attn = attn[:len(layers)]  # [len(layers), c]
    per_chunk, sums = [], []
    for ch in chunks:
        t = ch.num_tokens
        skip = _SKIP_TOKENS if t > 2 * _SKIP_TOKENS else 0
        a = attn[:, p + skip:p + t]  # [len(layers), t - skip]
        # strongest token over the chunk's mean: attention decays with distance, so the chunk
        # nearest the question collects more of it everywhere; the ratio cancels that lift
        per_chunk.append(a.amax(1) / a.mean(1).clamp_min(1e-12))  # [len(layers)]
        sums.append(attn[:, p:p + t].sum(1))  # [len(layers)]
        p += t
    scores = torch.stack(per_chunk, 1)  # [len(layers), n_chunks]
    scores = scores / scores.amax(1, keepdim=True).clamp_min(1e-12)
    mass = torch.stack(sums, 1)  # [len(layers), n_chunks]
    mass = (mass / mass.sum(1, keepdim=True).clamp_min(1e-12)).mean(0)  # [n_chunks]
    return FocusScores(scores.mean(0), mass=mass, tokens=tokens)  # [n_chunks]


def kept_attention(mass: torch.Tensor, kept: Sequence[int]) -> float:
    """The share of the question's attention onto the chunks that the `kept` ones hold, in
    [0, 1] (`FocusScores.mass`): near 1 when a lookup's chunk holds the question's attention,
    lower when the dropped chunks drew much of it (a lookup then answers without them)."""
    return float(mass[list(kept)].sum()) if len(kept) else 0.0


def pick_chunks(relevance: torch.Tensor, keep: float) -> list[int]:
    """Indices (in prompt order) of the chunks scoring at least `keep` x the best."""
    best = float(relevance.max())
    return [i for i, r in enumerate(relevance.tolist()) if r >= keep * best]



def spread(relevance: torch.Tensor, runners_up: int = 2) -> float:
    """How close the next chunks score to the best: the mean of the `runners_up` best
    after it, over the best, in [0, 1]. A lookup has one chunk far above the rest (needle
    tasks: at most 0.65); a question over several passages has runners-up close to the
    best (MuSiQue: 26-29 of 30 reach 0.66, with 5 passages as with 10, on both models). Only the runners-up
    count, not every other chunk: the mean of all of them falls as more distractors are
    retrieved (docs/quality.md). 0.0 for a lone chunk."""
    if relevance.numel() < 2:
        return 0.0
    top = relevance.topk(min(runners_up + 1, relevance.numel())).values  # [k + 1], best first
    return float(top[1:].mean() / top[0].clamp_min(1e-12))
