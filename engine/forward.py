"""One decoder layer over a subset of tokens, reading and writing KV caches.

This is the one layer function of every mode and every model family, and `layer_steps`
the one loop over the layers that every pass runs: full prefill (all tokens), chunk
prefill (the chunk after a cached prefix), selective recompute (a few tokens against the
whole blended cache), the question's scoring pass (its attention onto the context, read
from this function's own attention, windows included) and batched decode (one token for
each of B requests, each with its own cache: a ragged batch). What differs between
architectures (norms, fused projections, q/k norms, MoE blocks, multipliers, windows,
soft-capping, sinks, per-layer rotary) comes from the model's `engine.family.Adapter`;
the numerics are the model's own modules (norms, projections, MLP). Only attention is
ours, because its mask must come from positions: SDPA's `is_causal=True` aligns
top-left when there are fewer queries than keys, which is wrong for recomputing
selected tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from ragkv.engine.family import Adapter, LayerAttention
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.rope import RopeTables
from ragkv.engine.work import WaitFor, wait_for

if TYPE_CHECKING:
    from ragkv.engine.model_loading import LoadedModel

T = TypeVar("T")  # a pass's result


@dataclass(frozen=True, slots=True)
class Heads:
    """Attention geometry of a model (of one layer kind: `sliding_window` is that layer's)."""

    num_heads: int  # query heads
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    scaling: float  # softmax scale, usually D ** -0.5
    sliding_window: int | None  # None = every earlier key is visible
    attention_chunk: int | None = None  # chunked attention (Llama 4): only keys of the query's own chunk


def heads_of(lm: LoadedModel) -> Heads:
    """The attention geometry of a loaded model (its first layer's scale, no window)."""
    ad = lm.adapter
    return Heads(ad.num_heads, ad.num_kv_heads, ad.head_dim, ad.attention[0].scaling, None)


@dataclass(frozen=True, slots=True)
class Attend:
    """Which cached keys one group of queries sees."""

    rows: slice  # the queries of this group (rows of h)
    n_keys: int  # keys [first_key, n_keys) of the cache take part
    causal: bool  # queries are the last S_g of keys [0, n_keys) (all of them in full prefill): causal,
    # aligned at the bottom right, so SDPA's causal kernels run without a mask
    mask: torch.Tensor | None  # [S_g, n_keys - first_key] bool, True = may attend; None with causal or all-visible
    # CPU split path (`_split_attention`): keys [0, open_keys) are visible to every query of
    # the group; tail_bias is the additive mask of the rest, one row per folded query head
    open_keys: int = 0
    tail_bias: torch.Tensor | None = None  # [g*S_g, n_keys - open_keys] float32, 0 or -inf
    # a local layer's group (window, attention chunk) reads only the keys its queries can see:
    # those before first_key are outside every query's window or chunk
    first_key: int = 0


@dataclass(frozen=True, slots=True)
class Span:
    """Active tokens that live in one cache: all of a prompt pass's, or one decoding request's."""

    cache: KVCache
    rows: slice  # their rows among the active tokens (of h)
    slots: slice | torch.Tensor  # where they live in the cache (a slice, or [S'] int64 indices)
    plans: dict[Locality, list[Attend]]  # the attention groups per layer locality ((None, None) = global)


Locality = tuple[int | None, int | None]  # a layer's (sliding window, attention chunk): LayerAttention.locality


def plan_layers(q_pos: torch.Tensor, n_keys: int, lm: LoadedModel) -> dict[Locality, list[Attend]]:
    """`plan_attention` for each distinct locality (window, chunk) among the model's layers."""
    base = heads_of(lm)
    return {(w, c): plan_attention(q_pos, n_keys, dataclasses.replace(base, sliding_window=w, attention_chunk=c))
            for w, c in lm.adapter.localities}


def span(cache: KVCache, slots: slice | torch.Tensor, q_pos: torch.Tensor, n_keys: int, lm: LoadedModel,
         rows: slice | None = None) -> list[Span]:
    """The one span of a prompt pass: active tokens at q_pos [S], written at `slots`, over keys [0, n_keys)."""
    return [Span(cache, rows or slice(0, q_pos.shape[0]), slots, plan_layers(q_pos, n_keys, lm))]


_GROUP_MIN_QUERIES = 64  # scattered queries are split into groups of at least this many


def plan_attention(q_pos: torch.Tensor, n_keys: int, heads: Heads) -> list[Attend]:
    """The attention pattern for sorted queries at positions q_pos over cache keys [0, n_keys).

    Key j sits at position j (prompt positions are contiguous), so query i may see key j
    iff j <= q_pos[i] (and j > q_pos[i] - window under a sliding window, j // chunk ==
    q_pos[i] // chunk under chunked attention). Scattered queries (selective recompute)
    are split into groups, each reading keys only up to its last query: about half the
    work of one [S, n_keys] mask. On a local layer (window, attention chunk) every group
    also starts at the first key its first query can see: a 512-token window reads about
    its window, not every key before it, in full prefill, recompute and decode alike.
    """
    s = q_pos.shape[0]
    window, chunk = heads.sliding_window, heads.attention_chunk
    if window is not None and n_keys <= window:  # no query is old enough to lose a key to the window
        window = None
    if chunk is not None and n_keys <= chunk:  # every key is in the first chunk
        chunk = None
    local = window is not None or chunk is not None  # some query misses some earlier key
    if not local and s == n_keys and _is_tail(q_pos, n_keys):
        return [Attend(slice(0, s), n_keys, True, None)]
    if not local and 1 < s < n_keys and q_pos.device.type != "cpu" and _is_tail(q_pos, n_keys):
        # the last keys' queries (a chunked prefill's piece, the question after its chunks): one
        # causal call from the bottom right, flash on a GPU, where a mask would cost a slower
        # kernel; the CPU has its own path for masked groups (_with_split)
        return [Attend(slice(0, s), n_keys, True, None)]
    if not local and s == 1 and int(q_pos[0]) == n_keys - 1:
        return [Attend(slice(0, 1), n_keys, False, None)]  # one query at the end sees everything
    n_groups = max(1, min(8, s // _GROUP_MIN_QUERIES))
    bounds = [round(g * s / n_groups) for g in range(n_groups + 1)]
    ends = (q_pos[[b - 1 for b in bounds[1:]]] + 1).tolist()  # keys each group needs
    firsts = q_pos[bounds[:-1]]  # [n_groups] each group's first query
    starts = torch.zeros_like(firsts)  # the first key any of the group's queries can see
    if window is not None:
        starts = torch.maximum(starts, firsts - window + 1)
    if chunk is not None:
        starts = torch.maximum(starts, torch.div(firsts, chunk, rounding_mode="floor") * chunk)
    plans = []
    for g, first in enumerate(starts.tolist()):
        rows = slice(bounds[g], bounds[g + 1])
        keys = int(ends[g])
        k_pos = torch.arange(first, keys, device=q_pos.device)  # [keys - first]
        mask = k_pos[None, :] <= q_pos[rows, None]  # [S_g, keys - first]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[rows, None] - window
        if chunk is not None:
            mask &= k_pos[None, :] >= torch.div(q_pos[rows, None], chunk, rounding_mode="floor") * chunk
        plans.append(_with_split(Attend(rows, keys, False, mask), q_pos, heads) if not local
                     else Attend(rows, keys, False, mask, first_key=first))
    return plans


def _with_split(a: Attend, q_pos: torch.Tensor, heads: Heads) -> Attend:
    """`a` with the CPU split path's data, built once per plan (a plan serves every layer)."""
    # keys before the group's first query are open to all of its queries; the span starts at
    # that query's own key, so every row of the span sees at least one key (a fully masked
    # row would come back from the kernel with LSE 0, not -inf, and skew the merge)
    open_keys = int(q_pos[a.rows.start])
    s = a.rows.stop - a.rows.start
    if (q_pos.device.type != "cpu" or _CPU_FLASH is None or open_keys < _SPLIT_MIN_OPEN_KEYS
            or s < _GROUP_MIN_QUERIES):  # a few queries (the question, decode): no gain worth other sums
        return a
    mask = a.mask
    assert mask is not None, "_with_split takes a masked group"
    g = heads.num_heads // heads.num_kv_heads
    bias = torch.zeros(mask.shape[0], a.n_keys - open_keys).masked_fill_(~mask[:, open_keys:], float("-inf"))
    return Attend(a.rows, a.n_keys, False, mask, open_keys, bias.repeat(g, 1))  # [g*S_g, span]


def _is_tail(pos: torch.Tensor, n_keys: int) -> bool:
    """Sorted distinct positions `pos` are exactly the last len(pos) of [0, n_keys)."""
    n = pos.shape[0]
    return n > 0 and int(pos[0]) == n_keys - n and int(pos[-1]) == n_keys - 1


def project_kv(ad: Adapter, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's K (before RoPE) and V of hidden states h: [S, hidden] -> each [Hkv, S, D]."""
    _, k, v = ad.qkv(i, ad.attn_input(i, h))
    return k, v


@dataclass(slots=True, eq=False)  # identity: one pass's layer, whatever its fields
class LayerWork:
    """One decoder layer over one pass's rows, yielded by `layer_steps` for its driver to run.

    The scheduler runs the layer works of several passes that stand at the same layer as one
    forward (`run_layers`: their rows side by side, each attending over its own cache), so a
    layer's weights are read once for all of them. A driver that does not run it (`drain`, a
    test stepping the pass) leaves `out` unset, and the pass runs it itself as it resumes.
    """

    adapter: Adapter = dataclasses.field(repr=False)
    layer: int  # i
    h: torch.Tensor = dataclasses.field(repr=False)  # [S, hidden] the pass's active rows
    rope: RopeTables = dataclasses.field(repr=False)  # S rows
    # where their K/V go and which keys they see (rows among these S)
    spans: Sequence[Span] = dataclasses.field(repr=False)
    # the scoring pass's: [n_keys] float32, this layer's attention weights over its keys are added to it
    mass: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    # once run: h_out [S, hidden], k before RoPE [Hkv, S, D], v [Hkv, S, D]
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    error: Exception | None = None  # the run failed: the pass raises it as it resumes
    took_s: float = 0.0  # seconds of the run that were this pass's (a shared run's, by its share of the rows)

    @property
    def rows(self) -> int:
        return int(self.h.shape[0])

    def joins(self, other: LayerWork) -> bool:
        """Whether the two can run as one forward: one model's same attention layer (a hybrid's
        recurrent layers run pass by pass), neither run yet."""
        return (self.adapter is other.adapter and self.layer == other.layer and self.out is None is other.out
                and self.error is None is other.error
                and self.layer not in self.adapter.recurrent_layers and self.h.dtype == other.h.dtype
                and self.h.device == other.h.device)

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's output, run here unless the driver ran it; the driver's error raised here."""
        if self.error is not None:
            raise self.error
        if self.out is None:
            with torch.inference_mode():  # as the pass's own steps run, whoever calls it
                self.out = layer_forward(self.adapter, self.layer, self.h, self.rope, self.spans,
                                         [self.mass] * len(self.spans))
        return self.out


@torch.inference_mode()  # as the passes' own steps run (their caches are inference tensors)
def run_layers(works: Sequence[LayerWork]) -> None:
    """Run several passes' layer works, as one forward when they all `join` the first: their rows
    side by side (each pass's attention over its own cache, as batched decode's spans), each
    work's `out` its own rows'; else pass by pass. A shared run that fails is run again pass by pass, so one
    pass's bad input fails that pass alone (its `error`, raised as it resumes)."""
    t0 = time.perf_counter()
    first = works[0]
    if len(works) > 1 and all(first.joins(w) for w in works[1:]):
        try:
            _run_shared(works)
        except Exception:  # out of memory, or one pass's bad shape: pass by pass below
            for w in works:
                w.out = None
    total = sum(w.rows for w in works) or 1
    for w in works:
        if w.out is None:
            t1 = time.perf_counter()
            try:
                w.result()
            except Exception as exc:
                w.error = exc
            w.took_s = time.perf_counter() - t1
        else:
            w.took_s = (time.perf_counter() - t0) * w.rows / total


def _run_shared(works: Sequence[LayerWork]) -> None:
    """One forward of layer i over every work's rows (`run_layers`)."""
    spans: list[Span] = []
    mass: list[torch.Tensor | None] = []
    off = 0
    for w in works:
        spans.extend(Span(sp.cache, slice(off + sp.rows.start, off + sp.rows.stop), sp.slots, sp.plans)
                     for sp in w.spans)
        mass.extend([w.mass] * len(w.spans))
        off += w.rows
    first = works[0]
    h = torch.cat([w.h for w in works])  # [sum S, hidden]
    out, k, v = layer_forward(first.adapter, first.layer, h, RopeTables.cat([w.rope for w in works]), spans, mass)
    off = 0
    for w in works:
        rows = slice(off, off + w.rows)
        w.out = (out[rows], k[:, rows], v[:, rows])
        off += w.rows


Step = int | WaitFor | LayerWork  # what a pass yields: rows computed, a wait on its KV, a layer to run


def drain_together(passes: Sequence[Generator[Step, None, T]]) -> list[T]:
    """Run several passes to their ends side by side, as the scheduler's `prompt_batch_rows`
    does: each round, the passes standing at the lowest layer run it as one forward
    (`run_layers`), so a pass behind catches up and then goes on with the others; waits block.
    For evals, benches and tests (the scheduler is the serving path). Returns their results,
    in order."""
    live = dict(enumerate(passes))
    results: dict[int, T] = {}
    standing: dict[int, LayerWork] = {}
    while live:
        for n, steps in list(live.items()):
            while n not in standing:
                try:
                    item = next(steps)
                except StopIteration as done:
                    results[n] = cast(T, done.value)  # StopIteration.value is untyped: the pass's result
                    del live[n]
                    break
                if isinstance(item, WaitFor):
                    item.block()
                elif isinstance(item, LayerWork):
                    standing[n] = item
        if standing:
            lead = min(standing, key=lambda n: standing[n].layer)
            group = [lead, *(n for n in standing if n != lead and standing[lead].joins(standing[n]))]
            run_layers([standing.pop(n) for n in group])
    return [results[n] for n in range(len(passes))]


class Keep(str, enum.Enum):
    """Which rows' output a pass's last layer computes (its K/V are written for every row)."""

    ALL = "all"  # every active row: decode (each row is a request's next token), the scoring pass
    LAST = "last"  # the last row: a prompt pass, whose next-token logits are all that is read
    NONE = "none"  # none: the last layer only projects K/V (a chunk's prefill)


def layer_steps(lm: LoadedModel, h: torch.Tensor, rope: RopeTables, spans: Sequence[Span], layers: range,
                keep: Keep = Keep.ALL, *, pos: torch.Tensor | None = None, n_keys: int = 0,
                kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                mass: Mapping[int, torch.Tensor] | None = None,
                step_tokens: int = 0) -> Generator[Step, None, torch.Tensor]:
    """The one layer loop: `layers` of the model for the active rows, one layer per step.

    Before each layer a staged cache's layer is made present (a chunk still loading parks
    the pass on its read: `WaitFor`); then the step yields the layer as a `LayerWork` for
    its driver to run (the scheduler runs several passes' same layer as one forward) and
    reads its output as it resumes. The last layer of the range computes output for the
    rows `keep` says, K/V for all.

    With `step_tokens`, a prompt pass of more rows than that runs each layer in pieces of
    rows, in prompt order, at most `step_tokens` each and one step each (chunked prefill:
    a long prompt's layer is no longer one long step). Under causal attention this is the
    same sum: a piece's queries see the keys of the pieces before it, written at this layer
    already, and none after it. A hybrid's recurrent layers run whole (their state carries).

    Args:
        h: [S, hidden] the active rows' hidden states.
        rope: rotary tables at their positions (S rows).
        spans: where their K/V go and which keys they see (`span`; one per request in decode).
        keep: LAST needs `pos` [S] and `n_keys` (one span) to plan the last row's attention.
        kv_out: (k [L, Hkv, S, D] before RoPE, v [L, Hkv, S, D]): each layer's K/V of the rows.
        mass: layer -> [n_keys] float32 accumulator: that layer's attention weights, summed
            over heads and rows, are added in (the scoring pass).
        step_tokens: rows per step at most (0 = a whole layer per step); it needs `pos` [S], the
            rows' sorted positions, and one span.

    Returns:
        [S', hidden] the output of the last layer's kept rows (h unchanged with Keep.NONE).
    """
    ad = lm.adapter
    staged = spans[0].cache if len(spans) == 1 else None  # a prompt pass: its chunks may still be loading
    last = layers[-1] if len(layers) else -1
    pieces = _pieces(lm, spans, pos, step_tokens)  # None: a whole layer per step
    for i in layers:
        if staged is not None:
            if (w := wait_for(staged.pending(i))) is not None:  # a chunk's layer i is still arriving: park
                yield w
            staged.fill(i)
        if i == last and keep is not Keep.ALL and (keep is Keep.NONE or h.shape[0] > 1) \
                and i not in ad.recurrent_layers:  # a recurrent layer's state needs every row
            k, v = project_kv(ad, i, h)  # [Hkv, S, D]: only the kept rows' output is ever read
            k_rot, c = rope.apply(k, i), ad.cache_layer[i]
            for sp in spans:
                sp.cache.k[c, :, sp.slots], sp.cache.v[c, :, sp.slots] = k_rot[:, sp.rows], v[:, sp.rows]
            if kv_out is not None:
                kv_out[0][i], kv_out[1][i] = k, v
            if keep is Keep.NONE:
                return h
            if pos is None:
                raise ValueError("layer_steps with Keep.LAST needs the rows' positions (pos)")
            h, pos, rope = h[-1:], pos[-1:], rope[-1:]
            spans, pieces = span(spans[0].cache, pos, pos, n_keys, lm), None
        scores = None if mass is None else mass.get(i)  # a scored layer's accumulator
        if pieces is not None and i not in ad.recurrent_layers:  # chunked prefill: piece by piece
            outs = []
            for rows, piece in pieces:
                work = LayerWork(ad, i, h[rows], rope[rows], piece, scores)
                yield work
                out, k, v = work.result()  # [S_p, hidden]
                outs.append(out)
                if kv_out is not None:
                    kv_out[0][i, :, rows], kv_out[1][i, :, rows] = k, v
            h = torch.cat(outs)  # [S, hidden]
            continue
        work = LayerWork(ad, i, h, rope, spans, scores)
        yield work
        h, k, v = work.result()
        if kv_out is not None:
            kv_out[0][i], kv_out[1][i] = k, v
    return h


def _pieces(lm: LoadedModel, spans: Sequence[Span], pos: torch.Tensor | None,
            step_tokens: int) -> list[tuple[slice, list[Span]]] | None:
    """A prompt pass's rows cut into pieces of at most `step_tokens` rows, of about equal size,
    each with its own span (its slots, and the attention plans of its queries over the keys up
    to its last one); None when the pass runs whole layers (no cap, decode, or few rows)."""
    if step_tokens <= 0 or len(spans) != 1 or pos is None or pos.shape[0] <= step_tokens:
        return None
    sp, s = spans[0], pos.shape[0]
    n = -(-s // step_tokens)  # pieces
    bounds = [round(j * s / n) for j in range(n + 1)]
    out = []
    for r0, r1 in zip(bounds, bounds[1:]):
        slots = sp.slots[r0:r1] if isinstance(sp.slots, torch.Tensor) \
            else slice(sp.slots.start + r0, sp.slots.start + r1)
        out.append((slice(r0, r1), [Span(sp.cache, slice(0, r1 - r0), slots,
                                         plan_layers(pos[r0:r1], int(pos[r1 - 1]) + 1, lm))]))
    return out


def layer_forward(ad: Adapter, i: int, h: torch.Tensor, rope: RopeTables, spans: Sequence[Span],
                  mass: Sequence[torch.Tensor | None] = (),
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run decoder layer i for the active tokens.

    Args:
        h: [S, hidden] hidden states of the active tokens.
        rope: rotary tables at the active tokens' positions (S rows).
        spans: where the active tokens' K/V go and which keys they attend to: one span
            for a prompt pass, one per request for batched decode (rows in order).
        mass: per span, None or an [n_keys] float32 accumulator: the attention weights this
            layer applies to that span's rows, summed over heads and rows, are added to it (the
            scoring pass); () = none.

    Returns:
        h_out [S, hidden], k before RoPE [Hkv, S, D], v [Hkv, S, D].
    """
    s = h.shape[0]
    x = ad.attn_input(i, h)
    if i in ad.recurrent_layers:  # a hybrid's recurrent layer: each request's state carries its past
        return _recurrent_forward(ad, i, h, x, spans)
    q, k, v = ad.qkv(i, x)  # [H, S, D], [Hkv, S, D], [Hkv, S, D]
    q, k_rot = rope.scale_query(rope.apply(q, i), i), rope.apply(k, i)
    if ad.folds_key_norm:
        q = ad.fold_key_norm(i, q)
    la = ad.attention[i]
    # the layer's place in the cache, and the place it attends to (Gemma 4's last layers attend to
    # an earlier layer's KV; their own slots get zeros)
    own, src = ad.cache_layer[i], ad.cache_layer[ad.kv_source[i]]
    outs: list[torch.Tensor] = []
    for n, sp in enumerate(spans):
        sp.cache.k[own][:, sp.slots], sp.cache.v[own][:, sp.slots] = k_rot[:, sp.rows], v[:, sp.rows]
        k_cache, v_cache = sp.cache.k[src], sp.cache.v[src]  # [Hkv, cap, D]
        q_sp = q[:, sp.rows] if len(spans) > 1 else q
        plan = sp.plans[la.locality]
        outs.extend(attention(q_sp[:, a.rows] if len(plan) > 1 else q_sp, k_cache, v_cache, a, ad, la)
                    for a in plan)  # each [H, S_g, D]
        if mass and (acc := mass[n]) is not None:  # the weights that attention applied, with its mask and windows
            for a in plan:
                q_g = q_sp[:, a.rows] if len(plan) > 1 else q_sp
                acc[a.first_key:a.n_keys] += attention_weights(q_g, k_cache, a, ad, la).sum((0, 1))  # [N_g]
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]  # [H, S, D]
    a_out = ad.attn_output(i, out.transpose(0, 1).reshape(s, ad.num_heads * ad.head_dim), x)  # [S, hidden]
    return ad.residual(i, h, x, a_out), k, v


def _recurrent_forward(ad: Adapter, i: int, h: torch.Tensor, x: torch.Tensor, spans: Sequence[Span],
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer i of a hybrid, recurrent (Gated DeltaNet, Mamba-2): each span's tokens, in order,
    through the model's own module with that request's state. No K/V: zeros are returned for
    the caller's bookkeeping and the cache's slots at this layer are never attended to."""
    outs = []
    for sp in spans:
        cache = sp.cache
        if cache.recurrent is None:
            cache.recurrent = ad.new_recurrent_state()
        xs = x[sp.rows] if len(spans) > 1 else x  # [S_sp, hidden]
        cut = cache.mark - sp.slots.start if cache.mark is not None and isinstance(sp.slots, slice) else 0
        if 0 < cut < xs.shape[0]:  # the state at the mark is wanted too: stop there, copy it, go on
            if cache.marked is None:
                cache.marked = ad.new_recurrent_state()
            head = ad.recurrent(i, xs[:cut], cache.recurrent)
            ad.copy_recurrent_layer(cache.recurrent, cache.marked, i)
            outs.append(torch.cat([head, ad.recurrent(i, xs[cut:], cache.recurrent)]))
        else:
            outs.append(ad.recurrent(i, xs, cache.recurrent))
    a_out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [S, hidden]
    kv = h.new_zeros(ad.num_kv_heads, h.shape[0], ad.head_dim)  # [Hkv, S, D]
    return ad.residual(i, h, x, a_out), kv, kv


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: Attend, heads: Heads | Adapter,
              la: LayerAttention | None = None) -> torch.Tensor:
    """SDPA of q: [H, S_g, D] over cache keys [a.first_key, a.n_keys) -> [H, S_g, D].

    `la` is the layer's attention (scale, soft-capping, sinks); None = `heads.scaling`, plain softmax.
    """
    if la is not None:
        scaling = la.scaling
    elif isinstance(heads, Heads):
        scaling = heads.scaling
    else:
        raise TypeError("attention with an Adapter's heads needs the layer's LayerAttention (la)")
    if la is not None and (la.softcap is not None or la.sinks is not None):
        return _explicit_attention(q, k_cache, v_cache, a, heads, la)
    if a.tail_bias is not None:  # built only on CPU (_with_split)
        return _split_attention(q, k_cache, v_cache, a, heads, scaling)
    if a.mask is None and not a.causal and heads.num_heads != heads.num_kv_heads and q.device.type == "cpu":
        # decode (queries that see every key): folded heads instead of SDPA's GQA path,
        # which repeats the whole K and V per call on CPU
        out = F.scaled_dot_product_attention(
            _fold_heads(q, heads)[None], k_cache[None, :, a.first_key: a.n_keys],
            v_cache[None, :, a.first_key: a.n_keys], scale=scaling,
        )[0]  # [Hkv, g*S_g, D]
        return out.reshape(q.shape)
    n_g = a.n_keys - a.first_key
    mask: torch.Tensor | CausalBias | None = a.mask
    causal = a.causal
    if causal and q.shape[1] < n_g:  # the last keys' queries: causal from the bottom right
        mask, causal = causal_lower_right(q.shape[1], n_g), False
    return F.scaled_dot_product_attention(
        q[None],  # [1, H, S_g, D]
        k_cache[None, :, a.first_key: a.n_keys],  # [1, Hkv, n_keys - first_key, D]
        v_cache[None, :, a.first_key: a.n_keys],
        attn_mask=mask,
        is_causal=causal,
        scale=scaling,
        enable_gqa=heads.num_heads != heads.num_kv_heads,
    )[0]  # [H, S_g, D]


def _explicit_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: Attend,
                        heads: Heads | Adapter, la: LayerAttention) -> torch.Tensor:
    """Attention with what SDPA cannot express: logit soft-capping (Gemma 2), sinks (gpt-oss)."""
    v = v_cache[:, a.first_key: a.n_keys].repeat_interleave(heads.num_heads // heads.num_kv_heads, 0)  # [H, N_g, D]
    return attention_weights(q, k_cache, a, heads, la).to(v.dtype) @ v  # [H, S_g, D]


def attention_weights(q: torch.Tensor, k_cache: torch.Tensor, a: Attend, heads: Heads | Adapter,
                      la: LayerAttention) -> torch.Tensor:
    """The softmax weights of q: [H, S_g, D] over cache keys [a.first_key, a.n_keys) -> [H, S_g, N_g]
    float32, as the layer's attention applies them: its scale, soft-capping, mask (windows
    included) and sinks."""
    g = heads.num_heads // heads.num_kv_heads
    k = k_cache[:, a.first_key: a.n_keys].repeat_interleave(g, 0)  # [H, N_g, D] (N_g = n_keys - first_key)
    scores = (q @ k.transpose(1, 2)).float() * la.scaling  # [H, S_g, N_g]
    if la.softcap is not None:
        scores = torch.tanh(scores / la.softcap) * la.softcap
    s_g = q.shape[1]
    if a.mask is not None:
        scores = scores.masked_fill(~a.mask[None], float("-inf"))
    elif a.causal:  # the queries are the last s_g keys
        n_g = a.n_keys - a.first_key
        scores = scores.masked_fill(
            torch.ones(s_g, n_g, dtype=torch.bool, device=q.device).triu(n_g - s_g + 1)[None], float("-inf"))
    if la.sinks is not None:  # one more logit per head in the denominator, dropped after the softmax
        sink = la.sinks.float().to(q.device)[:, None, None].expand(-1, s_g, 1)  # [H, S_g, 1]
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return torch.softmax(scores, -1)


# CPU: a masked group is split where its mask starts to matter. Keys every query sees run
# through the flash kernel without a mask (its fast path); only the group's own span is
# masked; the two halves merge by their log-sum-exp. 1.2x faster than one masked call
# per group in bench/attention_bench.py; in blend@0.15 on 8x512 tokens the attention's
# share fell from 1.82 s to 1.24 s (no bool-mask conversion, no GQA repeat of K/V). The
# private op returns the LSE that the public SDPA does not.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SPLIT_MIN_OPEN_KEYS = 256  # below this the second kernel call costs more than it saves


def _split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: Attend,
                     heads: Heads | Adapter, scaling: float) -> torch.Tensor:
    """`attention` for a masked group on CPU, as [open keys] + [masked span], merged by LSE."""
    lo, flash, tail_bias = a.open_keys, _CPU_FLASH, a.tail_bias
    assert flash is not None and tail_bias is not None, "_with_split gives a tail bias only with the CPU kernel"
    qf = _fold_heads(q, heads)[None]  # [1, Hkv, g*S_g, D]
    k, v = k_cache[None, :, : a.n_keys], v_cache[None, :, : a.n_keys]  # [1, Hkv, n_keys, D]
    o1, lse1 = flash(qf, k[:, :, :lo], v[:, :, :lo], scale=scaling)  # [1, Hkv, g*S_g, D], [1, Hkv, g*S_g]
    o2, lse2 = flash(qf, k[:, :, lo:], v[:, :, lo:], attn_mask=tail_bias.to(q.dtype), scale=scaling)
    lse = torch.logaddexp(lse1, lse2)  # [1, Hkv, g*S_g]
    out: torch.Tensor = o1.mul_((lse1 - lse).exp_()[..., None]).addcmul_(o2, (lse2 - lse).exp_()[..., None])  # [1, Hkv, g*S_g, D]
    return out[0].reshape(q.shape)


def _fold_heads(q: torch.Tensor, heads: Heads | Adapter) -> torch.Tensor:
    """[H, S, D] -> [Hkv, g*S, D]: each KV head's g query heads as rows (GQA without
    repeating K and V); a mask over S rows repeats g times to match."""
    h, s, d = q.shape
    return q.reshape(heads.num_kv_heads, h // heads.num_kv_heads * s, d)
