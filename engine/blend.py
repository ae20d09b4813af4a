"""Run a RAG prompt `[prefix][chunk 1]...[chunk k][question]` in one of the blend modes.

Modes (all return the same BlendResult, so they compare like with like):
- full:   plain prefill of every token; the baseline.
- prefix: reuse only the shared prefix's KV; recompute chunks and question.
- reuse:  concatenate cached KV; recompute only the question.
- focus:  a pass of the question over the reused cache scores each chunk by its
          attention (engine.focus); chunks below `FocusOptions.keep` x the best are dropped,
          and the prompt runs over the kept ones: exact reuse when one is kept (its KV
          was computed right after the prefix), blend when several are; kept chunks
          whose KV was computed after neighbours are blended at `FocusOptions.lookup_ratio`
          (0, the default: reused as stored; 1.0: recomputed). It answers a shorter prompt
          than full prefill, by design. With `FocusOptions.handover`, several kept chunks
          whose spread reaches `FocusOptions.spread` (the runners-up score close to the
          best), or `FocusOptions.several` chunks kept, mean the question
          needs several passages: none is dropped, and all are blended; otherwise the
          question is a lookup, over the chunks within `FocusOptions.lookup_keep` of the
          best (by default the best alone; and a first chunk served from its plain KV beside
          the others' neighbour KV: its KV is exact, its score not comparable; one keeping
          every chunk is the handover's blend), their KV by default reused as stored. The
          same pass reads the query selector's layers, so what follows it picks its tokens
          without a second pass.
- blend:  selective recompute. With the `deviation` selector (CacheBlend), layers
          [0, check_layer) run for every chunk token; at the check layer the K/V of
          every token are recomputed and the chunk tokens whose K/V deviate most from
          the cached ones are kept (top `recompute_ratio`); that layer and the later
          ones recompute only those and the question. With the `query` selector, a
          pass of the question over the reused cache scores the chunk tokens by its
          attention first, and every layer recomputes only the picked tokens; a first
          chunk whose KV was computed right after the prefix (plain KV) is exact in the
          prompt, so none of its tokens is picked and the budget goes to the others. Picked
          tokens attend to the whole blended cache under a mask built from positions.
The last layer computes its output for the last position only (K/V for all), in every
mode: nothing else reads it.
At recompute_ratio 1.0, `blend` equals `full` within float tolerance.

Nothing here knows about tokenization, storage or gRPC: token ids and tensors only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace

import torch

from ragkv.engine.focus import FocusOptions, FocusScores, focus_layers, kept_attention, pick_chunks, score_steps, spread
from ragkv.engine.forward import Keep, Step, layer_steps, project_kv, span
from ragkv.engine.kv.cache import ChunkKV, KVCache, layers_pending
from ragkv.engine.kv.tree_node import TreeContext, TreeLease
from ragkv.engine.model_loading import LoadedModel
from ragkv.engine.rope import RopeTables
from ragkv.engine.select import Budget, layer_mean, question_attention_steps, select_tokens, tokens_for_mass
from ragkv.engine.work import wait_for
from ragkv.types import FocusSignal, Mode


class Selector(str, enum.Enum):
    """What decides which chunk tokens `blend` recomputes."""

    DEVIATION = "deviation"  # CacheBlend: K/V deviation at the check layer
    QUERY = "query"  # the question's attention onto chunk tokens, from a pass over the reused cache


@dataclass(frozen=True, slots=True)
class BlendOptions:
    """How `blend` mode picks the tokens it recomputes."""

    recompute_ratio: float = 0.15  # fraction of chunk tokens recomputed (the most, when adaptive)
    selector: Selector = Selector.QUERY  # lowest KL to full at every ratio measured (docs/quality.md)
    check_layer: int = 1  # deviation: layers [0, check_layer) run for every chunk token, scored here
    # query: the layers whose attention scores tokens, as fractions of the depth in [0, 1) (layer
    # int(f * L)), each layer's attention normalized to sum 1 and averaged (`select.layer_mean`)
    # (docs/quality.md: over the middle layer alone, KL to full prefill was 1.1-1.3x higher, both models)
    score_depths: tuple[float, ...] = (0.25, 0.5, 0.75)
    sink_tokens: int = 0  # the first tokens of every chunk are always picked (within the budget)
    window: int = 1  # pick whole windows of this many tokens (CacheClip grouping); 1 = tokens
    budget: Budget = Budget.GLOBAL  # spread the picks over the whole context, or per chunk
    adaptive_mass: float | None = None  # pick the fewest tokens holding this share of the score
    min_ratio: float = 0.0  # adaptive: never fewer than this fraction
    # quality guard (query selector, with adaptive_mass): when holding adaptive_mass of the
    # question's attention needs more than recompute_ratio of the chunk tokens, reuse is
    # unsafe for this request: run it as full prefill instead of a starved blend
    fallback_full: bool = False
    context_temperature: float = 1.0  # APE-style: reused chunk keys are divided by this (<1 sharpens)
    focus: FocusOptions = FocusOptions()  # how FOCUS picks its chunks

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if not 0.0 <= self.min_ratio <= self.recompute_ratio:
            raise ValueError(f"min_ratio must be in [0, recompute_ratio={self.recompute_ratio}], "
                             f"got {self.min_ratio}")
        if self.adaptive_mass is not None and not 0.0 < self.adaptive_mass <= 1.0:
            raise ValueError(f"adaptive_mass must be in (0, 1], got {self.adaptive_mass}")
        if self.context_temperature <= 0:
            raise ValueError(f"context_temperature must be > 0, got {self.context_temperature}")
        object.__setattr__(self, "selector", Selector(self.selector))
        object.__setattr__(self, "budget", Budget(self.budget))
        if self.check_layer < 1:  # layer 0's K/V depend on the token alone: nothing to score there
            raise ValueError(f"check_layer must be >= 1 (layer 0's K/V do not depend on context), "
                             f"got {self.check_layer}")
        if self.fallback_full and (self.adaptive_mass is None or self.selector is not Selector.QUERY):
            raise ValueError("fallback_full needs adaptive_mass and the query selector: the guard reads "
                             "how much of the question's attention the budget holds")
        depths = tuple(float(f) for f in self.score_depths)
        if not depths or not all(0.0 <= f < 1.0 for f in depths):
            raise ValueError(f"score_depths must be fractions of the depth in [0, 1), at least one, got {depths}")
        object.__setattr__(self, "score_depths", depths)
        if self.sink_tokens < 0 or self.window < 1:
            raise ValueError(f"sink_tokens must be >= 0 and window >= 1, got {self.sink_tokens}, "
                             f"{self.window}")


@dataclass(slots=True)
class BlendResult:
    """A prompt run to its last position, ready for decoding."""

    mode: Mode
    token_ids: torch.Tensor  # [N] int64, the whole prompt
    logits: torch.Tensor  # [V] float32, next-token logits at the last prompt position
    cache: KVCache  # K (after RoPE) and V of all N prompt tokens, room to decode
    recomputed: torch.Tensor  # [R] int64, prompt positions of chunk tokens recomputed in every layer
    n_chunk_tokens: int  # chunk tokens (the candidates for recompute)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    used_chunks: tuple[int, ...] | None = None  # focus: indices of the chunks kept; None = all
    chunk_scores: tuple[float, ...] | None = None  # focus: each chunk's relevance, the best near 1
    cached_tokens: int = 0  # prompt tokens whose KV was read from a cache, not computed here
    fell_back: bool = False  # the quality guard ran it as full prefill (BlendOptions.fallback_full)
    handed_over: bool = False  # focus handed over to blend over every chunk (FocusOptions.handover)
    focus_signal: FocusSignal | None = None  # focus: its rule's decision and how sure (QueryStats.focus)

    @property
    def n_prompt_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def recompute_fraction(self) -> float:
        """Recomputed share of chunk tokens (1.0 for full and prefix, 0.0 for reuse)."""
        return self.recomputed.numel() / self.n_chunk_tokens if self.n_chunk_tokens else 1.0

    @property
    def ttft_s(self) -> float:
        return sum(self.timings.values())


# yields the tokens each layer computed, or a WaitFor while a chunk's next layer is still
# arriving (layer-wise loading); returns the result
PromptSteps = Generator[Step, None, BlendResult]


@dataclass(frozen=True, slots=True)
class Prompt:
    """`[prefix][chunk 1]...[chunk k][question]`: what a prompt pass runs (`Engine.run_steps`)."""

    question_ids: Sequence[int]  # always computed; the last prompt position is its last token
    prefix_ids: Sequence[int] = ()  # the shared prefix the chunks' KV was computed after
    chunk_ids: Sequence[Sequence[int]] = ()  # each chunk's tokens
    # each chunk's KV, as computed after the prefix (the chunk modes read it; FULL and PREFIX
    # recompute every chunk token); a chunk computed for this prompt (`fresh`) is not a cache hit
    chunks: Sequence[ChunkKV] | None = None
    # the tokens that choose chunk tokens (query selector, the quality guard) and chunks (focus),
    # in place of the question: a conversation's later calls choose by its question; None = question_ids
    select_ids: Sequence[int] | None = None
    # a hybrid with a KV tree: also keep its recurrent state after this many prompt tokens
    # (where the answer's header starts: the next call's prompt shares the tokens before it)
    snapshot_at: int | None = None
    # the prefix's KV (positions 0..P-1, K before RoPE) when the caller has it: a request's own
    # instructions, read from its tenant's KV tree or computed for it; None = the engine's own
    prefix_kv: ChunkKV | None = None

    @classmethod
    def of(cls, prefix_ids: Sequence[int], chunks: Sequence[ChunkKV], question_ids: Sequence[int],
           select_ids: Sequence[int] | None = None) -> Prompt:
        """A prompt over chunks' computed KV, their tokens read from it."""
        return cls(question_ids, prefix_ids, [ch.token_ids.tolist() for ch in chunks], chunks, select_ids)


