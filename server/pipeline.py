"""Pipeline: the real QueryBackend, composing retriever + kvstore + engine.

One collection = one index directory with its Retriever and its TieredStore (a CPU
tier over the tiers the index was written to). One model and one Engine serve every
collection; a collection whose index was built with another model is still listed
and searchable, but Query on it fails with IndexMismatchError (FAILED_PRECONDITION).

Request path: `prepare` (retrieval pool) searches, tokenizes, leases the KV tree and
starts each chunk's KV read at once, building the `engine.request.Request` from the `Query`; the
engine's own work (`Engine.work`, on the scheduler thread) waits for the reads,
computes what is missing, blends and decodes. A chunk computed there comes back out
(`ChunkComputed`) and is kept in the tiers here (`keep`, on the writer thread).

Built from settings by `server/assembly.py` (`build_pipeline`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ragkv.engine import BlendOptions, ChunkKV, Engine, FocusOptions, LoadedModel
from ragkv.engine.constrain import Constraint, GrammarError
from ragkv.engine.decode import SamplingParams
from ragkv.engine.detokenize import Detokenizer
from ragkv.engine.kv.conversation import CarriedTurns, TreeSpot
from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT, PromptFormat
from ragkv.engine.request import ChunkComputed, ChunkContextKV, LoadedKV, PromptChunk, Request, Work
from ragkv.errors import IndexMismatchError, StoreError
from ragkv.kvstore import (
    ChunkContext,
    ChunkKey,
    Compression,
    KVEntry,
    MemoryTier,
    PeerTier,
    PrefetchHandle,
    PrefixHash,
    TieredStore,
)
from ragkv.kvstore.compression import round_trip
from ragkv.retriever import Retriever, SearchHit
from ragkv.retriever.chunk_keys import NeighbourContext, NeighbourOptions, NeighbourRecipe, neighbour_recipe, serving_keys
from ragkv.retriever.manifest import Calibration
from ragkv.server.backend import BackendParts, Prepared
from ragkv.server.fidelity import DEFAULT_RECOMPUTE_RATIO, RequestRatio, ServedRatio, request_ratio
from ragkv.server.loading_controller import ChunkDecision, LoadingController
from ragkv.server.query import Query
from ragkv.server.status import InvalidArgumentError, UnknownCollectionError
from ragkv.server.structured import OutputSpec, output_spec, turn_text
from ragkv.types import (
    CollectionInfo,
    CollectionStats,
    KVSource,
    LengthLimit,
    MetadataFilter,
    Mode,
    RetrievedChunk,
    SearchMode,
    SystemPromptPath,
    Tier,
)

log = logging.getLogger(__name__)

_KV_WAIT_LIMIT = 120.0  # seconds a single chunk's KV load may take
_FORMATS = 256  # requests' own system prompts whose prompt layout is kept (least recently used dropped)


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
    calibration: Calibration | None = None  # blend's measured distance from full prefill (ragkv index --calibrate)
    # the ratio its requests that set none get (server/fidelity.py, chosen at start-up)
    served: ServedRatio = ServedRatio(DEFAULT_RECOMPUTE_RATIO, None, "the default")
    # how the index stores the plain copies of its chunks' KV, where it keeps them beside the
    # neighbour KV in another compression; None = as the store writes every file
    plain_compression: Compression | None = None

    @property
    def plain_copy_compression(self) -> Compression:
        """How the durable tiers store a chunk's plain copy (its KV after the prefix alone)."""
        return self.plain_compression or self.store.compression

    def compression(self, key: ChunkKey, token_ids: Sequence[int], model_fp: str, tokenizer_fp: str) -> Compression:
        """How the durable tiers store `key`'s KV, a chunk's (of `token_ids`) plain copy or the KV
        the index recorded for it: a chunk computed here is served as that file will read
        (`kvstore.compression.round_trip`) and written back in it."""
        if self.plain_compression is None or not self.neighbours.enabled:
            return self.store.compression
        plain = key == ChunkKey.from_prefix_hash(model_fp, tokenizer_fp, self.prefix_hash, token_ids)
        return self.plain_copy_compression if plain else self.store.compression

    def kv_keys(self, hits: Sequence[SearchHit], mode: Mode, model_fp: str, tokenizer_fp: str,
                focus_handover: bool = False) -> list[ChunkKey]:
        """The KV each of a prompt's hits is served from in `mode` (`chunk_keys.serving_keys`, as the
        cluster's ingress routes on them)."""
        return serving_keys(hits, mode, self.neighbours, self.prefix_hash, model_fp, tokenizer_fp, focus_handover)

    def recipes(self, hits: Sequence[SearchHit], keys: Sequence[ChunkKey], model_fp: str, tokenizer_fp: str
                ) -> tuple[NeighbourRecipe | None, ...]:
        """Per hit served from its neighbour KV (its `keys` entry is the one the index recorded),
        what that KV was computed after, as the index records its neighbours (`neighbour_recipe`);
        None for the others, and where the index records none (built before it did)."""
        served = [self.neighbours.enabled and k == h.kv_key for h, k in zip(hits, keys)]
        recorded = self.retriever.neighbours_of([h.chunk_id for h, s in zip(hits, served) if s]) if any(served) else {}
        return tuple(neighbour_recipe(h, recorded[h.chunk_id], self.neighbours, self.prefix_hash, model_fp, tokenizer_fp)
                     if s and h.chunk_id in recorded else None for h, s in zip(hits, served))


