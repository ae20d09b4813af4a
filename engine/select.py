"""Which chunk tokens selective recompute picks: scores in, sorted token offsets out.

Scores come from one of the selectors (engine.blend.Selector): K/V deviation at an
early layer (CacheBlend), or the question's attention onto the chunk tokens from a
pass of the question over the reused cache. Picking then honours the options shared
by every selector: a budget (fixed, or adaptive to the score mass), sink tokens at
each chunk's start, and whole windows (CacheClip's grouping).
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ragkv.engine.forward import Step, layer_steps, span
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.rope import RopeTables
from ragkv.engine.work import drain

if TYPE_CHECKING:
    from ragkv.engine.model_loading import LoadedModel


def tokens_for_mass(score: torch.Tensor, mass: float) -> int:
    """The fewest tokens whose scores hold `mass` of the total (score: [n]); n when all are 0."""
    sorted_s = torch.sort(score.float().clamp_min(0), descending=True).values  # [n]
    total = float(sorted_s.sum())
    if total <= 0:
        return int(score.shape[0])
    return min(int(score.shape[0]), int(torch.searchsorted(torch.cumsum(sorted_s, 0), mass * total)) + 1)


class Budget(str, enum.Enum):
    """How the recompute budget is spread over the chunks."""

    GLOBAL = "global"  # the best-scoring tokens of the whole context, wherever they sit
    CHUNK = "chunk"  # each chunk gets its length's share of the budget and picks its own best


class Picking(Protocol):
    """What picking needs to know (engine.blend.BlendOptions has it): this module names no
    blend type, so blend -> select is the only way the import goes. Read-only, so a frozen
    dataclass has it."""

    @property
    def recompute_ratio(self) -> float:
        """Fraction of chunk tokens (the most, when adaptive)."""

    @property
    def adaptive_mass(self) -> float | None:
        """Pick the fewest tokens holding this share of the score."""

    @property
    def min_ratio(self) -> float:
        """Adaptive: never fewer than this fraction."""

    @property
    def budget(self) -> Budget:
        """Spread over the whole context, or per chunk."""

    @property
    def sink_tokens(self) -> int:
        """The first tokens of every chunk are always picked."""

    @property
    def window(self) -> int:
        """Pick whole windows of this many tokens."""


def select_tokens(score: torch.Tensor, chunk_lens: Sequence[int], options: Picking) -> torch.Tensor:
    """Pick chunk tokens to recompute: sinks first, then by score, within the budget.

    The budget is round(recompute_ratio * n) tokens; with `adaptive_mass` it is the fewest
    tokens whose scores hold that share of the total, clamped to [min_ratio, recompute_ratio].
    Under `Budget.CHUNK` it is split over the chunks in proportion to their lengths
    (largest remainder), and each chunk spends its share on its own best tokens.

    Args:
        score: [n] per chunk token, higher = recompute first (n = sum(chunk_lens)).

    Returns:
        [R] int64 sorted offsets into the concatenated chunk tokens.
    """
    n = score.shape[0]
    if sum(chunk_lens) != n:
        raise ValueError(f"chunk_lens sum to {sum(chunk_lens)}, but there are {n} scores")
    budget = int(round(options.recompute_ratio * n))
    if options.adaptive_mass is not None and budget > 0:
        budget = max(int(round(options.min_ratio * n)), min(budget, tokens_for_mass(score, options.adaptive_mass)))
    if options.budget is Budget.GLOBAL:
        return _pick(score, budget, chunk_lens, options)
    picks, off = [], 0
    for t, b in zip(chunk_lens, _split_budget(budget, chunk_lens)):
        picks.append(_pick(score[off:off + t], b, [t], options) + off)
        off += t
    return torch.cat(picks)


def _split_budget(budget: int, chunk_lens: Sequence[int]) -> list[int]:
    """`budget` tokens shared over chunks in proportion to their lengths (largest remainder)."""
    n = sum(chunk_lens)
    exact = [budget * t / n for t in chunk_lens]
    shares = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])[: budget - sum(shares)]:
        shares[i] += 1
    return shares


def _pick(score: torch.Tensor, budget: int, chunk_lens: Sequence[int], options: Picking) -> torch.Tensor:
    """The `budget` best of score: [n] (sinks of each chunk first, whole windows) as sorted offsets."""
    n = score.shape[0]
    if budget >= n:
        return torch.arange(n, device=score.device)
    score = score.float().clone()
    if options.sink_tokens:
        off = 0
        for t in chunk_lens:
            score[off:off + min(options.sink_tokens, t)] = float("inf")
            off += t
    if options.window > 1:
        w = options.window
        pad = (-n) % w
        padded = torch.cat([score, score.new_full((pad,), float("-inf"))]) if pad else score
        win_score = padded.view(-1, w).amax(1)  # [n_windows]
        order = torch.argsort(win_score, descending=True, stable=True)  # windows, best first
        tokens = (order[:, None] * w + torch.arange(w, device=score.device)).flatten()
        picked = tokens[tokens < n][:budget]
    else:
        picked = torch.topk(score, budget, sorted=False).indices
    return torch.sort(picked).values


def layer_mean(attn: torch.Tensor) -> torch.Tensor:
    """Per-token scores from several layers' attention: each layer's row normalized to sum 1, then
    averaged (a layer of sharper attention does not outweigh the rest); one layer's row as it is.

    Args:
        attn: [L, n] attention mass per token, one row per layer.

    Returns:
        [n] float32.
    """
    if attn.shape[0] == 1:
        return attn[0]
    return (attn / attn.sum(1, keepdim=True).clamp_min(1e-12)).mean(0)


def question_attention_steps(lm: LoadedModel, ids: torch.Tensor, cache: KVCache, rope_all: RopeTables, c: int,
                             layers: Sequence[int], step_tokens: int = 0) -> Generator[Step, None, torch.Tensor]:
    """Attention of the question tokens onto every context token at each of `layers`.

    Runs only the question (prompt positions [c, N)) through layers [0, max(layers)] over
    the reused cache (the one layer loop, `layer_steps`: one layer per step, so the
    scheduler runs other requests' steps between them, and a layer still loading parks the
    pass; a question of more than `step_tokens` tokens runs each layer in pieces, as a
    prompt pass does), writing the question's K/V into the cache as it goes (a later pass
    overwrites them); at each of `layers` the weights the layer's own attention applied (its
    mask and windows) are summed over heads and question tokens. The cache needs only layers
    [0, max(layers)].

    Returns:
        [len(layers), c] float32 attention mass per context token, one row per layer.
    """
    n = ids.shape[0]
    pos = torch.arange(c, n, device=ids.device)  # [Q]
    want = sorted({int(i) for i in layers})
    mass = {i: torch.zeros(n, dtype=torch.float32, device=ids.device) for i in want}  # [N] per layer
    yield from layer_steps(lm, lm.adapter.embed(ids[c:]), rope_all[c:], span(cache, pos, pos, n, lm),
                           range(want[-1] + 1), pos=pos, mass=mass, step_tokens=step_tokens)
    return torch.stack([mass[int(i)][:c] for i in layers])  # [len(layers), c]


def question_attention(lm: LoadedModel, ids: torch.Tensor, cache: KVCache, rope_all: RopeTables, c: int,
                       layers: Sequence[int]) -> torch.Tensor:
    """`question_attention_steps` to its end: [len(layers), c] (evals and tests)."""
    return drain(question_attention_steps(lm, ids, cache, rope_all, c, layers))