NewCache = Callable[[int], "KVCache | None"]  # a request cache of N tokens from the engine's pool, or None


def request_cache(lm: LoadedModel, capacity: int, new_cache: NewCache | None = None) -> KVCache:
    """A request's cache for `capacity` tokens: from the engine's decode pool (`new_cache`, its
    KV then never copied to decode), else one of its own (no pool, or the pool is full)."""
    cache = new_cache(capacity) if new_cache is not None else None
    return cache if cache is not None else KVCache(lm.kv_layers, lm.num_kv_heads, lm.head_dim, capacity, lm.dtype,
                                                   lm.device)


def prompt_steps(
    lm: LoadedModel,
    prefix: ChunkKV | None,
    chunks: Sequence[ChunkKV],
    question_ids: Sequence[int] | torch.Tensor,
    mode: Mode,
    options: BlendOptions = BlendOptions(),
    reserve_tokens: int = 256,
    select_ids: Sequence[int] | torch.Tensor | None = None,
    snapshot_at: int | None = None,
    step_tokens: int = 0,
    new_cache: NewCache | None = None,
) -> PromptSteps:
    """Run a prompt in `mode`, one decoder layer per step. For FULL, `prefix` and `chunks`
    give only their token ids.

    A generator: it yields after each layer (the number of tokens that layer computed), so
    a scheduler can run other requests' decode steps between the layers of a long prompt
    pass; it returns the BlendResult. The work and its results are the same as in one go.

    Args:
        prefix: the shared prefix's KV (positions 0..P-1); None means no prefix.
        chunks: each chunk's KV as computed after that same prefix (right after it, or after
            context tokens too: neighbour-conditioned KV, positions[0] > P).
        question_ids: the question's token ids, always recomputed.
        reserve_tokens: decode room preallocated after the prompt.
        select_ids: the tokens whose attention chooses the chunk tokens (query selector, the
            quality guard) and the chunks (focus), in place of `question_ids`: a conversation's
            later calls choose by its question, so their chunk KV is the first call's (the KV
            tree reuses it exactly); None = `question_ids`.
        snapshot_at: a hybrid's prompt position whose recurrent state is kept too (`KVCache.mark`).
        step_tokens: prompt rows a step computes at most (chunked prefill, `layer_steps`); 0 = a
            whole layer per step.
        new_cache: the engine's decode pool's cache maker (`DecodePool.new_cache`): the request's
            cache is a run of the pool, where it then decodes with no copy; None = a cache of its
            own. (A focus pass, and the guard's fallback to full, make their own: they move into
            the pool once when they decode.)
    """
    mode = Mode(mode)
    if mode is Mode.FOCUS:
        return (yield from _focused_steps(lm, prefix, chunks, question_ids, options, reserve_tokens, select_ids,
                                          step_tokens))
    if mode is Mode.BLEND and options.selector is Selector.QUERY:  # (no name here holds the cache:
        # the guard's fallback frees it before running full)
        a = _assemble(lm, prefix, chunks, question_ids, mode, options, reserve_tokens, step_tokens, new_cache)
        return (yield from _query_blend_steps(lm, a, prefix, chunks, options, reserve_tokens, select_ids))
    a = _assemble(lm, prefix, chunks, question_ids, mode, options, reserve_tokens, step_tokens, new_cache)
    a.cache.mark = snapshot_at
    if mode is Mode.BLEND:  # deviation: every token through the check layer, then the picked ones
        check = min(options.check_layer, lm.num_layers - 1)
        return (yield from _layers(lm, a, chunks, options, first_active=0, check=check))
    # contiguous active tokens: FULL all, PREFIX every chunk token and the question, REUSE the question
    first_active = {Mode.FULL: 0, Mode.PREFIX: a.p, Mode.REUSE: a.c}[mode]
    return (yield from _layers(lm, a, chunks, options, first_active))


