"""Pipeline: the real QueryBackend, composing retriever + kvstore + engine.

One collection = one index directory with its Retriever and its TieredStore (a CPU
tier over the tiers the index was written to). One model and one Engine serve every
collection; a collection whose index was built with another model is still listed
and searchable, but Query on it fails with IndexMismatchError (FAILED_PRECONDITION).

Request path: `prepare` searches and starts the KV prefetch at once (worker thread);
`answer` (engine thread) waits for each chunk's KV, computes the ones missing from
every tier and writes them back, blends, and streams the decode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ragkv.engine import BlendOptions, ChunkKV, Engine, LoadedModel, SamplingParams, load_model
from ragkv.engine.check import gate_model
from ragkv.engine.constrain import Constraint, GrammarError
from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT
from ragkv.engine.scheduler import Decode
from ragkv.engine.tree import KVTree, TreeKey, TreeLease
from ragkv.engine.work import WaitFor, wait_for
from ragkv.server.loading import ChunkDecision, ControllerConfig, LoadingController
from ragkv.indexer.neighbours import NeighbourOptions
from ragkv.kvstore import (ChunkKey, Compression, KVEntry, LayerGate, PrefetchHandle, PrefixHash, StoreConfig, TieredStore,
                           TierSpec, hash_prefix)
from ragkv.errors import IndexMismatchError, KVFormatError, StoreError
from ragkv.types import CollectionInfo, CollectionStats, FinishReason, KVSource, Mode, RetrievedChunk, Tier
from ragkv.retriever import Retriever
from ragkv.server.backend import AnswerEvent, ChunksEvent, DoneEvent, PreparedQuery, QueryParams, SearchParams, TokenIdEvent
from ragkv.server.search_config import retriever_options
from ragkv.server.settings import ServerSettings
from ragkv.server.status import InvalidArgumentError, UnknownCollectionError
from ragkv.server.structured import OutputSpec, output_spec, turn_text

log = logging.getLogger(__name__)

_SEED_TEXT = "The loading controller measures how fast this engine computes a chunk of text like this one."
_KV_WAIT_LIMIT = 120.0  # seconds a single chunk's KV load may take


@dataclass(frozen=True, slots=True)
class Collection:
    """One served index."""

    name: str  # collection name
    retriever: Retriever  # search over the index
    store: TieredStore  # KV tiers of the index, for the serving model
    prefix_ids: tuple[int, ...]  # the prefix the index's chunk KVs were computed after
    prefix_hash: PrefixHash  # its hash, as it names the KV entries
    mismatch: str | None  # why Query is refused (another model built the index); None = servable
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # the system prompt in prefix_ids (the index's own)
    # how its chunk KV was computed after neighbours (ragkv index --neighbours); m = 0: plain
    neighbours: NeighbourOptions = field(default_factory=NeighbourOptions)

    def kv_key(self, hit, mode: Mode, model_fp: str, tokenizer_fp: str,  # noqa: ANN001 - retriever.Hit
               focus_handover: bool = False) -> ChunkKey:
        """The KV a hit is served from in `mode` (which one, the index's options say:
        `NeighbourOptions.serves_plain`). Plain KV: the key is built here, not read from the
        index, so it names this build's file format and this model (an index written by an
        older format just misses). Neighbour KV: the key the index recorded (it names the
        neighbours' context, which only the indexer knows)."""
        if self.neighbours.serves_plain(mode, focus_handover):
            return ChunkKey.from_prefix_hash(model_fp, tokenizer_fp, self.prefix_hash, hit.token_ids)
        return hit.kv_key


@dataclass(frozen=True, slots=True)
class _Plan:
    """Pipeline-private state of a prepared query."""

    collection: Collection  # where the hits came from
    token_ids: tuple[tuple[int, ...], ...]  # each hit's chunk tokens
    kv_keys: tuple[ChunkKey, ...]  # each hit's KV name
    handles: tuple[PrefetchHandle | None, ...] | None  # KV loads in flight (None: computed instead);
    # None when the mode reads no chunk KV
    decisions: tuple[ChunkDecision, ...] = ()  # the loading controller's choice per hit
    output: OutputSpec | None = None  # the answer's prompt text and grammar (server.structured)
    constraint: Constraint | None = None  # the grammar compiled for this request; None = free text
    question_ids: tuple[int, ...] = ()  # the question segment: earlier turns, the question, the agent's turns
    # the tokens that choose chunk tokens and chunks: the question segment without the answer's
    # instructions and the agent's turns, so every call of a tool loop chooses as its first did
    # (None: the question segment)
    select_ids: tuple[int, ...] | None = None
    options: BlendOptions = BlendOptions()  # how the mode blends
    tree_key: TreeKey | None = None  # the context the answer's KV goes under in the KV tree; None = no tree
    lease: TreeLease | None = None  # the tree's KV of this prompt's first tokens, when it holds them


def _store_config(settings: ServerSettings, index_dir: Path, kv_uris: Sequence[str], device: torch.device,
                  kv_compression: str = "none") -> StoreConfig:
    """The serving store of one index: memory tiers from the settings, then the index's own
    durable tiers, except where the settings name a disk or S3 tier of their own."""
    from ragkv.retriever.manifest import resolve_kv_uris

    memory = [TierSpec(Tier.CPU, budget_bytes=settings.kv_cpu_bytes)]
    if device.type == "cuda" and settings.kv_gpu_bytes > 0:
        memory.insert(0, TierSpec(Tier.GPU, budget_bytes=settings.kv_gpu_bytes))
    # the index's tiers (a relative disk tier lives in the index folder), replaced by the settings' own
    durable = {spec.tier: spec for spec in map(TierSpec.parse, resolve_kv_uris(kv_uris, index_dir))}
    if settings.kv_disk_dir is not None:
        durable[Tier.DISK] = TierSpec(Tier.DISK, path=str(settings.kv_disk_dir))
    if settings.kv_s3_uri is not None:
        durable[Tier.S3] = TierSpec.parse(settings.kv_s3_uri)
    if not durable:
        durable[Tier.DISK] = TierSpec(Tier.DISK, path=str((index_dir / "kv").resolve()))
    # computed KV written back is stored as the index's own files are, unless --kv-compression says otherwise
    compression = kv_compression if settings.kv_compression == "auto" else settings.kv_compression
    return StoreConfig(tiers=(*memory, *durable.values()), compression=Compression(compression))


def check_system_prompt(params: QueryParams, index_prompt: str) -> None:
    """Refuse a request whose system message is not the one its collection was indexed with.

    The system prompt is in the prefix every chunk's KV was computed after, so another one
    cannot be honoured from the cache; it is refused rather than silently dropped.

    Raises:
        InvalidArgumentError: The request's system prompt differs (the message names both).
    """
    if params.system_prompt is None or params.system_prompt.strip() == index_prompt.strip():
        return
    raise InvalidArgumentError(
        "system_prompt",
        f"the request's system message {params.system_prompt!r} differs from the system prompt collection "
        f"{params.collection!r} was indexed with: {index_prompt!r} (send that one or none, or index the corpus "
        f"again with `ragkv index --system-prompt`)")


class Pipeline:
    """QueryBackend over retriever + kvstore + engine.

    Args:
        engine: The engine (one model) serving every collection.
        collections: The served collections by name.
        focus_keep: FOCUS keeps chunks scoring at least this x the best (BlendOptions.focus_keep).
        kv_layered: hand disk/S3 hits to the engine layer by layer (ServerSettings.kv_layered).
        focus_handover: FOCUS keeping several chunks blends them all (BlendOptions.focus_handover).
        focus_spread: ... when the two runners-up score on average this x the best (BlendOptions.focus_spread).
        quality_guard_mass: blend falls back to full prefill when holding this share of the
            question's attention needs more than its ratio (BlendOptions.fallback_full); None = off.
    """

    def __init__(self, engine: Engine, collections: dict[str, Collection], focus_keep: float = 0.5,
                 kv_layered: bool = True, controller: LoadingController | None = None,
                 focus_handover: bool = True, quality_guard_mass: float | None = None,
                 focus_spread: float = 0.7) -> None:
        self.engine = engine
        self._focus_keep, self._focus_handover, self._focus_spread = focus_keep, focus_handover, focus_spread
        self._guard_mass = quality_guard_mass
        self._kv_layered = kv_layered
        self.controller = controller or LoadingController()
        self.lm: LoadedModel = engine.lm
        self._collections = collections
        # durable write-backs run here: a slow or unreachable S3 never stalls the scheduler thread
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ragkv-writeback")

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> Pipeline:
        """Open every index, load the model (the first index's, unless settings name one).

        Raises:
            FileNotFoundError: An index directory holds no index.
            ModelLoadError: The model cannot be loaded.
        """
        if not settings.indexes:
            raise ValueError("no index to serve: give at least one --index [NAME=]DIR")
        settings = settings.resolved()  # --device/--dtype auto: cuda and bfloat16 when torch sees a GPU
        search = retriever_options(settings)  # search mode, fusion and reranker, shared by every index
        retrievers = {spec.name: (spec.index_dir, Retriever.open(spec.index_dir, device=settings.device, **search))
                      for spec in settings.indexes}
        first = next(iter(retrievers.values()))[1]
        lm = load_model(settings.model or first.manifest.model_spec, device=settings.device,
                        dtype=settings.dtype.value)
        gate_model(lm, skip=not settings.model_check)
        return cls.from_parts(Engine(lm), retrievers, settings)  # from_parts gives it its KV tree

    @classmethod
    def from_parts(
        cls, engine: Engine, retrievers: dict[str, tuple[Path, Retriever]], settings: ServerSettings
    ) -> Pipeline:
        """Assemble from an engine and opened retrievers (tests share one loaded engine: each
        pipeline gives it a KV tree of its settings' budget)."""
        lm = engine.lm
        engine.tree = KVTree(settings.kv_tree_bytes)
        collections = {}
        for name, (index_dir, retriever) in retrievers.items():
            manifest = retriever.manifest
            mismatch = None
            try:
                retriever.check_model(lm.fingerprint, lm.tokenizer_fingerprint)
            except IndexMismatchError as exc:
                mismatch = f"collection {name!r}: {exc}"
                log.warning("%s", mismatch)
            store = TieredStore(_store_config(settings, Path(index_dir), manifest.kv_uris, lm.device,
                                              manifest.kv_compression),
                                lm.fingerprint, lm.tokenizer_fingerprint)
            collections[name] = Collection(name, retriever, store, tuple(manifest.prefix_ids),
                                           hash_prefix(manifest.prefix_ids), mismatch,
                                           manifest.system_prompt or DEFAULT_SYSTEM_PROMPT,
                                           NeighbourOptions.from_dict(manifest.neighbours))
        controller = LoadingController(ControllerConfig(enabled=settings.kv_controller))
        first = next(iter(collections.values()), None)
        if first is not None:  # seed the prefill rate: a chunk of ~100 tokens after the prefix
            ids = engine.prompt.chunk_ids(" ".join([_SEED_TEXT] * 4))
            engine.prefill_chunk(list(first.prefix_ids), ids)  # warm-up: the first call allocates
            t0 = time.perf_counter()
            engine.prefill_chunk(list(first.prefix_ids), ids)
            controller.observe_compute(len(ids), time.perf_counter() - t0)
        return cls(engine, collections, settings.focus_keep, settings.kv_layered, controller, settings.focus_handover,
                   settings.quality_guard_mass, settings.focus_spread)

    @property
    def modes(self) -> frozenset[Mode]:
        return frozenset(Mode)

    def _collection(self, name: str) -> Collection:
        try:
            return self._collections[name]
        except KeyError:
            served = ", ".join(sorted(self._collections))
            raise UnknownCollectionError(f"collection {name!r} is not served here (served: {served})") from None

    def collections(self) -> Sequence[CollectionInfo]:
        return [
            CollectionInfo(c.name, len(c.retriever), c.retriever.manifest.model_fp, c.retriever.manifest.tokenizer_fp)
            for c in self._collections.values()
        ]

    def collection_stats(self, name: str) -> CollectionStats:
        c = self._collection(name)
        info = CollectionInfo(c.name, len(c.retriever), c.retriever.manifest.model_fp,
                              c.retriever.manifest.tokenizer_fp)
        return CollectionStats(info, c.store.stats().tiers)

    def _search(self, c: Collection, question: str, top_k: int, search: SearchParams) -> list:  # list[retriever.Hit]
        return c.retriever.search(str(question), min(top_k, len(c.retriever)), mode=search.mode,
                                  filters=search.filters)

    def retrieve(self, collection: str, question: str, top_k: int,
                 search: SearchParams | None = None) -> tuple[RetrievedChunk, ...]:
        c = self._collection(collection)
        search = search or SearchParams()
        return tuple(
            RetrievedChunk(h.chunk_id, h.score, h.text, h.metadata, None, len(h.token_ids), h.found_by)
            for h in self._search(c, question, top_k, search)
        )

    def prepare(self, params: QueryParams) -> PreparedQuery:
        c = self._collection(params.collection)
        if c.mismatch is not None:
            raise IndexMismatchError(c.mismatch)
        check_system_prompt(params, c.system_prompt)
        started = time.perf_counter()
        hits = self._search(c, params.question, params.top_k, params.search)
        retrieved = time.perf_counter()
        chunks = tuple(
            RetrievedChunk(h.chunk_id, h.score, h.text, h.metadata, None, len(h.token_ids), h.found_by)
            for h in hits
        )
        output = output_spec(params, chunks)
        try:  # compiled here, on the retrieval pool: the scheduler thread only applies masks
            constraint = None if output.grammar is None else self.engine.grammars.compile(output.grammar, output.closing)
        except GrammarError as exc:
            raise InvalidArgumentError("response_format" if params.response_format.schema else "tools", str(exc)) from None
        kv_keys = tuple(c.kv_key(h, params.mode, self.lm.fingerprint, self.lm.tokenizer_fingerprint,
                                 self._focus_handover) for h in hits)
        token_ids = tuple(tuple(h.token_ids) for h in hits)
        question_ids, select_ids = self._question_ids(params, output)
        chunk_tokens = sum(len(ids) for ids in token_ids)
        self._check_context(params, len(c.prefix_ids) + chunk_tokens + len(question_ids))
        options = self._options(params)
        tree_key, lease = None, None
        if self.engine.tree.enabled:  # the tree may hold this prompt's context and first tokens
            chose = select_ids if select_ids is not None else question_ids
            tree_key = self.engine.tree_key(params.mode, c.prefix_ids, (*kv_keys, c.retriever.manifest.kv_compression),
                                            options, chose)
            lease = self.engine.tree.match(tree_key, self.engine.tree_path(params.mode, c.prefix_ids, token_ids,
                                                                          question_ids))
        handles, decisions = None, ()
        if self.engine.reads_chunk_kv(params.mode) and lease is None:  # start loading the moment the ids are known
            decisions = tuple(self.controller.decide(c.store, kv_keys, [len(h.token_ids) for h in hits]))
            reads = iter(c.store.prefetch([k for k, d in zip(kv_keys, decisions) if d.load],
                                          layered=self._kv_layered))
            handles = tuple(next(reads) if d.load else None for d in decisions)
        plan = _Plan(c, token_ids, kv_keys, handles, decisions, output, constraint, tuple(question_ids),
                     None if select_ids is None else tuple(select_ids), options, tree_key, lease)
        prompt_tokens = len(c.prefix_ids) + chunk_tokens + len(question_ids)
        kv_bytes = (prompt_tokens + params.max_new_tokens) * self.engine.kv_bytes_per_token
        done = 0 if lease is None else lease.tokens  # a tree hit computes only the rest
        cost = self.engine.prompt_cost(params.mode, len(c.prefix_ids), chunk_tokens, len(question_ids), options)
        cost = max(1, cost * (prompt_tokens - done) // max(prompt_tokens, 1))
        return PreparedQuery(params, chunks, {"retrieve": retrieved - started}, plan, kv_bytes, cost,
                             output.reads_tool_calls)

    def _question_ids(self, params: QueryParams, output: OutputSpec) -> tuple[list[int], list[int] | None]:
        """The question segment's tokens, and the tokens that choose chunk tokens and chunks
        (None: the same): the conversation's question, its earlier turns and the question,
        without the answer's instructions (tools, format) or the agent's turns since the
        question. So every call of a tool loop chooses as its first did, whatever its
        tool_choice, and the KV tree's context of the first call is exactly the later calls'."""
        fmt = self.engine.prompt
        history = [(t.role.value, turn_text(t)) for t in params.history]
        agent = [(t.role.value, turn_text(t)) for t in params.agent_turns]
        # a conversation in the chat template's own turns; a single question, or a tokenizer
        # without a template, as one segment of text
        question_ids = fmt.turn_ids(params.question, history, output.before, agent)
        if question_ids is None:
            question_ids = fmt.question_ids(params.question, history, output.before, output.after)
        if not output.before and not output.after:
            return question_ids, None
        return question_ids, fmt.turn_ids(params.question, history) or fmt.question_ids(params.question, history)

    def _check_context(self, params: QueryParams, prompt_tokens: int) -> None:
        """Refuse a prompt that with its answer's budget exceeds the model's context.

        Raises:
            InvalidArgumentError: It does, naming the tokens and the limit.
        """
        limit = self.lm.context_length
        if limit is None or prompt_tokens + params.max_new_tokens <= limit:
            return
        field_ = "history" if params.history or params.agent_turns else "question"
        raise InvalidArgumentError(
            field_, f"the prompt is {prompt_tokens} tokens and the answer may take {params.max_new_tokens} "
                    f"(max_tokens): {prompt_tokens + params.max_new_tokens} tokens, more than the model's context "
                    f"of {limit}; send fewer or shorter turns, fewer chunks (top_k), or a smaller max_tokens")

    def _options(self, params: QueryParams) -> BlendOptions:
        """How this request's mode blends, from its ratio and the server's focus and guard settings."""
        guard = {} if self._guard_mass is None else {  # exactly the ratio's tokens, or full prefill
            "adaptive_mass": self._guard_mass, "min_ratio": params.recompute_ratio, "fallback_full": True}
        return BlendOptions(recompute_ratio=params.recompute_ratio, focus_keep=self._focus_keep,
                            focus_handover=self._focus_handover, focus_spread=self._focus_spread, **guard)

    def _load_chunks(
        self, prepared: PreparedQuery, plan: _Plan, cancel: threading.Event, phases: dict[str, float],
        sources: Counter[KVSource],
    ):  # -> Generator[int | WaitFor, None, tuple[list[ChunkKV], list[Tier], dict[Tier, int]] | None]
        """Each chunk's KV from its tier, or computed (layer by layer) and written back, as the
        loading controller decided; None if cancelled. `sources` counts where each came from.

        The request waits for its reads parked in the scheduler (`WaitFor`), never polling; a
        read still pending past the controller's limit is abandoned and the chunk computed.
        """
        lm, c = self.lm, plan.collection
        kvs: list[ChunkKV] = []
        tiers: list[Tier] = []
        loaded: dict[Tier, int] = {}
        handles = plan.handles or ()
        t0 = time.perf_counter()
        if (w := wait_for([h.future for h in handles if h is not None])) is not None:
            yield WaitFor(w.futures, self.controller.wait_limit(plan.decisions, _KV_WAIT_LIMIT, c.store.prefetch_workers))
        wait_s, compute_s = time.perf_counter() - t0, [0.0]
        if cancel.is_set():
            return None
        for ids, key, handle, decision in zip(plan.token_ids, plan.kv_keys, handles, plan.decisions):
            hit, source = None, decision.source
            if handle is not None and not handle.done():
                log.info("loading KV of %s overran its estimate (%s s); computing it", key,
                         f"{decision.load_s:.3f}" if decision.load_s is not None else "?")
                source = KVSource.COMPUTED_OVERRUN
            elif handle is not None:
                try:
                    hit = handle.hit(timeout=0)
                    source = KVSource.LOADED if hit is not None else KVSource.COMPUTED_MISSING
                except (KVFormatError, StoreError, OSError) as exc:  # the tiers could not serve it: compute it
                    log.warning("loading KV of %s failed (%s); computing it", key, exc)
                    source = KVSource.COMPUTED_FAILED
            sources[source] += 1
            if hit is not None:
                tier = hit.tier
                loaded[tier] = loaded.get(tier, 0) + hit.entry.nbytes
                kvs.append(ChunkKV.from_stored(hit.entry, lm.device, lm.dtype, hit.layers))
                tiers.append(tier)
                continue
            kv = yield from self._compute_chunk(c, ids, compute_s)
            if cancel.is_set():
                return None
            self._write_back(c, key, kv)
            kvs.append(kv)
            tiers.append(Tier.COMPUTED)
        phases["kv_wait"] = wait_s
        phases["kv_compute"] = compute_s[0]
        return kvs, tiers, loaded

    def _compute_chunk(self, c: Collection, ids: Sequence[int], spent: list[float]):  # -> Generator[int, None, ChunkKV]
        """A chunk's KV computed one layer per step; its own compute seconds (not the time other
        requests ran between its steps) go into spent[0] and teach the controller the prefill rate."""
        steps = self.engine.prefill_chunk_steps(list(c.prefix_ids), list(ids))
        own = 0.0
        while True:
            t0 = time.perf_counter()
            try:
                item = next(steps)
            except StopIteration as done:
                own += time.perf_counter() - t0
                spent[0] += own
                self.controller.observe_compute(len(ids), own)
                return done.value
            own += time.perf_counter() - t0
            yield item

    def _recompute_failed(self, c: Collection, plan: _Plan, kvs: list[ChunkKV], tiers: list[Tier],
                          exc: Exception):  # -> Generator[int, None, list[ChunkKV]]
        """`kvs` with every chunk whose layered read failed computed anew (layer by layer) and
        written back (a damaged copy is already out of its tier). `tiers` is updated in place."""
        failed = [i for i, kv in enumerate(kvs) if isinstance(kv.ready, LayerGate) and kv.ready.error is not None]
        if not failed:  # the error came from elsewhere (no chunk still loading has failed): not ours to absorb
            raise exc
        log.warning("layered KV read of %d chunk(s) failed mid-prompt (%s); recomputing them", len(failed), exc)
        kvs = list(kvs)
        for i in failed:
            kvs[i] = yield from self._compute_chunk(c, plan.token_ids[i], [0.0])
            tiers[i] = Tier.COMPUTED
            self._write_back(c, plan.kv_keys[i], kvs[i])
        return kvs

    def _write_back(self, c: Collection, key: ChunkKey, kv: ChunkKV) -> None:
        """Store a chunk KV computed on the spot, on the writer thread (memory tiers first, then
        the durable ones): the scheduler thread only hands it over. The answer does not depend on it."""
        self._writer.submit(self._persist, c, key, kv)

    def _persist(self, c: Collection, key: ChunkKey, kv: ChunkKV) -> None:
        try:
            entry = KVEntry.of(kv, key, self.lm.fingerprint, self.lm.tokenizer_fingerprint, c.prefix_hash)
        except ValueError:  # the key names neighbour-conditioned KV (ragkv index --neighbours): the
            return  # plain KV computed here serves this request but is not that entry
        c.store.put(entry, durable=False)  # the next request finds it in memory
        try:
            c.store.put(entry, memory=False)
        except StoreError as exc:
            log.warning("writing back computed KV of %s failed: %s", entry.key, exc)

    def flush_writes(self, timeout: float | None = None) -> None:
        """Wait until every write-back submitted so far has reached its durable tiers (or failed)."""
        self._writer.submit(lambda: None).result(timeout)

    def tier_errors(self) -> dict[tuple[str, Tier], int]:
        """I/O failures per (collection, tier) so far (ServerMetrics.watch_tier_errors)."""
        return {(c.name, t.tier): t.errors for c in self._collections.values()
                for t in c.store.stats().tiers}

    def answer(self, prepared: PreparedQuery, cancel: threading.Event) -> Iterator[AnswerEvent]:
        plan = prepared.state
        if not isinstance(plan, _Plan):
            raise RuntimeError(f"prepared query carries {type(plan).__name__}, not this pipeline's plan: a bug")
        try:
            yield from self._answer(prepared, plan, cancel)
        finally:  # a tree lease not used (cancelled, failed) lets its path go
            if plan.lease is not None:
                plan.lease.release()

    def _answer(self, prepared: PreparedQuery, plan: _Plan, cancel: threading.Event) -> Iterator[AnswerEvent]:
        params = prepared.params
        engine, c = self.engine, plan.collection
        phases: dict[str, float] = {}
        loaded: dict[Tier, int] = {}
        sources: Counter[KVSource] = Counter()
        if plan.lease is not None and engine.reads_chunk_kv(params.mode):  # the context is the tree's
            kvs, tiers = None, [Tier.TREE] * len(plan.token_ids)
        elif engine.reads_chunk_kv(params.mode):
            result = yield from self._load_chunks(prepared, plan, cancel, phases, sources)
            if result is None:
                return
            kvs, tiers, loaded = result
        else:
            kvs, tiers = None, [Tier.NOT_LOADED] * len(plan.token_ids)
        yield ChunksEvent(tuple(dataclasses.replace(ch, kv_tier=t) for ch, t in zip(prepared.chunks, tiers)))
        if cancel.is_set():
            return

        question_ids = list(plan.question_ids)
        t0 = time.perf_counter()

        def run(kvs: list[ChunkKV] | None):  # -> engine.blend.PromptSteps
            return engine.run_steps(c.prefix_ids, plan.token_ids, kvs, question_ids, params.mode, plan.options,
                                    reserve_tokens=params.max_new_tokens, select_ids=plan.select_ids,
                                    resume=plan.lease)

        res = None
        while res is None:  # each retry computes at least one chunk anew, so this ends
            try:
                res = yield from run(kvs)
            except (KVFormatError, StoreError) as exc:  # a layered read failed mid-prompt
                # a chunk whose read fails later (during the retry) fails that pass in turn
                kvs = yield from self._recompute_failed(c, plan, kvs or [], tiers, exc)
        phases["prompt"] = time.perf_counter() - t0
        phases.update({f"prompt.{k}": v for k, v in res.timings.items()})
        tree_tokens = plan.lease.tokens if plan.lease is not None else 0

        stream = engine.decode(res, SamplingParams(
            max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            seed=params.seed, stop=params.stop,
        ), plan.constraint)
        t0 = time.perf_counter()
        text = stream.detokenizer()  # runs on the consumer's side: stop strings stop the stream from there
        yield Decode(stream, lambda token: TokenIdEvent(token, text))  # decoded batched with the others
        phases["decode"] = time.perf_counter() - t0
        if plan.tree_key is not None and not cancel.is_set():  # the next call of this conversation starts here
            engine.remember(plan.tree_key, params.mode, res, len(question_ids), len(c.prefix_ids), stream.token_ids)

        used = res.used_chunks if res.used_chunks is not None else range(len(prepared.chunks))
        yield DoneEvent(
            prompt_tokens=res.n_prompt_tokens,
            cached_prompt_tokens=res.cached_tokens,
            completion_tokens=len(stream.token_ids),
            recompute_fraction=float(res.recompute_fraction),
            finish_reason=stream.finish_reason or FinishReason.STOP,
            phase_seconds=phases,
            bytes_loaded=loaded,
            used_chunk_ids=tuple(prepared.chunks[i].chunk_id for i in used),
            kv_sources=dict(sources),
            fell_back=res.fell_back,
            handed_over=res.handed_over,
            tree_prompt_tokens=tree_tokens,
        )

    def close(self) -> None:
        """Finish the write-backs, then release every store and index."""
        self._writer.shutdown(wait=True)
        for c in self._collections.values():
            c.store.close()
            c.retriever.close()