@dataclass(frozen=True, slots=True)
class Retrieved:
    """Preparation's first stage: where a query searched, and what it found."""

    collection: Collection
    hits: tuple[SearchHit, ...]  # best first
    chunks: tuple[RetrievedChunk, ...]  # the hits as the client sees them: the answer's provenance
    seconds: float  # the search's time (0 when the cluster's ingress searched)


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """Preparation's second stage: the prompt's tokens, and the KV each chunk is served from."""

    output: OutputSpec  # the answer's prompt text and grammar
    constraint: Constraint | None  # the compiled grammar; None = free text
    prefix_ids: tuple[int, ...]  # the shared prefix the chunks' KV was computed after
    kv_keys: tuple[ChunkKey | str, ...]  # per chunk, the KV it is served from (`serving_key`; carried turns: a str)
    token_ids: tuple[tuple[int, ...], ...]  # per chunk, its tokens
    question_ids: tuple[int, ...]  # the question segment
    select_ids: tuple[int, ...] | None  # the tokens that choose; None = question_ids
    options: BlendOptions  # how the mode blends
    sampling: SamplingParams  # the query's, its max_new_tokens bounded by the context left when the client set none
    length_limit: LengthLimit  # what bounds the answer's length
    # the request's own instructions: the index's prefix its chunks' KV was computed after (prefix_ids
    # is then the request's own); None = prefix_ids is the index's
    chunk_prefix_ids: tuple[int, ...] | None = None
    system_prompt: SystemPromptPath = SystemPromptPath.INDEXED  # how its system message is served
    ratio: RequestRatio = RequestRatio(None, None)  # the ratio blend runs at, and the KL predicted for it
    # per retrieved chunk served from its neighbour KV, what that KV was computed after (a chunk
    # computed here is computed after it too); None: after the prefix alone
    recipes: tuple[NeighbourRecipe | None, ...] = ()

    @property
    def chunk_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix_ids) + self.chunk_tokens + len(self.question_ids)


def _stored_as(compression: Compression) -> Callable[[ChunkKV], ChunkKV] | None:
    """What a chunk's KV computed here becomes once stored with `compression` (None: files keep it
    bit-exact): the engine serves that, so the answer is the one the stored copy will give."""
    if compression is Compression.NONE:
        return None

    def as_stored(kv: ChunkKV) -> ChunkKV:
        try:
            return dataclasses.replace(kv, k=round_trip(kv.k, compression, "k"), v=round_trip(kv.v, compression, "v"))
        except ValueError as exc:  # values the codec cannot hold (int4's float16 scales): no file holds
            log.warning("computed KV served as computed, not as %s stores it: %s", compression.value, exc)
            return kv  # them either (the write-back fails the same way, and is logged)

    return as_stored


def search_hits(retriever: Retriever, question: str, top_k: int, search_mode: SearchMode | None,
                filters: Sequence[MetadataFilter]) -> list[SearchHit]:
    """A collection's `top_k` best chunks for `question` (at most the index's size)."""
    return retriever.search(str(question), min(top_k, len(retriever)), mode=search_mode, filters=tuple(filters))


def retrieved_chunk(hit: SearchHit) -> RetrievedChunk:
    """A search hit as the client sees it (its KV tier is set when the answer reads it)."""
    return RetrievedChunk(hit.chunk_id, hit.score, hit.text, hit.metadata, None, len(hit.token_ids), hit.found_by)