@dataclass(slots=True)
class _Assembled:
    """`[prefix][chunks][question]` laid out at contiguous positions, its cache staged."""

    mode: Mode  # the mode being run
    ids: torch.Tensor  # [N] int64, the whole prompt
    p: int  # prefix tokens
    c: int  # context tokens (prefix + chunks); the question is [c, N)
    cache: KVCache  # reused segments staged (written layer by layer as the pass reaches them)
    rope_all: RopeTables  # rotary tables of every position (N rows)
    timer: _PhaseTimer  # phases so far
    step_tokens: int = 0  # prompt rows a step computes at most (`layer_steps`); 0 = a whole layer

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])


def _assemble(lm: LoadedModel, prefix: ChunkKV | None, chunks: Sequence[ChunkKV],
              question_ids: Sequence[int] | torch.Tensor, mode: Mode, options: BlendOptions,
              reserve_tokens: int, step_tokens: int = 0, new_cache: NewCache | None = None) -> _Assembled:
    dev = lm.device
    timer = _PhaseTimer(dev)
    segments = ([prefix] if prefix is not None else []) + list(chunks)
    if mode is not Mode.FULL:
        _check_segments(lm, prefix, chunks)
    q_ids = torch.as_tensor(question_ids, dtype=torch.long).to(dev)  # [Q]
    if q_ids.numel() == 0:
        raise ValueError("question_ids is empty: the last prompt position must be a question token")
    ids = torch.cat([s.token_ids.to(dev) for s in segments] + [q_ids])  # [N]
    n = ids.shape[0]
    p = prefix.num_tokens if prefix is not None else 0
    cache = request_cache(lm, n + reserve_tokens, new_cache)
    cache.length = n
    rope_all = lm.adapter.rotary(torch.arange(n, device=dev), _like(lm))  # N rows
    if mode is not Mode.FULL:  # layers of chunks still loading are written as the pass reaches them
        temper = mode in (Mode.REUSE, Mode.BLEND) and options.context_temperature != 1.0
        cache.stage(segments, rope_all, (p, options.context_temperature) if temper else None)
    timer.lap("assemble")
    return _Assembled(mode, ids, p, n - q_ids.shape[0], cache, rope_all, timer, step_tokens)


