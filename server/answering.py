"""QueryRunner: drives one validated Query from admission to its final stats, for every API.

The gRPC service (server/service.py) and the OpenAI-compatible HTTP API
(server/openai_api.py) both answer a `Query` through `QueryRunner.run`: take a queue slot,
`backend.prepare` on the retrieval pool (the query in, the engine's request out),
`scheduler.submit(request, backend.work(request))`,
then relay the request's outputs (`engine.request.Output`) from the scheduler thread to
the event loop. There the token ids become text (`engine.detokenize`: incremental, stop
strings applied; a found stop string stops the request), tool calls are read from it, and
chunk KV the answer computed is handed to the backend to keep. Each API only turns the
events into its own wire format. This module knows nothing of gRPC status codes or HTTP;
it records metrics and raises the backend's exceptions as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ragkv.engine.request import ChunkComputed, ChunksReady, EndReason, Finished, Output, Request, TokenOut
from ragkv.engine.scheduler import Scheduler
from ragkv.server.admission import Admission
from ragkv.server.backend import Catalogue, Prepared, QueryBackend
from ragkv.server.metrics import ServerMetrics
from ragkv.server.query import Query
from ragkv.server.structured import ToolCallReader, find_citations

if TYPE_CHECKING:
    from ragkv.retriever import SearchHit
from ragkv.types import FinishReason, QueryStats, RetrievedChunk, ToolCallDelta, Usage


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One piece of the answer's text, final (no dangling character, no stop string's start)."""

    text: str  # non-empty


@dataclass(frozen=True, slots=True)
class ChunksEvent:
    """The answer's chunks, best first, each with the tier its KV came from (its first event)."""

    chunks: tuple[RetrievedChunk, ...]


RunEvent = ChunksEvent | TokenEvent | ToolCallDelta | QueryStats  # what each API turns into its wire format


class Answerer(Protocol):
    """What the gRPC service and the HTTP API answer a validated Query with: `QueryRunner` on
    this host, or the cluster ingress's `RoutedRunner`, which hands it to a replica
    (`server/cluster.py`)."""

    def run(self, backend: Catalogue, query: Query, *, arrived: float, cancel: threading.Event,
            deadline: float | None = None, method: str = "Query") -> AsyncIterator[RunEvent]: ...