def check_system_prompt(params: Query, index_prompt: str) -> None:
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
        focus: how FOCUS picks its chunks (the server's --focus-* settings).
        kv_layered: hand disk/S3 hits to the engine layer by layer (ServerSettings.kv_layered).
        quality_guard_mass: blend falls back to full prefill when holding this share of the
            question's attention needs more than its ratio (BlendOptions.fallback_full); None = off.
        system_prompt_policy: a request's own system message (not its index's): "prefix" computes
            it in front of the chunks, "suffix" places it after them, "strict" refuses it.
        system_prompt_ratio: blend's ratio for a prefix-policy request that sets none (None: its own).
    """

    def __init__(self, engine: Engine, collections: dict[str, Collection],
                 focus: FocusOptions = FocusOptions(handover=True), kv_layered: bool = True,
                 controller: LoadingController | None = None, quality_guard_mass: float | None = None,
                 system_prompt_policy: str = "prefix", system_prompt_ratio: float | None = None) -> None:
        self.engine = engine
        self._system_policy = system_prompt_policy  # ServerSettings.system_prompt_policy
        self._system_ratio = system_prompt_ratio  # ServerSettings.system_prompt_recompute_ratio
        # requests' own system prompts' layouts, the chat template rendered once per prompt (thread-safe)
        self._format = functools.lru_cache(maxsize=_FORMATS)(engine.prompt.with_system)
        self._focus = focus
        self._guard_mass = quality_guard_mass
        self._kv_layered = kv_layered
        self.controller = controller or LoadingController(speed=engine.speed)
        self.lm: LoadedModel = engine.lm
        self._collections = collections
        # durable write-backs run here: a slow or unreachable S3 never stalls the scheduler thread
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ragkv-writeback")
        self._warmer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ragkv-tree-warm")

    @property
    def modes(self) -> frozenset[Mode]:
        return self.engine.modes()

    def _collection(self, name: str) -> Collection:
        try:
            return self._collections[name]
        except KeyError:
            raise UnknownCollectionError.naming(name, self._collections) from None

    def parts(self) -> BackendParts:
        return BackendParts(self.engine.conversations.tree, self.engine.speed, self.tier_errors,
                            {name: c.served for name, c in self._collections.items()}, self.engine.decoder)

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

    def _search(self, c: Collection, question: str, top_k: int, search_mode: SearchMode | None,
                filters: Sequence[MetadataFilter]) -> list[SearchHit]:
        return search_hits(c.retriever, question, top_k, search_mode, filters)

    def retrieve(self, collection: str, question: str, top_k: int, search_mode: SearchMode | None = None,
                 filters: Sequence[MetadataFilter] = ()) -> tuple[RetrievedChunk, ...]:
        c = self._collection(collection)
        return tuple(map(retrieved_chunk, self._search(c, question, top_k, search_mode, filters)))

    def prepare(self, query: Query, hits: Sequence[SearchHit] | None = None) -> Prepared:
        """The engine's request for `query`, ready to submit (`work`), in four stages that each
        return what they made: retrieve, plan the prompt, lease the KV tree, start the chunks'
        KV reads. Runs on the retrieval pool. `hits`: its chunks when the cluster's ingress
        retrieved them already (`server/cluster.py`); None = search here.

        Raises:
            UnknownCollectionError, IndexMismatchError, InvalidArgumentError (the system prompt,
            a grammar, a prompt longer than the model's context).
        """
        retain_s = self._retention(query)  # a bad bound costs no search
        if self.engine.conversations.tree.files is not None:  # its last call's path off disk while it searches
            self._warmer.submit(self.engine.conversations.prefetch, query.conversation)
        found = self._retrieve(query, hits)
        plan = self._plan(query, found)
        if plan.ratio.ratio is None:  # a fidelity target no calibrated ratio meets: full prefill is exact
            query = dataclasses.replace(query, mode=Mode.FULL)
        plan, tree = self._lease(query, found, plan)
        mode, tree, chunks, kv_wait_s = self._sources(query, found, plan, tree)
        done = 0 if tree is None else tree.tokens  # a tree hit computes only the rest
        sizes = (mode, len(plan.prefix_ids), plan.chunk_tokens, len(plan.question_ids), plan.options)
        cost, rows = self.engine.prompt_cost(*sizes), self.engine.prompt_rows(*sizes)
        todo, whole = plan.prompt_tokens - done, max(plan.prompt_tokens, 1)  # the share of the prompt it computes
        resumed = tree is not None and tree.lease is not None
        own = plan.chunk_prefix_ids is not None and mode is not Mode.FULL and not resumed
        return Prepared(Request(
            mode=mode, sampling=plan.sampling, prefix_ids=plan.prefix_ids, chunk_prefix_ids=plan.chunk_prefix_ids,
            instructions=self.engine.conversations.instructions(plan.prefix_ids, query.tenant) if own else None,
            chunks=chunks, question_ids=plan.question_ids, select_ids=plan.select_ids,
            # a hybrid keeps its state where the next call's prompt parts from this one's
            snapshot_at=None if tree is None or not self.engine.recurrent else
            plan.prompt_tokens - self.engine.prompt.answer_header_tokens(plan.question_ids),
            options=plan.options, constraint=plan.constraint, reads_tool_calls=plan.output.reads_tool_calls,
            tree=tree, tree_retain_s=retain_s if plan.output.reads_tool_calls else 0.0,
            tree_priority=query.retain_priority, kv_wait_s=kv_wait_s,
            kv_bytes=self.engine.request_kv_bytes(plan.prompt_tokens + plan.sampling.max_new_tokens),
            prompt_cost=max(1, cost * todo // whole), prompt_rows=max(1, rows * todo // whole),
            phase_seconds={"retrieve": found.seconds}), found.chunks, plan.system_prompt, plan.length_limit,
            plan.ratio if mode in (Mode.BLEND, Mode.FOCUS) or plan.ratio.ratio is None else RequestRatio(None, None))

    def _lease(self, query: Query, found: Retrieved, plan: PromptPlan) -> tuple[PromptPlan, TreeSpot | None]:
        """Stage 3: the KV tree's lease on what it holds of this prompt (a lease carrying its key
        and path). A follow-up question whose retrieval gave other chunks than its
        conversation's last call carries that call's turns in as one more chunk, their KV read
        from the tree (`Conversations.follow`, blend mode); the later calls of its tool loop
        carry the same turns, so they find the context the follow-up left."""
        trees, conversation = self.engine.conversations, query.conversation
        carried = trees.carried(conversation, query.mode, plan.question_ids)
        if carried is not None:
            carrying = self._carrying(query, plan, carried)
            spot = self._spot(query, found, carrying, conversation, carried)
            if spot is not None and spot.lease is not None:
                return carrying, spot
        spot = self._spot(query, found, plan, conversation, None)
        if spot is None or spot.lease is not None:
            return plan, spot
        turns = trees.follow(conversation, query.mode, plan.question_ids)
        if turns is None:
            return plan, spot
        plan = self._carrying(query, plan, turns)
        return plan, self._spot(query, found, plan, conversation, turns)  # a miss: the key its answer is kept under

    def _spot(self, query: Query, found: Retrieved, plan: PromptPlan, conversation: str,
              turns: CarriedTurns | None, mode: Mode | None = None) -> TreeSpot | None:
        return self.engine.conversations.lease(
            mode or query.mode, plan.prefix_ids, plan.token_ids,
            (*plan.kv_keys, found.collection.retriever.manifest.kv_compression),
            plan.question_ids, options=plan.options, select_ids=plan.select_ids, tenant=query.tenant,
            conversation=conversation, turns=turns)

    def _carrying(self, query: Query, plan: PromptPlan, turns: CarriedTurns) -> PromptPlan:
        """`plan` with the earlier turns as its last chunk: the question segment after them, and
        the question alone choosing (so a tool loop's calls choose alike, whatever it adds)."""
        n = len(turns.ids)
        return dataclasses.replace(plan, token_ids=(*plan.token_ids, turns.ids), kv_keys=(*plan.kv_keys, turns.key),
                                   question_ids=plan.question_ids[n:],
                                   select_ids=tuple(self.engine.prompt.question_ids(query.question)))

    def _retention(self, query: Query) -> float:
        """Seconds an answer to `query` that may end in tool calls keeps its tree path pinned."""
        trees, asked = self.engine.conversations, query.retain_seconds
        if asked is not None and asked > trees.retain_max_s:
            raise InvalidArgumentError("retain_seconds", f"must be at most {trees.retain_max_s:g} s (ragkv serve "
                                                         f"--kv-tree-retain-max-s), got {asked:g}")
        return trees.retention(asked)

    def _retrieve(self, query: Query, hits: Sequence[SearchHit] | None) -> Retrieved:
        """Stage 1: the collection, checked servable for this query, and its hits."""
        c = self._collection(query.collection)
        if c.mismatch is not None:
            raise IndexMismatchError(c.mismatch)
        if self._system_policy == "strict":
            check_system_prompt(query, c.system_prompt)
        started = time.perf_counter()
        if hits is None:
            hits = self._search(c, query.question, query.top_k, query.search_mode, query.filters)
        return Retrieved(c, tuple(hits), tuple(map(retrieved_chunk, hits)), time.perf_counter() - started)

    def _plan(self, query: Query, found: Retrieved) -> PromptPlan:
        """Stage 2: the prompt's tokens, the KV each chunk is served from, its grammar and options;
        a prompt longer than the model's context is refused here."""
        c = found.collection
        output = output_spec(query, found.chunks)
        try:  # compiled here, on the retrieval pool: the scheduler thread only applies masks
            constraint = None if output.grammar is None else self.engine.grammars.compile(output.grammar,
                                                                                           output.closing)
        except GrammarError as exc:
            raise InvalidArgumentError("response_format" if query.response_format.schema else "tools", str(exc)) from None
        path, fmt = self._system_path(query, c)
        # its own instructions after the chunks: they open the question's turn
        before = f"{query.system_prompt.strip()}\n\n" if path is SystemPromptPath.SUFFIX and query.system_prompt else ""
        question_ids, select_ids = self._question_ids(query, output, fmt, before)
        own = path is SystemPromptPath.PREFIX
        ratio = self._ratio(query, c, own)
        lm = self.lm
        keys = c.kv_keys(found.hits, query.mode, lm.fingerprint, lm.tokenizer_fingerprint, self._focus.handover)
        plan = PromptPlan(
            output=output, constraint=constraint, prefix_ids=tuple(fmt.prefix_ids()) if own else c.prefix_ids,
            kv_keys=tuple(keys), recipes=c.recipes(found.hits, keys, lm.fingerprint, lm.tokenizer_fingerprint),
            token_ids=tuple(tuple(h.token_ids) for h in found.hits), question_ids=tuple(question_ids),
            select_ids=None if select_ids is None else tuple(select_ids),
            options=self._options(DEFAULT_RECOMPUTE_RATIO if ratio.ratio is None else ratio.ratio),
            sampling=query.sampling, length_limit=query.length_limit, chunk_prefix_ids=c.prefix_ids if own else None,
            system_prompt=path, ratio=ratio)
        sampling, length_limit = self._answer_length(query, plan.prompt_tokens)
        return dataclasses.replace(plan, sampling=sampling, length_limit=length_limit)

    def _system_path(self, query: Query, c: Collection) -> tuple[SystemPromptPath, PromptFormat]:
        """How the query's system message is served (`--system-prompt-policy`), and the prompt
        layout it is served in: the engine's, or one with the request's own system prompt."""
        system = query.system_prompt
        if system is None or system.strip() == c.system_prompt.strip() or not system.strip():
            return SystemPromptPath.INDEXED, self.engine.prompt
        if self._system_policy != "prefix":  # strict refused it already (`_retrieve`)
            return SystemPromptPath.SUFFIX, self.engine.prompt
        return SystemPromptPath.PREFIX, self._format(system)

    def _sources(self, query: Query, found: Retrieved, plan: PromptPlan, tree: TreeSpot | None
                 ) -> tuple[Mode, TreeSpot | None, tuple[PromptChunk, ...], float]:
        """Stage 4: the mode the request runs in, its place in the tree, each chunk's KV source
        and how long its reads may take. Unless the tree holds the context, the loading
        controller decides per chunk (read or compute), or full prefill of the whole prompt when
        that is sooner (a slow tier on a fast engine): then under full prefill's tree key."""
        mode, decisions = query.mode, None
        held = tree is not None and tree.lease is not None
        if self.engine.reads_chunk_kv(mode) and not held:
            decisions = self._decide(found.collection, plan, tree)
            if self.controller.prefers_full(decisions, mode, plan.prompt_tokens, found.collection.store.prefetch_workers,
                                            self._kv_layered):
                mode, tree = Mode.FULL, self._spot(query, found, plan, query.conversation, None, Mode.FULL)
                held = tree is not None and tree.lease is not None
                decisions = None if held else decisions
        chunks, kv_wait_s = self._chunk_sources(mode, found.collection, plan, decisions, held,
                                                None if tree is None else tree.turns)
        return mode, tree, chunks, kv_wait_s

    def _decide(self, c: Collection, plan: PromptPlan, tree: TreeSpot | None) -> list[ChunkDecision]:
        """The loading controller's choice for each retrieved chunk (not carried turns): read or compute."""
        turns = None if tree is None else tree.turns
        n = len(plan.token_ids) - (turns is not None and turns.kv is not None)  # retrieved chunks
        return self.controller.decide(c.store, plan.kv_keys[:n], [len(ids) for ids in plan.token_ids[:n]])

    def _chunk_sources(self, mode: Mode, c: Collection, plan: PromptPlan, decisions: Sequence[ChunkDecision] | None,
                       held: bool, turns: CarriedTurns | None = None) -> tuple[tuple[PromptChunk, ...], float]:
        """Each chunk's KV source, its read started the moment the ids are known (the
        loading controller's `decisions`), and how long the reads may take; none when the mode
        reads no chunk KV or the tree `held` the context (a mode changed to full by the controller
        marks its chunks cheaper computed). Carried `turns` (the last chunk) come with their KV,
        read from the tree."""
        if not self.engine.reads_chunk_kv(mode) or held or decisions is None:
            source = KVSource.COMPUTED_CHEAPER if decisions is not None else KVSource.COMPUTED_MISSING
            return tuple(PromptChunk(ids, source=source, key=key)
                         for ids, key in zip(plan.token_ids, plan.kv_keys)), _KV_WAIT_LIMIT
        n = len(decisions)
        reads = iter(c.store.prefetch([k for k, d in zip(plan.kv_keys, decisions) if d.load], layered=self._kv_layered))
        recipes = (*plan.recipes, *[None] * (n - len(plan.recipes)))
        lm = self.lm
        chunks = tuple(PromptChunk(ids, self._loaded(next(reads)) if d.load else None, d.source, key, d.load_s,
                                   self._context(c, recipe),
                                   _stored_as(c.compression(key, ids, lm.fingerprint, lm.tokenizer_fingerprint)))
                       for ids, key, d, recipe in zip(plan.token_ids, plan.kv_keys, decisions, recipes))
        if n < len(plan.token_ids) and turns is not None and turns.kv is not None:
            chunks += (PromptChunk(turns.ids, LoadedKV(turns.kv, Tier.TREE, turns.kv.nbytes), KVSource.LOADED,
                                   turns.key),)
        return chunks, self.controller.wait_limit(decisions, _KV_WAIT_LIMIT, c.store.prefetch_workers)

    def _context(self, c: Collection, recipe: NeighbourRecipe | None) -> ChunkContextKV | None:
        """A chunk's context as the engine computes it when its KV must be computed: the context's
        tokens, or the neighbours' plain KV, each read (whole) only if the engine asks."""
        if recipe is None:
            return None
        if recipe.options.context is not NeighbourContext.KV:
            return ChunkContextKV(recipe.context.token_ids, key_context=recipe.context)
        lm = self.lm

        def read(ids: tuple[int, ...]) -> Future[LoadedKV | None]:
            key = ChunkKey.from_prefix_hash(lm.fingerprint, lm.tokenizer_fingerprint, c.prefix_hash, ids)
            return self._loaded(c.store.prefetch([key], layered=False)[0])

        return ChunkContextKV(plain=tuple((ids, functools.partial(read, ids)) for ids in recipe.neighbours),
                              budget_tokens=recipe.options.budget_tokens, key_context=recipe.context,
                              stored=_stored_as(c.plain_copy_compression))

    def _loaded(self, handle: PrefetchHandle) -> Future[LoadedKV | None]:
        """A read in flight as the engine takes it: the KV on the engine's device, converted on
        the store's thread the moment the read lands (layers may still be arriving)."""
        lm, out = self.lm, Future()

        def landed(read: Future) -> None:
            try:
                hit = read.result()
                out.set_result(None if hit is None else LoadedKV(
                    ChunkKV.from_stored(hit.entry, lm.device, lm.dtype, hit.layers), hit.tier, hit.entry.nbytes))
            except Exception as exc:  # the engine computes the chunk, and logs why
                out.set_exception(exc)

        handle.future.add_done_callback(landed)
        return out

    def work(self, request: Request) -> Work:
        """The prepared request's work, run by the scheduler (`Engine.work`)."""
        return self.engine.work(request)

    def detokenizer(self, request: Request) -> Detokenizer:
        """The answer's text from its token ids, for the consumer: a stop string found there
        stops the decode (`Request.stop_after`)."""
        return Detokenizer(self.lm.tokenizer, request.sampling.stop, request.stop_after)

    def keep(self, collection: str, request: Request, computed: ChunkComputed) -> None:
        """Store a chunk KV the answer computed, on the writer thread (memory tiers first, then
        the durable ones); the answer does not depend on it."""
        chunk = request.chunks[computed.index]
        if isinstance(chunk.key, ChunkKey):
            context = chunk.context.key_context if chunk.context is not None else None
            self._writer.submit(self._persist, self._collection(collection), chunk.key, computed.kv,
                                context if isinstance(context, ChunkContext) else None, computed.served)

    def _question_ids(self, params: Query, output: OutputSpec, fmt: PromptFormat, instructions: str = ""
                      ) -> tuple[list[int], list[int] | None]:
        """The question segment's tokens, and the tokens that choose chunk tokens and chunks
        (None: the same): the conversation's question, its earlier turns and the question,
        without the answer's instructions (tools, format) or the agent's turns since the
        question. So every call of a tool loop chooses as its first did, whatever its
        tool_choice, and the KV tree's context of the first call is exactly the later calls'.
        `fmt`: the prompt's layout (the request's own system prompt's, or the engine's);
        `instructions`: the request's own system prompt when it goes after the chunks (suffix),
        opening the question's turn."""
        history = [(t.role.value, turn_text(t)) for t in params.history]
        agent = [(t.role.value, turn_text(t)) for t in params.agent_turns]
        before = instructions + output.before
        # a conversation in the chat template's own turns; a single question, or a tokenizer
        # without a template, as one segment of text
        question_ids = fmt.turn_ids(params.question, history, before, agent)
        if question_ids is None:
            question_ids = fmt.question_ids(params.question, history, before, output.after)
        if not output.before and not output.after:
            return question_ids, None
        return question_ids, (fmt.turn_ids(params.question, history, instructions)
                              or fmt.question_ids(params.question, history, instructions))

    def _answer_length(self, params: Query, prompt_tokens: int) -> tuple[SamplingParams, LengthLimit]:
        """The answer's length bound and what sets it. A client's max_tokens must fit the model's
        context with the prompt (refused otherwise, as OpenAI's API does); without one, the
        answer runs until the model stops, at most the server's default or cap and the context left.

        Raises:
            InvalidArgumentError: The prompt with the client's max_tokens, or the prompt alone, does
                not fit the model's context (naming the tokens and the limit).
        """
        limit, max_new, bound = self.lm.context_length, params.sampling.max_new_tokens, params.length_limit
        if limit is None or prompt_tokens + max_new <= limit:
            return params.sampling, bound
        field_ = "history" if params.history or params.agent_turns else "question"
        if bound is not LengthLimit.MAX_TOKENS and prompt_tokens < limit:
            return dataclasses.replace(params.sampling, max_new_tokens=limit - prompt_tokens), LengthLimit.CONTEXT
        if bound is not LengthLimit.MAX_TOKENS:
            raise InvalidArgumentError(
                field_, f"the prompt is {prompt_tokens} tokens, which leaves no room for an answer in the model's "
                        f"context of {limit}; send fewer or shorter turns, or fewer chunks (top_k)")
        raise InvalidArgumentError(
            field_, f"the prompt is {prompt_tokens} tokens and the answer may take {max_new} "
                    f"(max_tokens): {prompt_tokens + max_new} tokens, more than the model's context "
                    f"of {limit}; send fewer or shorter turns, fewer chunks (top_k), or a smaller max_tokens")

    def _ratio(self, query: Query, c: Collection, own_instructions: bool) -> RequestRatio:
        """The ratio this request's blend runs at: its own, or its fidelity target's (full prefill when
        none meets it), or the server's for its own instructions in front, or the collection's
        (`server/fidelity.py`); with the KL the collection's calibration predicts for it."""
        ratio = query.recompute_ratio if query.recompute_ratio_set else None
        if ratio is None and own_instructions:
            ratio = self._system_ratio
        return request_ratio(c.name, c.calibration, c.served, ratio=ratio, fidelity_kl=query.fidelity_kl,
                             calibrated_path=not own_instructions)  # it measured the chunks after the index's prefix

    def _options(self, ratio: float) -> BlendOptions:
        """How a request's mode blends at `ratio`, with the server's focus and guard settings."""
        guard = {} if self._guard_mass is None else {  # exactly the ratio's tokens, or full prefill
            "adaptive_mass": self._guard_mass, "min_ratio": ratio, "fallback_full": True}
        return BlendOptions(recompute_ratio=ratio, focus=self._focus, **guard)

    def _persist(self, c: Collection, key: ChunkKey, kv: ChunkKV, context: ChunkContext | None = None,
                 served: ChunkKV | None = None) -> None:
        """Keep a chunk's computed KV: in memory as the answer used it (`served`: as its durable
        copy will read), in the durable tiers as computed, encoded as the index encodes that
        file (`Collection.compression`), so the file is the one the indexer wrote."""
        lm = self.lm
        compression = c.compression(key, kv.token_ids.tolist(), lm.fingerprint, lm.tokenizer_fingerprint)
        try:
            ctx = None if context is None else context.hash()
            of = functools.partial(KVEntry.of, key=key, model_fp=lm.fingerprint, tokenizer_fp=lm.tokenizer_fingerprint,
                                   prefix_hash=c.prefix_hash, context_hash=ctx)
            entry, held = of(kv), of(served if served is not None else kv)
        except ValueError:  # the key names neighbour KV the index records no neighbours for: the
            return  # plain KV computed here serves this request but is not that entry
        c.store.put(held, durable=False)  # the next request finds it in memory
        try:
            c.store.put(entry, memory=False, compression=compression)
        except StoreError as exc:
            log.warning("writing back computed KV of %s failed: %s", entry.key, exc)

    def stores(self) -> list[TieredStore]:
        """Each collection's KV store (a cluster replica attaches its peer tier to them)."""
        return [c.store for c in self._collections.values()]

    def held_keys(self) -> dict[Tier, set[str]]:
        """The chunk keys (hex) this host's tiers hold, over every collection (the cluster's
        routing summary); the shared S3 tier is left out."""
        held: dict[Tier, set[str]] = {}
        for c in self._collections.values():
            for tier, keys in c.store.held_keys().items():
                held.setdefault(tier, set()).update(k.hex for k in keys)
        return held

    def read_speeds(self) -> dict[Tier, tuple[float, float]]:
        """Each tier's measured read speed, (latency s, seconds per token) as stored, over every
        collection (the first measured of each tier): the router prices a chunk's load in them."""
        speeds: dict[Tier, tuple[float, float]] = {}
        for c in self._collections.values():
            for tier in Tier:
                est = c.store.read_estimate(tier)
                if est is not None and tier not in speeds:
                    speeds[tier] = (est.latency_s, est.seconds(1) - est.latency_s)
        return speeds

    def peer_counters(self) -> dict[str, float]:
        """The peer tier's counters over every collection (`ragkv serve --replicas`; {} without one):
        reads (hits), their bytes and seconds, misses, errors, refused copies, bytes published now;
        and the host memory chunk KV takes: the host tier's bytes, and how many of them are its
        published copies' (`MemoryTier.share`: held once, not twice)."""
        tiers = [t for c in self._collections.values() for t in c.store.tiers if isinstance(t, PeerTier)]
        if not tiers:
            return {}
        hosts = [t for c in self._collections.values() for t in c.store.tiers
                 if isinstance(t, MemoryTier) and t.tier is Tier.CPU]
        peers, pending = [t.stats() for t in tiers], sum(t.pending_publishes for t in tiers)
        return {"peer_reads": sum(t.hits for t in peers), "peer_read_bytes": sum(t.bytes_read for t in peers),
                "peer_read_seconds": sum(t.get_seconds for t in peers), "peer_misses": sum(t.misses for t in peers),
                "peer_errors": sum(t.errors for t in peers), "peer_rejected": sum(t.rejected for t in peers),
                "peer_published_bytes": sum(t.bytes_used for t in peers), "peer_publishes_pending": pending,
                "host_tier_bytes": sum(t.stats().bytes_used for t in hosts),
                "host_tier_shared_bytes": sum(t.shared_bytes for t in hosts)}

    def flush_writes(self, timeout: float | None = None) -> None:
        """Wait until every write-back submitted so far has reached its durable tiers (or failed)."""
        self._writer.submit(lambda: None).result(timeout)

    def tier_errors(self) -> dict[tuple[str, Tier], int]:
        """I/O failures per (collection, tier) so far (ServerMetrics.watch_tier_errors)."""
        return {(c.name, t.tier): t.errors for c in self._collections.values()
                for t in c.store.stats().tiers}

    def close(self) -> None:
        """Finish the write-backs, then release every store and index."""
        self._writer.shutdown(wait=True)
        self._warmer.shutdown(wait=True)
        for c in self._collections.values():
            c.store.close()
            c.retriever.close()