def _score_layers(lm: LoadedModel, options: BlendOptions) -> list[int]:
    """The layers whose attention the query selector reads (`BlendOptions.score_depths`): each the
    global layer nearest it where the model has windows (`Adapter.scoring_layers`)."""
    depths = [min(lm.num_layers - 1, int(f * lm.num_layers)) for f in options.score_depths]
    return sorted({lm.adapter.scoring_layers([i])[0] for i in depths})


def _query_blend_steps(lm: LoadedModel, a: _Assembled, prefix: ChunkKV | None, chunks: Sequence[ChunkKV],
                       options: BlendOptions, reserve_tokens: int,
                       select_ids: Sequence[int] | torch.Tensor | None = None,
                       scores: torch.Tensor | None = None) -> PromptSteps:
    """BLEND with the query selector: the question's attention picks the tokens first.

    Args:
        scores: [C-P] the question's attention onto the chunk tokens at the scoring layer, when
            focus's scoring pass has read it already (no second pass); None = run the pass here.
    """
    p, c, n = a.p, a.c, a.n
    if scores is None:
        scores = yield from _token_scores(lm, a, _score_layers(lm, options), select_ids)  # [C-P]
    a.timer.lap("score")
    mass = options.adaptive_mass  # set whenever fallback_full is (BlendOptions checks)
    if options.fallback_full and mass is not None and tokens_for_mass(scores, mass) > round(
            options.recompute_ratio * (c - p)):
        q_ids, phases, step_tokens = a.ids[c:], a.timer.phases, a.step_tokens
        del a  # the guard: this request's attention is too spread for the budget
        res = yield from prompt_steps(lm, prefix, chunks, q_ids, Mode.FULL, options, reserve_tokens, select_ids,
                                      step_tokens=step_tokens)
        res.timings, res.fell_back = {**phases, **res.timings}, True
        return res
    picked = _pick_inexact(scores, chunks, p, options)
    if picked.numel() == c - p:  # every chunk token: recompute the prefix too and run as full
        return (yield from _layers(lm, a, chunks, options, first_active=0))  # prefill does (same sums)
    pos = torch.cat([picked + p, torch.arange(c, n, device=lm.device)])  # [S]
    return (yield from _layers(lm, a, chunks, options, first_active=-1, pos=pos))