class QueryRunner:
    """Runs Queries over one admission queue, retrieval pool and scheduler.

    Args:
        admission: Queue slots (`query_slot`); the caller holds `admission.rpc()`.
        metrics: Where to record latencies, tiers and token counts.
        retrieve_pool: Runs `backend.prepare`.
        scheduler: Runs every `backend.answer`, batching their decode steps.
    """

    def __init__(self, *, admission: Admission, metrics: ServerMetrics, retrieve_pool: Executor,
                 scheduler: Scheduler) -> None:
        self._admission = admission
        self._metrics = metrics
        self._retrieve_pool = retrieve_pool
        self._scheduler = scheduler

    async def run(
        self,
        backend: Catalogue,
        query: Query,
        *,
        arrived: float,
        cancel: threading.Event,
        deadline: float | None = None,
        method: str = "Query",
        hits: Sequence[SearchHit] | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> AsyncIterator[RunEvent]:
        """Answer one Query: yields one ChunksEvent, TokenEvents, then the QueryStats.

        An answer that calls tools yields ToolCallDeltas instead of TokenEvents (read from the
        model's text here, off the scheduler thread); its stats carry the parsed calls.

        Args:
            backend: The loaded backend: one that answers here (a `QueryBackend`).
            query: The validated query (`validate_query`); its engine request is prepared here.
            arrived: `time.perf_counter()` when the request arrived (TTFT counts from it).
            cancel: Set by the caller when the client leaves; set here on any exit.
            deadline: `time.monotonic()` by which the answer must end; None = no deadline.
            method: The `method` label of the end-to-end latency histogram.
            hits: The request's chunks, when the cluster's ingress retrieved them (the
                replica's backend then does not search again); None = retrieve here.
            reserve: Called with the prompt's tokens once they are known, before any of it is
                computed (its key's per-minute limit: `PromptBill.reserve`); what it raises
                refuses the request.

        Raises:
            OverloadedError: The queue is full. Anything `prepare`, the scheduler or
            the request's work raise, unchanged; TimeoutError when the deadline cut the answer short.
        """
        if not isinstance(backend, QueryBackend):
            raise TypeError(f"QueryRunner answers over a QueryBackend; {type(backend).__name__} only searches: a bug")
        loop = asyncio.get_running_loop()
        try:
            with self._admission.query_slot():
                prepared = await self._prepare(backend, query, hits)
                request: Request = prepared.request
                if reserve is not None:
                    try:
                        reserve(request.prompt_tokens)
                    except BaseException:
                        request.let_go()  # its leases go with it
                        raise
                request.cancel, request.deadline = cancel, deadline
                prepared_at = time.perf_counter()
                outputs: asyncio.Queue[Output] = asyncio.Queue()

                def sink(out: Output) -> None:  # on the scheduler thread
                    try:
                        loop.call_soon_threadsafe(outputs.put_nowait, out)
                    except RuntimeError:  # the loop closed under us: nobody is listening
                        cancel.set()

                self._scheduler.submit(request, backend.work(request), sink)
                phases = dict(request.phase_seconds)
                chunks: tuple[RetrievedChunk, ...] | None = None
                pieces: list[str] = []
                reader = ToolCallReader() if request.reads_tool_calls else None
                answer = backend.detokenizer(request)  # a stop string found here stops the request
                first_token_at: float | None = None

                def read(piece: str) -> list[str | ToolCallDelta]:  # a piece of text -> what it makes
                    return [] if not piece else [piece] if reader is None else reader.feed(piece)

                while not isinstance(out := await outputs.get(), Finished):
                    text: list[str | ToolCallDelta] = []  # what the answer's text makes: pieces, tool-call deltas
                    match out:
                        case ChunksReady(tiers):
                            chunks = tuple(dataclasses.replace(c, kv_tier=t) for c, t in zip(prepared.chunks, tiers))
                            self._metrics.observe_chunks(chunks, query.collection)
                            yield ChunksEvent(chunks)
                        case ChunkComputed():
                            backend.keep(query.collection, request, out)
                        case TokenOut(token_id):
                            if chunks is None:
                                raise RuntimeError("a token came before the chunks: a bug in the request's work")
                            if first_token_at is None:
                                first_token_at = time.perf_counter()
                            text = read(answer.push(token_id))
                    for piece in text:
                        if isinstance(piece, str):
                            pieces.append(piece)
                            yield TokenEvent(piece)
                        else:
                            yield piece
                if out.error is not None:
                    raise out.error
                done = out.answered
                if request.started_at is not None:
                    phases["queue"] = request.started_at - prepared_at
                if done is not None:  # the text the last tokens left pending (a character left open), then the calls'
                    for piece in read(answer.finish()) + (reader.finish() if reader is not None else []):
                        if isinstance(piece, str):
                            pieces.append(piece)
                            yield TokenEvent(piece)
                        else:
                            yield piece
                if done is None or chunks is None:
                    if out.reason in (EndReason.DEADLINE, EndReason.CANCELLED) or cancel.is_set():
                        raise TimeoutError("deadline exceeded while answering")
                    raise RuntimeError(f"the request ended {out.reason.value} without chunks or counts: a bug")
                finished = time.perf_counter()
                phases.update(done.phase_seconds)
                text = "".join(pieces)
                used = range(len(chunks)) if done.used_chunks is None else done.used_chunks
                calls = tuple(reader.calls) if reader is not None else ()
                completion, finish = done.completion_tokens, done.finish_reason
                if answer.stopped:  # the decode may have run past the stop string
                    completion, finish = answer.token_count, FinishReason.STOP
                if calls and finish is FinishReason.STOP:
                    finish = FinishReason.TOOL_CALLS
                stats = QueryStats(
                    usage=Usage(done.prompt_tokens, completion, done.cached_prompt_tokens, done.tree_prompt_tokens),
                    ttft_seconds=(first_token_at or finished) - arrived,
                    total_seconds=finished - arrived,
                    phase_seconds=phases,
                    recompute_fraction=done.recompute_fraction,
                    mode=request.mode,
                    finish_reason=finish,
                    text=text,
                    used_chunk_ids=tuple(chunks[i].chunk_id for i in used if i < len(chunks)),
                    kv_sources=dict(done.kv_sources),
                    tool_calls=calls,
                    citations=find_citations(text, chunks) if query.citations else (),
                    focus=done.focus,
                    system_prompt=prepared.system_prompt,
                    length_limit=prepared.length_limit if finish is FinishReason.LENGTH else None,
                    recompute_ratio=prepared.ratio.ratio, predicted_kl=prepared.ratio.predicted_kl,
                )
                self._metrics.observe_answer(
                    request.mode,
                    None if first_token_at is None else first_token_at - arrived,
                    done.recompute_fraction,
                    done.bytes_loaded,
                    query.collection,
                    done.kv_sources,
                    done.fell_back,
                    done.handed_over,
                    done.focus,
                )
                self._metrics.e2e.labels(method).observe(finished - arrived)
                self._metrics.observe_usage(done.prompt_tokens, done.cached_prompt_tokens, completion,
                                            query.collection)
                self._metrics.requests.labels("OK").inc()
                yield stats
        finally:
            cancel.set()

    async def _prepare(self, backend: QueryBackend, query: Query, hits: Sequence[SearchHit] | None) -> Prepared:
        """`backend.prepare` on the retrieval pool. A caller that leaves meanwhile (its task
        cancelled) cannot stop a preparation already running, and the request it makes holds KV tree
        leases from the start: they go when it lands (`Request.let_go`), not when the collector
        finds the request; one not started yet never runs."""
        job = self._retrieve_pool.submit(backend.prepare, query, hits)
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            if not job.cancel():
                job.add_done_callback(_let_go_prepared)
            raise


def _let_go_prepared(job: Future[Prepared]) -> None:
    """A preparation whose caller left: the request it made lets its leases go (any thread)."""
    if not job.cancelled() and job.exception() is None:
        job.result().request.let_go()


async def answer_events(runner: Answerer, backend: Catalogue, query: Query, admission: Admission, *,
                        arrived: float, cancel: threading.Event, method: str,
                        on_stats: Callable[[QueryStats], None],
                        reserve: Callable[[int], None] | None = None) -> AsyncIterator[RunEvent]:
    """`runner.run`'s events for `query`, as one RPC of `admission` (a drain waits for it);
    `reserve` sees the prompt's tokens before they are computed, and `on_stats` the final stats
    before they go on (the HTTP API reserves and settles the key's prompt tokens there)."""
    with admission.rpc():
        async for event in runner.run(backend, query, arrived=arrived, cancel=cancel, method=method, reserve=reserve):
            if isinstance(event, QueryStats):
                on_stats(event)
            yield event


async def begin(events: AsyncIterator[RunEvent]) -> ChunksEvent:
    """Run an answer's events to their first, the chunks (retrieval and KV loads done, so their
    errors still map to a status before any byte is sent); the events are closed when that fails."""
    try:
        first = await anext(events)
        if not isinstance(first, ChunksEvent):
            raise RuntimeError(f"the answer began with {type(first).__name__}, not the chunks: a bug")
        return first
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
