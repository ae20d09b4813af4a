"""A request's work: its chunks' KV, its prompt pass, its decode, the KV tree (`Engine.work`).

The scheduler runs this on its thread, one step at a time, and nothing in it is the
server's: the chunks' reads were started by the server and complete on the store's
threads (`PromptChunk.kv` futures), a chunk computed here goes out as `ChunkComputed`
(the server keeps it, off this thread), and the tokens go out as ids.

1. **KV.** The request parks on its reads (`WaitFor`, at most `kv_wait_s`). Each chunk is
   then its read's KV, or computed, one layer per step: missing from every tier, chosen
   by the loading controller, failed (a damaged or unreachable copy), or overrun (its
   read still pending: the read races the compute, and the first to finish serves). A
   tree lease on the context skips this: the tree holds it.
2. **Prompt.** `Engine.run_steps` in the request's mode. A layer-wise read that fails in
   the middle of the pass, or stalls there past `kv_wait_s` (a wait on its next layer
   runs out), has its chunk computed, and the pass runs again.
3. **Decode.** `Decode(stream)`: the scheduler decodes it batched with the others.
4. **Tree.** The prompt and the answer go into the KV tree, for the conversation's next call.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from typing import Protocol

from ragkv.engine.blend import BlendOptions, BlendResult, Prompt, PromptSteps
from ragkv.engine.constrain import Constraint
from ragkv.engine.decode import FIRST_ROOM, DecodeStream, SamplingParams
from ragkv.engine.forward import LayerWork, Step
from ragkv.engine.kv.cache import ChunkKV, arriving
from ragkv.engine.kv.conversation import Conversations, TreeSpot
from ragkv.engine.prefill import context_segments
from ragkv.engine.prompt import PromptFormat
from ragkv.engine.request import Answered, ChunkComputed, ChunksReady, Decode, LoadedKV, PromptChunk, Request, Work
from ragkv.engine.speed import EngineSpeed
from ragkv.engine.work import WaitFor, wait_for
from ragkv.errors import KVFormatError, KVReadStalledError, RagKVError, StoreError
from ragkv.types import FinishReason, KVSource, Mode, Tier

log = logging.getLogger(__name__)


class PromptEngine(Protocol):
    """What a request's work needs of the engine (`engine.runtime.Engine` is it)."""

    speed: EngineSpeed
    conversations: Conversations  # the KV tree's one door
    prompt: PromptFormat  # the prompt's layout (where an answer's header starts)

    def reads_chunk_kv(self, mode: Mode) -> bool: ...

    def prefill_steps(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int], context_ids: Sequence[int] = (),
                      context_kv: Sequence[ChunkKV] = ()) -> Generator[Step, None, ChunkKV]: ...

    def run_steps(self, prompt: Prompt, mode: Mode, options: BlendOptions | None = None, reserve_tokens: int = 256,
                  resume: TreeSpot | None = None) -> PromptSteps: ...

    def decode(self, prompt: BlendResult, params: SamplingParams | None = None,
               constraint: Constraint | None = None) -> DecodeStream: ...


def answer_steps(engine: PromptEngine, req: Request) -> Work:
    """The request's work to its end (see the module docstring); the lease is released on any exit."""
    try:
        return (yield from _answer(engine, req))
    finally:  # a tree lease not used (cancelled, failed) lets its path go
        req.let_go()