def _pick_inexact(scores: torch.Tensor, chunks: Sequence[ChunkKV], p: int, options: BlendOptions) -> torch.Tensor:
    """`select_tokens` over the chunks whose KV this prompt does not hold exactly: a first chunk
    computed right after the prefix (plain KV) holds, in this prompt, the very KV full prefill
    computes, so recomputing its tokens changes nothing. The budget stays the ratio of every
    chunk token; it is spent on the others (scores: [C-P]; returns [R] sorted chunk offsets)."""
    lens = [ch.num_tokens for ch in chunks]
    if len(chunks) < 2 or not _exact_first(chunks, p):
        return select_tokens(scores, lens, options)
    n, exact = sum(lens), lens[0]
    budget = round(options.recompute_ratio * n)
    if budget >= n:  # every token: the pass is full prefill (ratio 1.0 equals it)
        return select_tokens(scores, lens, options)
    if budget >= n - exact:  # every inexact token
        return torch.arange(exact, n, device=scores.device)
    share = budget / (n - exact)  # of the inexact tokens: the same number of tokens recomputed
    rest = replace(options, recompute_ratio=share, min_ratio=min(share, options.min_ratio * n / (n - exact)))
    return select_tokens(scores[exact:], lens[1:], rest) + exact


def _exact_first(chunks: Sequence[ChunkKV], p: int) -> bool:
    """Whether the first chunk's KV is, in this prompt, full prefill's: computed right after the
    prefix (`p` tokens), with nothing between (plain KV)."""
    return bool(chunks) and not chunks[0].after_context and int(chunks[0].positions[0]) == p


def _token_scores(lm: LoadedModel, a: _Assembled, layers: Sequence[int],
                  select_ids: Sequence[int] | torch.Tensor | None) -> Generator[Step, None, torch.Tensor]:
    """The query selector's pass, one layer per step: the choosing tokens' attention onto every
    chunk token, [C-P]."""
    p, c = a.p, a.c
    if (w := wait_for(a.cache.pending(max(layers)))) is not None:  # the pass reads layers up to it
        yield w
    if select_ids is None:
        attn = yield from question_attention_steps(lm, a.ids, a.cache, a.rope_all, c, layers, a.step_tokens)  # [L, C]
        return layer_mean(attn[:, p:])  # [C-P]
    # the choosing tokens' K/V go where the question's will (the pass that follows overwrites them)
    ids = torch.cat([a.ids[:c], torch.as_tensor(select_ids, dtype=torch.long).to(lm.device)])  # [C + A]
    a.cache.ensure(ids.shape[0])
    rope = lm.adapter.rotary(torch.arange(ids.shape[0], device=lm.device), _like(lm))
    attn = yield from question_attention_steps(lm, ids, a.cache, rope, c, layers, a.step_tokens)  # [L, C]
    return layer_mean(attn[:, p:])  # [C-P]


