"""A request the engine owns: what it asks, where it stands, and what comes out of it.

The engine's own type, from preparation to the last token (vLLM v1's `Request` is the model):
1. the server validates what the client asked into a frozen `server.query.Query` (chat
   turns, tools, retrieval options, tenant: none of it the engine's);
2. the server's preparation (`QueryBackend.prepare`) builds the `Request` from it once:
   retrieval, the chunks' KV reads started (`PromptChunk.kv`: a ready KV, a read the
   store's threads complete, or None = compute it), the question's tokens, the tree's
   lease, the budgets;
3. the scheduler (`engine.scheduler`) owns it from `submit` on and advances its work
   (`Engine.work`, `engine.answer`): every status transition is made there;
4. what comes out is one typed stream, `Output`: the chunks with the tier their KV came
   from, each chunk KV computed on the spot (the server keeps it), each token id, and
   `Finished` last, with the answer's counts or the error that ended it.

Text is not the engine's: the consumer detokenizes the token ids off the engine thread,
and when a stop string ends the text it calls `Request.stop_after` (any thread).

Nothing here imports the server, kvstore or gRPC.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Generator, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from ragkv.engine.blend import BlendOptions
from ragkv.engine.constrain import Constraint
from ragkv.engine.decode import DecodeStream, SamplingParams
from ragkv.engine.forward import Step
from ragkv.engine.kv.cache import ChunkKV
from ragkv.engine.kv.conversation import TreeSpot
from ragkv.types import (
    FinishReason,
    FocusSignal,
    KVSource,
    Mode,
    Tier,
)


class RequestStatus(str, enum.Enum):
    """Where a request is in its life; the scheduler makes every transition after NEW."""

    NEW = "new"  # validated; the server prepares it
    QUEUED = "queued"  # submitted, not run yet
    PROMPT = "prompt"  # its prompt work runs, one layer per step
    WAITING_KV = "waiting_kv"  # parked until its KV reads are done (WaitFor)
    DECODING = "decoding"  # in the batched decode steps
    FINISHED = "finished"  # ended: see Request.end_reason


class EndReason(str, enum.Enum):
    """Why a request is FINISHED."""

    DONE = "done"  # its work ran to the end (the answer's own finish reason says how it ended)
    CANCELLED = "cancelled"  # the client left
    DEADLINE = "deadline"  # its deadline passed
    ERROR = "error"  # its work raised (the error is in Finished)
    STOPPED = "stopped"  # the scheduler closed (the server is stopping)


@dataclass(frozen=True, slots=True)
class LoadedKV:
    """A chunk's KV as its read delivered it (the value of a `PromptChunk.kv` future)."""

    kv: ChunkKV  # on the engine's device, layers still arriving for a layer-wise read (kv.ready)
    tier: Tier  # the tier that served it
    nbytes: int  # bytes read


@dataclass(frozen=True, slots=True)
class ChunkContextKV:
    """What a chunk's stored KV was computed after, between the prefix and its tokens (the index's
    neighbour-conditioned KV, `ragkv index --neighbours`): a chunk whose KV must be computed here
    is computed after the same, so its KV is the one its key names, whether read or computed."""

    # the context's tokens, prefilled before the chunk (the index's NeighbourContext.TOKENS)
    ids: tuple[int, ...] = ()
    # or the neighbours' own plain KV before the chunk, most similar first (NeighbourContext.KV):
    # each neighbour's tokens and a read of its plain KV started on demand (its future's None:
    # missing, then that KV is computed), cut to `budget_tokens` as the indexer cut it
    plain: tuple[tuple[tuple[int, ...], Callable[[], Future[LoadedKV | None]]], ...] = ()
    budget_tokens: int = 0
    key_context: Hashable = None  # what the chunk's key says it was computed after (the server keeps it so)
    # a neighbour's plain KV computed here as its stored copy reads (`PromptChunk.stored`), as the
    # indexer read it back before its neighbour pass; None = files keep it bit-exact
    stored: Callable[[ChunkKV], ChunkKV] | None = None


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """One retrieved chunk of the prompt, and where its KV comes from."""

    token_ids: tuple[int, ...]  # the chunk's tokens
    # its KV: ready; a read in flight that the store's threads complete (None inside: missing
    # from every tier; an exception: the read failed); None: compute it (or the mode reads none)
    kv: LoadedKV | Future[LoadedKV | None] | None = None
    # why it is computed when `kv` is None (the loading controller's choice: missing, or cheaper);
    # a read's own outcome (loaded, failed, overrun) is counted when it lands
    source: KVSource = KVSource.COMPUTED_MISSING
    key: Hashable = None  # its name in the store (`kvstore.ChunkKey`), opaque here: the KV tree's key uses it
    load_s: float | None = None  # the read's estimated seconds (logged when it overruns)
    context: ChunkContextKV | None = None  # computed after a context (neighbour KV); None: after the prefix alone
    # what KV computed here becomes once stored (its file's compression, quantized and back): the
    # answer uses that, so it is the answer the stored copy gives; None = files keep it bit-exact
    stored: Callable[[ChunkKV], ChunkKV] | None = None


