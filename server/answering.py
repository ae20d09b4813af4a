"""QueryRunner: drives one validated Query from admission to its final stats, for every API.

The gRPC service (server/service.py) and the OpenAI-compatible HTTP API
(server/openai_api.py) both answer through `QueryRunner.run`: take a queue slot,
`backend.prepare` on the retrieval pool, `scheduler.submit(backend.answer(...))`, then
relay the answer's events from the scheduler thread to the event loop, where the
answer's token ids become text (`engine.detokenize`: incremental, stop strings applied, a
found stop string stops the decode). Each API only
turns the events into its own wire format. This module knows nothing of gRPC status
codes or HTTP; it records metrics and raises the backend's exceptions as they are.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor

from ragkv.engine.scheduler import END, Scheduler, Started
from ragkv.server.admission import Admission
from ragkv.server.backend import AnswerText, ChunksEvent, DoneEvent, QueryBackend, QueryParams, TokenEvent, TokenIdEvent
from ragkv.server.metrics import ServerMetrics
from ragkv.server.structured import ToolCallReader, find_citations
from ragkv.types import FinishReason, QueryStats, RetrievedChunk, ToolCallDelta, Usage

RunEvent = ChunksEvent | TokenEvent | ToolCallDelta | QueryStats


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
        backend: QueryBackend,
        params: QueryParams,
        *,
        arrived: float,
        cancel: threading.Event,
        deadline: float | None = None,
        method: str = "Query",
    ) -> AsyncIterator[RunEvent]:
        """Answer one Query: yields one ChunksEvent, TokenEvents, then the QueryStats.

        An answer that calls tools yields ToolCallDeltas instead of TokenEvents (read from the
        model's text here, off the scheduler thread); its stats carry the parsed calls.

        Args:
            backend: The loaded backend.
            params: The validated request.
            arrived: `time.perf_counter()` when the request arrived (TTFT counts from it).
            cancel: Set by the caller when the client leaves; set here on any exit.
            deadline: `time.monotonic()` by which the answer must end; None = no deadline.
            method: The `method` label of the end-to-end latency histogram.

        Raises:
            OverloadedError: The queue is full. Anything `prepare`, the scheduler or
            `answer` raise, unchanged; TimeoutError when the deadline cut the answer short.
        """
        loop = asyncio.get_running_loop()
        try:
            with self._admission.query_slot():
                prepared = await loop.run_in_executor(self._retrieve_pool, backend.prepare, params)
                prepared_at = time.perf_counter()
                events: asyncio.Queue[object] = asyncio.Queue()

                def emit(event: object) -> None:
                    try:
                        loop.call_soon_threadsafe(events.put_nowait, event)
                    except RuntimeError:  # the loop closed under us: nobody is listening
                        cancel.set()

                self._scheduler.submit(backend.answer(prepared, cancel), emit, cancel, deadline, prepared.kv_bytes,
                                       prepared.prompt_cost)
                phases = dict(prepared.phase_seconds)
                chunks: tuple[RetrievedChunk, ...] | None = None
                pieces: list[str] = []
                reader = ToolCallReader() if prepared.reads_tool_calls else None
                first_token_at: float | None = None
                answer: AnswerText | None = None  # the detokenizer of an answer that streams token ids
                done: DoneEvent | None = None

                def read(piece: str) -> list[str | ToolCallDelta]:  # a piece of text -> what it makes
                    return [] if not piece else [piece] if reader is None else reader.feed(piece)

                while (event := await events.get()) is not END:
                    text: list[str | ToolCallDelta] = []  # what the answer's text makes: pieces, tool-call deltas
                    if isinstance(event, Exception):
                        raise event
                    if isinstance(event, Started):
                        phases["queue"] = event.at - prepared_at
                    elif isinstance(event, ChunksEvent):
                        chunks = event.chunks
                        self._metrics.observe_chunks(chunks, params.collection)
                        yield event
                    elif isinstance(event, (TokenEvent, TokenIdEvent)):
                        if chunks is None:
                            raise RuntimeError("backend yielded a token before the chunks: a backend bug")
                        if first_token_at is None:
                            first_token_at = time.perf_counter()
                        if isinstance(event, TokenIdEvent):  # detokenized here, off the scheduler thread
                            answer = event.text
                            piece = answer.push(event.token_id)  # a stop string stops the decode from here
                        else:
                            piece = event.text
                        text = read(piece)
                    elif isinstance(event, DoneEvent):
                        done = event
                        # the text the last tokens left pending (a character left open), then the calls'
                        text = read(answer.finish() if answer is not None else "") + (
                            reader.finish() if reader is not None else [])
                    for out in text:
                        if isinstance(out, str):
                            pieces.append(out)
                            yield TokenEvent(out)
                        else:
                            yield out
                if done is None or chunks is None:
                    if cancel.is_set():
                        raise TimeoutError("deadline exceeded while answering")
                    raise RuntimeError("backend ended without chunks or stats: a backend bug")
                finished = time.perf_counter()
                phases.update(done.phase_seconds)
                text = "".join(pieces)
                calls = tuple(reader.calls) if reader is not None else ()
                completion, finish = done.completion_tokens, done.finish_reason
                if answer is not None and answer.stopped:  # the decode may have run past the stop string
                    completion, finish = answer.token_count, FinishReason.STOP
                if calls and finish is FinishReason.STOP:
                    finish = FinishReason.TOOL_CALLS
                stats = QueryStats(
                    usage=Usage(done.prompt_tokens, completion, done.cached_prompt_tokens, done.tree_prompt_tokens),
                    ttft_seconds=(first_token_at or finished) - arrived,
                    total_seconds=finished - arrived,
                    phase_seconds=phases,
                    recompute_fraction=done.recompute_fraction,
                    mode=params.mode,
                    finish_reason=finish,
                    text=text,
                    used_chunk_ids=done.used_chunk_ids or tuple(c.chunk_id for c in chunks),
                    kv_sources=dict(done.kv_sources),
                    tool_calls=calls,
                    citations=find_citations(text, chunks) if params.citations else (),
                )
                self._metrics.observe_answer(
                    params.mode,
                    None if first_token_at is None else first_token_at - arrived,
                    done.recompute_fraction,
                    done.bytes_loaded,
                    params.collection,
                    done.kv_sources,
                    done.fell_back,
                    done.handed_over,
                )
                self._metrics.e2e.labels(method).observe(finished - arrived)
                self._metrics.observe_usage(done.prompt_tokens, done.cached_prompt_tokens, completion,
                                            params.collection)
                self._metrics.requests.labels("OK").inc()
                yield stats
        finally:
            cancel.set()