def _layers(lm: LoadedModel, a: _Assembled, chunks: Sequence[ChunkKV], options: BlendOptions,
            first_active: int, check: int = -1, pos: torch.Tensor | None = None) -> PromptSteps:
    """The layer loop every mode shares, one layer per step.

    Args:
        first_active: the active tokens are [first_active, N); -1: exactly `pos`.
        check: deviation blend's check layer (-1: none): from it on only the picked tokens
            and the question run.
        pos: [S] sorted positions of the active tokens, with first_active -1: the picked chunk
            tokens' (each < c), then every question token's.
    """
    dev, ad = lm.device, lm.adapter
    p, c, n, cache, timer = a.p, a.c, a.n, a.cache, a.timer
    if pos is None:
        pos = torch.arange(first_active, n, device=dev)  # [S] positions of the active tokens
    h = ad.embed(a.ids[pos])  # [S, hidden]
    slots: slice | torch.Tensor = slice(first_active, n) if first_active >= 0 else pos
    rope = a.rope_all[pos]  # S rows
    # contiguous active tokens from first_active on recompute every chunk token past it (none
    # for reuse); deviation blend replaces this with its pick at the check layer
    # (`pos` given: the picked chunk positions, then the question's [c, n), so the first rows are
    # the picks; a boolean mask here made the host wait for the device once a pass)
    recomputed = pos[:pos.shape[0] - (n - c)] if first_active < 0 else \
        torch.arange(min(max(first_active, p), c), c, device=dev)
    if check >= 0:  # every active token through the layers before the check layer
        h = yield from layer_steps(lm, h, rope, span(cache, slots, pos, n, lm), range(check), pos=pos,
                                   step_tokens=a.step_tokens)
        timer.lap("layers_full")
        if (w := wait_for(cache.pending(check))) is not None:
            yield w
        cache.fill(check)
        # score chunk tokens by how far their fresh K/V moved from the cached ones
        k, v = project_kv(ad, check, h)  # [Hkv, S, D], every active token
        k = rope.apply(k, check)
        rows = slice(p - first_active, c - first_active)  # chunk tokens among the active rows
        deviation = ((k[:, rows] - cache.k[check, :, p:c]).float().pow(2).sum((0, 2))
                     + (v[:, rows] - cache.v[check, :, p:c]).float().pow(2).sum((0, 2)))  # [C-P]
        cache.k[check, :, slots], cache.v[check, :, slots] = k, v  # fresh beats stale, for every token
        picked = select_tokens(deviation, [ch.num_tokens for ch in chunks], options)  # [R] chunk offsets
        recomputed = picked + p  # [R] prompt positions
        h = h[torch.cat([recomputed, torch.arange(c, n, device=dev)]) - first_active]  # the picked rows
        pos = slots = torch.cat([recomputed, torch.arange(c, n, device=dev)])  # [S']
        rope = a.rope_all[pos]
        timer.lap("select")
    h = yield from layer_steps(lm, h, rope, span(cache, slots, pos, n, lm), range(max(check, 0), lm.num_layers),
                               Keep.LAST, pos=pos, n_keys=n, step_tokens=a.step_tokens)
    timer.lap("layers_partial" if check >= 0 else "layers")

    logits = ad.logits(h[-1:])[0]  # [V]
    timer.lap("logits")
    return BlendResult(a.mode, a.ids, logits, cache, recomputed, c - p, timer.phases)


def resume_steps(lm: LoadedModel, lease: TreeLease, ids: Sequence[int], mode: Mode,
                 layout: TreeContext | None = None, reserve_tokens: int = 256,
                 snapshot_at: int | None = None, step_tokens: int = 0,
                 new_cache: NewCache | None = None) -> PromptSteps:
    """Run a prompt whose first tokens' KV the KV tree holds: only the rest is computed.

    The cache takes the lease's KV (the context, blended as its first request's pass left
    it, and the matched tokens after it; a part still being read from disk, layer by layer as
    the pass reaches each), the lease is released, and every later token runs through every
    layer, as the question does in any mode. Where the tree shares the engine's decode pool
    and holds the path in one run with free slots after it, the cache runs on from the path
    in place instead (`TreeLease.lend`): nothing is copied, and the lease lasts the request.

    Args:
        lease: the matched path (`KVTree.match`): context tokens and `matched` tokens of `ids`.
        ids: the tokens after the context (the path the tree matched against).
        layout: where the prefix and the chunks lie in this prompt, and what the pass decided
            (FULL and PREFIX, whose contexts many prompts share); None = the context's own.
        snapshot_at: a hybrid's prompt position whose recurrent state is kept too (`KVCache.mark`).
        step_tokens: prompt rows a step computes at most (`layer_steps`); 0 = a whole layer.
    """
    dev = lm.device
    timer = _PhaseTimer(dev)
    ctx = layout or lease.context
    prompt = torch.tensor([*lease.context_ids, *ids], dtype=torch.long, device=dev)  # [N]
    n = int(prompt.shape[0])
    # the path read where the tree holds it, in the engine's pool: room for the prompt at least (the decode grows it)
    lent = lease.lend(n + reserve_tokens, least=n + 1)
    if lent is not None:  # the lease is the cache's now: let go when its run goes back
        cache, first = lent, lease.tokens
    else:
        cache = request_cache(lm, n + reserve_tokens, new_cache)
        try:
            first = lease.write_into(cache, layered=True)  # positions [0, first) are the tree's
            cache.from_tree = first
            cache.recurrent = lease.recurrent_state()  # a hybrid's state after them (a copy; None otherwise)
        finally:
            lease.release()
    cache.mark = snapshot_at
    cache.length = n
    rope_all = lm.adapter.rotary(torch.arange(n, device=dev), _like(lm))  # N rows
    timer.lap("tree")
    a = _Assembled(Mode(mode), prompt, ctx.prefix_tokens, ctx.chunk_end, cache, rope_all, timer, step_tokens)
    res = yield from _layers(lm, a, [], BlendOptions(), first_active=first)
    res.n_chunk_tokens = ctx.chunk_tokens
    res.used_chunks, res.chunk_scores = ctx.used_chunks, ctx.chunk_scores
    res.handed_over, res.fell_back = ctx.handed_over, ctx.fell_back
    res.cached_tokens = first
    return res