def _answer(engine: PromptEngine, req: Request) -> Work:
    phases: dict[str, float] = {}
    sources: Counter[KVSource] = Counter()
    loaded: dict[Tier, int] = {}
    kvs: list[ChunkKV] | None = None
    if not engine.reads_chunk_kv(req.mode):
        tiers = [Tier.NOT_LOADED] * len(req.chunks)
        # full prefill that the loading controller chose over reading: its chunks were cheaper computed
        sources.update(ch.source for ch in req.chunks if ch.source is KVSource.COMPUTED_CHEAPER)
    elif req.tree is not None and req.tree.lease is not None:  # the context is the tree's
        tiers = [Tier.TREE] * len(req.chunks)
    else:
        kvs, tiers = yield from _chunk_kv(engine, req, phases, sources, loaded)
    yield ChunksReady(tuple(tiers))

    # the request's own instructions (not the index's prefix): from its tenant's tree, or computed
    prefix_kv, instructions_held = None, 0
    resumed = req.tree is not None and req.tree.lease is not None
    if req.chunk_prefix_ids is not None and req.mode is not Mode.FULL and not resumed:
        prefix_kv, instructions_held = yield from _instructions(engine, req, phases)

    t0 = time.perf_counter()
    chunk_ids = [ch.token_ids for ch in req.chunks]
    reserve = min(req.sampling.max_new_tokens, FIRST_ROOM)  # the decode grows the cache past it
    res = None
    while res is None:  # each retry computes at least one chunk anew, so this ends
        try:
            prompt = Prompt(req.question_ids, req.prefix_ids, chunk_ids, _placed(req, kvs, tiers), req.select_ids,
                            req.snapshot_at, prefix_kv)
            steps = engine.run_steps(prompt, req.mode, req.options, reserve, req.tree)
            res = yield from _bounded(steps, req.kv_wait_s)
        except (KVFormatError, StoreError) as exc:  # a layered read failed (or stalled) mid-prompt
            tree, stalled = req.tree, isinstance(exc, KVReadStalledError)
            if tree is not None and tree.lease is not None and (tree.lease.failed or stalled and tree.lease.arriving):
                kvs, tiers = yield from _without_tree(engine, req, tree, phases, sources, loaded, exc)
                continue
            # a chunk whose read fails later (during the retry) fails that pass in turn
            kvs = yield from _recompute_failed(engine, req, kvs or [], tiers, exc)
    phases["prompt"] = time.perf_counter() - t0
    phases.update({f"prompt.{k}": v for k, v in res.timings.items()})

    trees = engine.conversations
    snapshot = trees.snapshot(res) if req.tree is not None else None  # a hybrid's state, before decode
    stream = engine.decode(res, req.sampling, req.constraint)
    t0 = time.perf_counter()
    yield Decode(stream)  # decoded batched with the others; back here when it ends
    phases["decode"] = time.perf_counter() - t0
    if req.tree is not None and not req.cancel.is_set():  # the conversation's next call starts here
        header = engine.prompt.answer_header_tokens(req.question_ids) if req.tree_retain_s > 0 else 0
        trees.remember(req.tree, req.mode, res, len(req.question_ids), len(req.prefix_ids), stream.token_ids, snapshot,
                       retain_s=req.tree_retain_s, header_tokens=header, priority=req.tree_priority)

    return Answered(
        prompt_tokens=res.n_prompt_tokens,
        # a prefix computed for the request's own instructions was not read from any cache
        cached_prompt_tokens=res.cached_tokens - (len(req.prefix_ids) if prefix_kv is not None and
                                                  not instructions_held else 0),
        completion_tokens=len(stream.token_ids),
        recompute_fraction=float(res.recompute_fraction),
        finish_reason=stream.finish_reason or FinishReason.STOP,
        phase_seconds=phases,
        bytes_loaded=loaded,
        used_chunks=None if res.used_chunks is None else tuple(res.used_chunks),
        kv_sources=dict(sources),
        fell_back=res.fell_back,
        handed_over=res.handed_over,
        focus=res.focus_signal,
        tree_prompt_tokens=(req.tree.served if req.tree is not None else 0) + instructions_held,
    )


def _instructions(engine: PromptEngine, req: Request, phases: dict[str, float]
                  ) -> Generator[Step, None, tuple[ChunkKV, int]]:
    """The KV of the request's own prefix (its instructions): read from its tenant's KV tree when
    an earlier call left it there, else computed one layer per step and kept there for the next
    call. Returns it and the tokens the tree supplied (0 when computed)."""
    spot, trees = req.instructions, engine.conversations
    if spot is not None and spot.lease is not None:
        return trees.instructions_kv(spot), len(spot.path)
    t0 = time.perf_counter()
    kv = yield from engine.prefill_steps((), req.prefix_ids)
    phases["instructions"] = time.perf_counter() - t0
    if spot is not None and not req.cancel.is_set():
        trees.keep_instructions(spot, kv)
    return kv, 0


def _placed(req: Request, kvs: list[ChunkKV] | None, tiers: Sequence[Tier]) -> list[ChunkKV] | None:
    """The chunks' KV where this prompt puts them: after the request's own prefix when its
    instructions are not the index's (moved, and blended as any non-prefix reuse). Turns carried
    from the KV tree were computed after this prompt's own prefix already: they stay."""
    if kvs is None or req.chunk_prefix_ids is None:
        return kvs
    shift = len(req.prefix_ids) - len(req.chunk_prefix_ids)
    return [kv if tier is Tier.TREE else kv.moved(shift) for kv, tier in zip(kvs, tiers)]