@dataclass(eq=False, slots=True)  # identity: a request is itself, whatever its fields
class Request:
    """One query as the engine runs it, from preparation to its last token (see the module docstring)."""

    # -- what it runs as (the server's preparation builds it from the client's query)
    mode: Mode = Mode.FULL
    sampling: SamplingParams = SamplingParams()  # temperature, top_p, seed, max_new_tokens, stop
    deadline: float | None = None  # time.monotonic() by which it must end; None = none
    cancel: threading.Event = field(default_factory=threading.Event)  # set when the client leaves

    # -- what the server prepared (QueryBackend.prepare)
    prefix_ids: tuple[int, ...] = ()  # the prompt's prefix: the system turn and the context's opening
    # the prefix the chunks' KV was computed after (the index's), when the prompt's is another: the
    # request brings its own instructions, its chunks' KV is moved after them and blended, and a
    # chunk computed here is computed after this one (the tiers keep it); None = prefix_ids
    chunk_prefix_ids: tuple[int, ...] | None = None
    # its own instructions' place in its tenant's KV tree (`Conversations.instructions`): their KV
    # read from the lease, or computed and kept there; None = the index's prefix, or no tree
    instructions: TreeSpot | None = None
    chunks: tuple[PromptChunk, ...] = ()  # each retrieved chunk's tokens and KV source
    question_ids: tuple[int, ...] = ()  # the question segment: earlier turns, the question, the agent's turns
    # the tokens that choose chunk tokens and chunks (query selector, focus): the conversation's
    # question without the answer's instructions or the agent's turns; None = question_ids
    select_ids: tuple[int, ...] | None = None
    # a hybrid with a KV tree: the prompt position whose recurrent state the tree keeps (`Prompt.snapshot_at`)
    snapshot_at: int | None = None
    options: BlendOptions = BlendOptions()  # how the mode blends
    constraint: Constraint | None = None  # the grammar the answer follows; None = free text
    reads_tool_calls: bool = False  # the answer may be tool calls (the consumer parses them)
    # its place in the KV tree (`Conversations.lease`): the key its KV goes under after the answer,
    # and the lease on the tree's KV of its first tokens, when the tree holds them; None = no tree
    tree: TreeSpot | None = None
    # the answer may end in tool calls: its tree path is pinned ahead of LRU eviction this many
    # seconds after it (the agent's next call comes back for it; `Conversations.retention`); 0 = not
    tree_retain_s: float = 0.0
    # how much its tree path matters against its tenant's others (-100..100; `engine.kv.retention`)
    tree_priority: int = 0
    kv_wait_s: float = 120.0  # its reads may take this long; then their chunks are computed instead
    kv_bytes: int = 0  # KV cache bytes it holds at most (admission)
    prompt_cost: float = 0.0  # about how much work its prompt pass is (Engine.prompt_cost); 0 = unknown
    prompt_rows: int = 0  # about how many rows its pass's steps compute (Engine.prompt_rows): its progress; 0 = unknown
    phase_seconds: dict[str, float] = field(default_factory=dict)  # seconds per phase so far (retrieve...)

    # -- where it stands (the scheduler's thread writes these, but `stopped_after`)
    status: RequestStatus = RequestStatus.NEW
    end_reason: EndReason | None = None  # set when FINISHED
    submitted_at: float = 0.0  # time.perf_counter() at submit
    started_at: float | None = None  # time.perf_counter() when its work first ran
    prompt_s: float = 0.0  # seconds of prompt work it has had
    chunk_s: float = 0.0  # of prompt_s, seconds computing chunks' KV (engine.answer)
    stopped_after: int | None = None  # the consumer found a stop string after this many tokens

    @property
    def kv_prefix_ids(self) -> tuple[int, ...]:
        """The prefix the chunks' KV was (or is) computed after."""
        return self.prefix_ids if self.chunk_prefix_ids is None else self.chunk_prefix_ids

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens: prefix, chunks and question segment."""
        return len(self.prefix_ids) + sum(len(ch.token_ids) for ch in self.chunks) + len(self.question_ids)

    @property
    def leased_bytes(self) -> int:
        """Device bytes of the KV tree's nodes its leases hold: KV of its own prompt, which its
        `kv_bytes` count already (its run runs on from them, or copies them and lets them go)."""
        return sum(spot.device_bytes for spot in self._spots())

    def let_go(self) -> None:
        """Its KV tree leases go (its path's and its instructions'; idempotent): when its work ends,
        and when it ends before its work ever ran (refused, stopped, cancelled while queued), since
        a work never started runs none of its own cleanup."""
        for spot in self._spots():
            spot.release()

    def _spots(self) -> list[TreeSpot]:
        """Its places in the KV tree: its path's and its instructions' (those it has)."""
        return [spot for spot in (self.tree, self.instructions) if spot is not None]

    def stop_after(self, n_tokens: int) -> None:
        """A stop string ended the answer's text after `n_tokens` tokens (the consumer, any
        thread): the next decode step ends the stream, its tokens past the stop dropped."""
        self.stopped_after = n_tokens


@dataclass(frozen=True, slots=True)
class ChunksReady:
    """Where each of the prompt's chunks has its KV from (first output of an answer): the
    server pairs these with the chunks it retrieved."""

    tiers: tuple[Tier, ...]  # one per Request.chunks, in its order


@dataclass(frozen=True, slots=True)
class ChunkComputed:
    """A chunk's KV the answer computed (missing, cheaper, failed or overrun): the server keeps it."""

    index: int  # into Request.chunks
    kv: ChunkKV  # as computed (what the durable tiers encode)
    served: ChunkKV | None = None  # as the answer used it (`PromptChunk.stored`); None = `kv`


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One generated token id (the consumer detokenizes it)."""

    token_id: int


@dataclass(frozen=True, slots=True)
class Answered:
    """What an answer that ran to its end counted."""

    prompt_tokens: int  # prefix + chunks + question
    cached_prompt_tokens: int  # prompt tokens whose KV came from a cache tier or the KV tree
    completion_tokens: int  # tokens generated (a stop string's cut is the consumer's to apply)
    recompute_fraction: float  # fraction of chunk tokens recomputed, [0, 1]
    finish_reason: FinishReason  # why decoding stopped
    phase_seconds: Mapping[str, float]  # seconds per phase (kv_wait, prompt..., decode)
    bytes_loaded: Mapping[Tier, int] = field(default_factory=dict)  # KV bytes read per tier
    used_chunks: tuple[int, ...] | None = None  # into Request.chunks: those the answer was computed over; None = all
    kv_sources: Mapping[KVSource, int] = field(default_factory=dict)  # chunks by where their KV came from
    fell_back: bool = False  # the quality guard ran the prompt as full prefill
    handed_over: bool = False  # focus found several passages mattering and blended every chunk
    focus: FocusSignal | None = None  # focus: its rule's decision and how sure (QueryStats.focus)
    tree_prompt_tokens: int = 0  # prompt tokens whose KV came from the KV tree (in cached_prompt_tokens too)


@dataclass(frozen=True, slots=True)
class Finished:
    """The last output of every request."""

    reason: EndReason
    answered: Answered | None = None  # DONE: the answer's counts
    error: Exception | None = None  # ERROR, STOPPED: what ended it


Output = ChunksReady | ChunkComputed | TokenOut | Finished


@dataclass(frozen=True, slots=True)
class Decode:
    """Yielded by a request's work once its prompt is ready: decode `stream`, batched with
    the others; the work resumes when the stream ends."""

    stream: DecodeStream  # the request's decode state (cache, sampling, grammar)


# A request's work (`Engine.work`): each `int` is a step of prompt work done, a `WaitFor`
# parks it on its reads, `Decode` hands its stream to the batched decode (whose tokens the
# scheduler sends out), and outputs go to its consumer as they come; it returns the
# answer's counts.
Work = Generator[Step | Decode | ChunksReady | ChunkComputed | TokenOut, None, Answered]