def tree_context(res: BlendResult, question_tokens: int, prefix_tokens: int) -> TreeContext:
    """What a finished prompt pass decided, for the KV tree to replay."""
    return TreeContext(prefix_tokens=prefix_tokens, chunk_end=res.n_prompt_tokens - question_tokens,
                       chunk_tokens=res.n_chunk_tokens, used_chunks=res.used_chunks,
                       chunk_scores=res.chunk_scores, handed_over=res.handed_over, fell_back=res.fell_back)


def _focused_steps(lm: LoadedModel, prefix: ChunkKV | None, chunks: Sequence[ChunkKV],
                   question_ids: Sequence[int] | torch.Tensor, options: BlendOptions,
                   reserve_tokens: int, select_ids: Sequence[int] | torch.Tensor | None = None,
                   step_tokens: int = 0) -> PromptSteps:
    """FOCUS: score the chunks, then run the prompt over the kept ones."""
    _check_segments(lm, prefix, chunks)
    q_ids = torch.as_tensor(question_ids, dtype=torch.long)  # [Q]
    if q_ids.numel() == 0:
        raise ValueError("question_ids is empty: the last prompt position must be a question token")
    timer = _PhaseTimer(lm.device)
    layers = lm.adapter.scoring_layers(focus_layers(lm.num_layers, options.focus.band))
    # the pass also reads the query selector's layer, so a handover or a lookup that blends picks
    # its tokens from it (a tempered context would score otherwise: it runs its own pass)
    token_layers = _score_layers(lm, options) if options.selector is Selector.QUERY \
        and options.context_temperature == 1.0 else []
    top = max([*layers, *token_layers])
    if (w := wait_for(layers_pending(chunks, top))) is not None:  # the pass reads every chunk's layers [0, top]
        yield w  # (waited for off the scheduler)
    choosing = q_ids if select_ids is None else torch.as_tensor(select_ids, dtype=torch.long)  # [A]
    # every chunk staged once, in the cache a handover blends over (the pass writes its question past them)
    every = _assemble(lm, prefix, chunks, q_ids, Mode.BLEND, options, reserve_tokens, step_tokens) \
        if options.focus.handover and token_layers else None
    scored = yield from score_steps(lm, prefix, chunks, choosing, layers, token_layers,  # a layer a step
                                    every.cache if every is not None else None, step_tokens)
    relevance = scored.relevance
    kept = pick_chunks(relevance, options.focus.keep)
    timer.lap("focus")
    # several passages matter: the runners-up score close to the best, or several chunks are kept
    handover = options.focus.handover and len(kept) > 1 and (
        spread(relevance) >= options.focus.spread or 0 < options.focus.several <= len(kept))
    if not handover:  # a lookup: over the chunks near the best
        if options.focus.lookup_keep is not None:
            kept = pick_chunks(relevance, options.focus.lookup_keep)
        p = prefix.num_tokens if prefix is not None else 0
        if 0 not in kept and _exact_first(chunks, p) and any(ch.after_context for ch in chunks[1:]):
            # a first chunk served from its plain KV beside the others' neighbour KV stays: its KV is
            # exact, and its score, read over exact KV beside neighbour KV, runs low (docs/quality.md, stop 46)
            kept = [0, *kept]
        # one that keeps every chunk drops none: it is the handover's blend, over the cache the pass
        # read (the same picks, without staging the chunks again)
        handover = options.focus.handover and len(kept) == len(chunks) > 1
    inner, sub, tokens = Mode.BLEND, options, scored.tokens
    if handover and every is not None:  # several passages matter: all blended, over the cache the pass read
        every.cache.length, every.timer = every.n, _PhaseTimer(lm.device)  # (its phases so far: focus's)
        res = yield from _query_blend_steps(lm, every, prefix, chunks, options, reserve_tokens, select_ids, tokens)
        return _focused(res, range(len(chunks)), scored, chunks, True, timer)
    if handover:  # a selector that runs its own pass (deviation, a tempered context)
        res = yield from prompt_steps(lm, prefix, chunks, q_ids, Mode.BLEND, options, reserve_tokens, select_ids,
                                      step_tokens=step_tokens)
        return _focused(res, range(len(chunks)), scored, chunks, True, timer)
    del every  # a lookup: the answer is over the kept chunks, the prompt holds them alone
    if any(chunks[i].after_context for i in kept):
        # KV computed after neighbours this prompt does not hold: the kept chunks are blended at the
        # lookup ratio (1.0: recomputed, the prompt then is full prefill of the prefix, those chunks
        # and the question); by default the request's ratio of the kept chunks' tokens
        ratio = options.focus.lookup_ratio
        sub = options if ratio is None else replace(options, recompute_ratio=ratio)
    else:  # plain KV: one kept chunk's is exact, reused; several are blended, scored over themselves
        inner, tokens = (Mode.REUSE if len(kept) == 1 else Mode.BLEND), None
    res = yield from _run_kept(lm, prefix, chunks, kept, q_ids, inner, sub, reserve_tokens, select_ids, tokens,
                               step_tokens)
    return _focused(res, kept, scored, chunks, False, timer)