def _chunk_kv(engine: PromptEngine, req: Request, phases: dict[str, float], sources: Counter[KVSource],
              loaded: dict[Tier, int]) -> Generator[Step | ChunkComputed, None, tuple[list[ChunkKV], list[Tier]]]:
    """Each chunk's KV: its read's, or computed one layer per step (and handed out to be
    kept). The request waits for its reads parked (`WaitFor`), never polling; a read still
    pending after `kv_wait_s` is abandoned and its chunk computed."""
    reads = [ch.kv for ch in req.chunks if isinstance(ch.kv, Future)]
    t0 = time.perf_counter()
    if (w := wait_for(reads)) is not None:
        yield WaitFor(w.futures, req.kv_wait_s)
    phases["kv_wait"] = time.perf_counter() - t0
    compute_s = 0.0
    kvs: list[ChunkKV] = []
    tiers: list[Tier] = []
    for i, ch in enumerate(req.chunks):
        got, source = _read(ch)
        if got is None:
            # an overrun read races its chunk's compute: landing first, it ends the compute
            race = ch.kv if source is KVSource.COMPUTED_OVERRUN and isinstance(ch.kv, Future) else None
            t0 = time.perf_counter()
            kv = yield from _compute_or_read(engine, req, ch, race)
            compute_s += time.perf_counter() - t0
            if isinstance(kv, ChunkKV):
                sources[source] += 1
                served = _as_stored(ch, kv)
                yield ChunkComputed(i, kv, served)
                kvs.append(served)
                tiers.append(Tier.COMPUTED)
                continue
            got, source = kv, KVSource.LOADED
        sources[source] += 1
        loaded[got.tier] = loaded.get(got.tier, 0) + got.nbytes
        kvs.append(got.kv)
        tiers.append(got.tier)
    phases["kv_compute"] = compute_s
    return kvs, tiers


def _read(ch: PromptChunk) -> tuple[LoadedKV | None, KVSource]:
    """A chunk's KV as its read left it, or None with why it must be computed."""
    if isinstance(ch.kv, LoadedKV):  # handed over ready
        return ch.kv, KVSource.LOADED
    if ch.kv is None:
        return None, ch.source
    if not ch.kv.done():
        log.info("loading KV of %s overran its estimate (%s s); computing it", ch.key,
                 f"{ch.load_s:.3f}" if ch.load_s is not None else "?")
        return None, KVSource.COMPUTED_OVERRUN
    try:
        got = ch.kv.result(timeout=0)
    except (RagKVError, OSError) as exc:  # the tiers could not serve it: compute it
        log.warning("loading KV of %s failed (%s); computing it", ch.key, exc)
        return None, KVSource.COMPUTED_FAILED
    return (got, KVSource.LOADED) if got is not None else (None, KVSource.COMPUTED_MISSING)


def _compute(engine: PromptEngine, req: Request, ch: PromptChunk) -> Generator[Step, None, ChunkKV]:
    """A chunk's KV computed one layer per step (`_compute_or_read` with no read to race)."""
    kv = yield from _compute_or_read(engine, req, ch, None)
    assert isinstance(kv, ChunkKV), "with no read to race, the chunk is computed"
    return kv


def _compute_or_read(engine: PromptEngine, req: Request, ch: PromptChunk, race: Future[LoadedKV | None] | None
                     ) -> Generator[Step, None, ChunkKV | LoadedKV]:
    """A chunk's KV computed one layer per step; its own compute seconds (not the time other
    requests ran between its steps) teach the engine its prefill rate (`Engine.speed`).

    With `race` (the chunk's read, which overran its estimate), the read's KV instead if it
    lands before the compute ends: the compute stops at that layer (a read that fails or finds
    nothing leaves the compute to finish)."""
    steps = _chunk_steps(engine, req, ch)
    own = 0.0
    while True:
        if race is not None and race.done():
            landed = None if race.exception() is not None else race.result()
            if landed is not None:
                steps.close()
                req.chunk_s += own
                log.info("the overrun read of %s landed after %.3f s of its compute: its KV is used", ch.key, own)
                return landed
            race = None
        t0 = time.perf_counter()
        try:
            item = next(steps)
        except StopIteration as done:
            own += time.perf_counter() - t0
            engine.speed.observe(len(ch.token_ids), own)
            req.chunk_s += own
            kv: ChunkKV = done.value
            return kv
        own += time.perf_counter() - t0
        yield item
        if isinstance(item, LayerWork):  # its driver ran it (with other passes' same layer): its share counts
            own += item.took_s