def _focused(res: BlendResult, kept: Sequence[int], scored: FocusScores, chunks: Sequence[ChunkKV],
             handover: bool, timer: _PhaseTimer) -> BlendResult:
    """`res` as focus's result: the chunks it kept, every chunk's score, the scoring pass's time."""
    relevance = scored.relevance
    res.mode, res.used_chunks, res.handed_over = Mode.FOCUS, tuple(kept), handover
    res.chunk_scores = tuple(round(float(r), 4) for r in relevance)
    res.focus_signal = FocusSignal(handover, round(kept_attention(scored.mass, kept), 4) if scored.mass is not None
                                   else 1.0, round(spread(relevance), 4))
    res.n_chunk_tokens = sum(ch.num_tokens for ch in chunks)
    res.timings = {**timer.phases, **res.timings}
    return res


def _run_kept(lm: LoadedModel, prefix: ChunkKV | None, chunks: Sequence[ChunkKV], kept: Sequence[int],
              q_ids: torch.Tensor, mode: Mode, options: BlendOptions, reserve_tokens: int,
              select_ids: Sequence[int] | torch.Tensor | None, tokens: torch.Tensor | None,
              step_tokens: int = 0) -> PromptSteps:
    """The prompt over the kept chunks (in prompt order) in `mode`; a query blend picks its tokens from
    `tokens` ([C-P] over every chunk, focus's pass), sliced to the kept chunks, when it is given."""
    sub = [chunks[i] for i in kept]
    if mode is not Mode.BLEND or options.selector is not Selector.QUERY or tokens is None:
        return (yield from prompt_steps(lm, prefix, sub, q_ids, mode, options, reserve_tokens, select_ids,
                                        step_tokens=step_tokens))
    per_chunk = torch.split(tokens, [ch.num_tokens for ch in chunks])  # each chunk's [T_i]
    scores = torch.cat([per_chunk[i] for i in kept])  # [sum of the kept T_i]
    a = _assemble(lm, prefix, sub, q_ids, mode, options, reserve_tokens, step_tokens)
    return (yield from _query_blend_steps(lm, a, prefix, sub, options, reserve_tokens, select_ids, scores))


def _check_segments(lm: LoadedModel, prefix: ChunkKV | None, chunks: Sequence[ChunkKV]) -> None:
    want = (lm.num_layers, lm.num_kv_heads, lm.head_dim)
    p = prefix.num_tokens if prefix is not None else 0
    for i, seg in enumerate(([prefix] if prefix is not None else []) + list(chunks)):
        got = (seg.k.shape[0], seg.k.shape[1], seg.k.shape[3])
        if got != want:
            raise ValueError(f"segment {i} KV has (L, Hkv, D) = {got}, but the model needs {want}: "
                             "it was computed by another model")
    for i, ch in enumerate(chunks):
        if ch.num_tokens == 0:
            raise ValueError(f"chunk {i} is empty")
        # a chunk starts right after the prefix, or later when it was computed after context
        # tokens too (neighbour-conditioned KV); K is re-rotated to the final positions either way
        start = int(ch.positions[0])
        if start < p or (start != p and not ch.after_context):
            raise ValueError(f"chunk {i} was computed after a prefix of {start} tokens, but the "
                             f"prefix here has {p}: recompute it with this prefix")


def _like(lm: LoadedModel) -> torch.Tensor:
    return torch.empty(0, dtype=lm.dtype, device=lm.device)


class _PhaseTimer:
    """Wall time per phase; syncs CUDA at phase boundaries only (never inside a layer)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.phases: dict[str, float] = {}
        self.t = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now