def _chunk_steps(engine: PromptEngine, req: Request, ch: PromptChunk) -> Generator[Step, None, ChunkKV]:
    """A chunk's KV computed as the index computed the KV its key names (the tiers keep it under
    that key): after the index's prefix, and after its context when it has one (`ChunkContextKV`:
    the context's tokens, or the neighbours' plain KV, read or else computed here too)."""
    ctx = ch.context
    if ctx is None or not (ctx.ids or ctx.plain):
        return (yield from engine.prefill_steps(req.kv_prefix_ids, ch.token_ids))
    if not ctx.plain:
        return (yield from engine.prefill_steps(req.kv_prefix_ids, ch.token_ids, ctx.ids))
    reads = [read() for _, read in ctx.plain]
    if (w := wait_for(reads)) is not None:
        yield WaitFor(w.futures, req.kv_wait_s)
    plain = []
    for (ids, _), read in zip(ctx.plain, reads):
        got = read.result() if read.done() and read.exception() is None else None
        if got is None:  # missing, failed or still reading: computed (as the indexer does then), as stored
            kv = yield from engine.prefill_steps(req.kv_prefix_ids, ids)
            plain.append(kv if ctx.stored is None else ctx.stored(kv))
        else:
            plain.append(got.kv)
    context = context_segments(plain, ctx.budget_tokens)
    return (yield from engine.prefill_steps(req.kv_prefix_ids, ch.token_ids, context_kv=context))


def _bounded(steps: PromptSteps, limit_s: float) -> PromptSteps:
    """A prompt pass's steps, each of its waits on KV still arriving (a layer-by-layer read's
    next layer) ended after `limit_s`: a read that makes no progress that long fails the pass
    with KVReadStalledError, and the work computes its chunk instead."""
    while True:
        try:
            item = next(steps)
        except StopIteration as done:
            res: BlendResult = done.value
            return res
        if isinstance(item, WaitFor) and item.timeout_s is None:
            yield WaitFor(item.futures, limit_s)
            if not all(f.done() for f in item.futures):
                steps.close()
                raise KVReadStalledError(f"a layer-by-layer KV read made no progress for {limit_s:.1f} s mid-prompt")
            continue
        yield item


def _without_tree(engine: PromptEngine, req: Request, tree: TreeSpot, phases: dict[str, float],
                  sources: Counter[KVSource], loaded: dict[Tier, int], exc: Exception
                  ) -> Generator[Step | ChunkComputed, None, tuple[list[ChunkKV] | None, list[Tier]]]:
    """The KV tree's disk read of this prompt failed mid-pass (damage found layer by layer):
    the request lets go of its lease and runs as the tree had held nothing, its chunks' KV
    computed (none was read: the tree held the context). Its answer is still kept under its
    key after."""
    log.warning("the KV tree's disk read failed mid-prompt (%s); computing the prompt without it", exc)
    tree.release()
    req.tree = dataclasses.replace(tree, lease=None)
    if not engine.reads_chunk_kv(req.mode):
        return None, [Tier.NOT_LOADED] * len(req.chunks)
    kvs, tiers = yield from _chunk_kv(engine, req, phases, sources, loaded)
    return kvs, tiers


def _recompute_failed(engine: PromptEngine, req: Request, kvs: list[ChunkKV], tiers: list[Tier], exc: Exception
                      ) -> Generator[Step | ChunkComputed, None, list[ChunkKV]]:
    """`kvs` with every chunk whose layered read failed computed anew (layer by layer) and
    handed out to be kept (a damaged copy is already out of its tier). `tiers` is updated in place."""
    stalled = isinstance(exc, KVReadStalledError)  # then a read with layers still to come is given up
    failed = [i for i, kv in enumerate(kvs) if kv.ready is not None and
              (kv.ready.error is not None or stalled and arriving(kv.ready, kv.k.shape[0]))]
    if not failed:  # the error came from elsewhere (no chunk still loading has failed): not ours to absorb
        raise exc
    log.warning("layered KV read of %d chunk(s) failed mid-prompt (%s); recomputing them", len(failed), exc)
    kvs = list(kvs)
    for i in failed:
        kv = yield from _compute(engine, req, req.chunks[i])
        kvs[i], tiers[i] = _as_stored(req.chunks[i], kv), Tier.COMPUTED
        yield ChunkComputed(i, kv, kvs[i])
    return kvs


def _as_stored(ch: PromptChunk, kv: ChunkKV) -> ChunkKV:
    """A computed chunk's KV as its stored copy will read (`PromptChunk.stored`): what the answer
    uses, so computing a chunk gives the answer reading it gives."""
    return kv if ch.stored is None else ch.stored(kv)
