"""RagService: the grpc.aio servicer. Validation, queueing, streaming, cancellation.

Model work never runs on the event loop: `prepare` (retrieval, KV prefetch start)
runs on the retrieval pool and `answer` on the engine's scheduler thread, which runs
many answers at once (their decode steps batched) and hands events back through
`loop.call_soon_threadsafe`. The loop stays free to answer health checks, reject bad
or excess requests, and notice cancelled clients; a cancelled or timed-out request
sets its cancel flag, and the scheduler drops it (and frees its cache) at its next
iteration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import grpc
import grpc.aio

from ragkv import convert
from ragkv.types import QueryStats, RetrievedChunk, RetrieveResult, Usage
from ragkv.v1 import ragkv_pb2 as pb
from ragkv.v1 import ragkv_pb2_grpc as pb_grpc
from ragkv.engine.scheduler import END, Scheduler, Started
from ragkv.server.admission import Admission
from ragkv.server.backend import ChunksEvent, DoneEvent, PreparedQuery, QueryBackend, TokenEvent
from ragkv.server.metrics import ServerMetrics
from ragkv.server.status import NotServingError, status_for
from ragkv.server.validation import RequestLimits, validate_query, validate_retrieve

log = logging.getLogger(__name__)


class RagService(pb_grpc.RagServiceServicer):
    """The ragkv.v1.RagService implementation.

    Args:
        limits: Request bounds and defaults.
        admission: Queue slots and in-flight count.
        metrics: Where to record latencies, tiers and errors.
        retrieve_pool: Runs retrieval and KV prefetch starts.
        scheduler: Runs every `answer`, batching their decode steps (engine.scheduler).
    """

    def __init__(
        self,
        *,
        limits: RequestLimits,
        admission: Admission,
        metrics: ServerMetrics,
        retrieve_pool: Executor,
        scheduler: Scheduler,
    ) -> None:
        self._limits = limits
        self._admission = admission
        self._metrics = metrics
        self._retrieve_pool = retrieve_pool
        self._scheduler = scheduler
        self.backend: QueryBackend | None = None  # set once indexes and model are loaded

    def _ready_backend(self) -> QueryBackend:
        if self.backend is None:
            raise NotServingError("the server is still loading its indexes and model")
        return self.backend

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
        code, message = status_for(exc)
        self._metrics.errors.labels(method, code.name).inc()
        if method == "Query":
            self._metrics.requests.labels(code.name).inc()
        if code is grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
        await context.abort(code, message)

    async def Query(  # noqa: N802 - gRPC method name
        self, request: pb.QueryRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.QueryResponse]:
        arrived = time.perf_counter()
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        try:
            with self._admission.rpc():
                backend = self._ready_backend()
                question, options = convert.query_request_from_proto(request)
                params = validate_query(question, options, self._limits, backend.modes)
                with self._admission.query_slot():
                    prepared = await loop.run_in_executor(self._retrieve_pool, backend.prepare, params)
                    prepared_at = time.perf_counter()
                    events: asyncio.Queue[object] = asyncio.Queue()

                    def emit(event: object) -> None:
                        try:
                            loop.call_soon_threadsafe(events.put_nowait, event)
                        except RuntimeError:  # the loop closed under us: nobody is listening
                            cancel.set()

                    remaining = context.time_remaining()
                    deadline = None if remaining is None else time.monotonic() + remaining
                    self._scheduler.submit(backend.answer(prepared, cancel), emit, cancel, deadline, prepared.kv_bytes)
                    phases = dict(prepared.phase_seconds)
                    chunks: tuple[RetrievedChunk, ...] | None = None
                    pieces: list[str] = []
                    first_token_at: float | None = None
                    done: DoneEvent | None = None
                    while (event := await events.get()) is not END:
                        if isinstance(event, Exception):
                            raise event
                        if isinstance(event, Started):
                            phases["queue"] = event.at - prepared_at
                        elif isinstance(event, ChunksEvent):
                            chunks = event.chunks
                            self._metrics.observe_chunks(chunks)
                            yield convert.chunks_response(chunks, options.snippet_chars)
                        elif isinstance(event, TokenEvent):
                            if chunks is None:
                                raise RuntimeError("backend yielded a token before the chunks: a backend bug")
                            if first_token_at is None:
                                first_token_at = time.perf_counter()
                            yield convert.token_response(event.text, len(pieces))
                            pieces.append(event.text)
                        elif isinstance(event, DoneEvent):
                            done = event
                    if done is None or chunks is None:
                        if cancel.is_set():
                            raise TimeoutError("deadline exceeded while answering")
                        raise RuntimeError("backend ended without chunks or stats: a backend bug")
                    finished = time.perf_counter()
                    phases.update(done.phase_seconds)
                    stats = QueryStats(
                        usage=Usage(done.prompt_tokens, done.completion_tokens, done.cached_prompt_tokens),
                        ttft_seconds=(first_token_at or finished) - arrived,
                        total_seconds=finished - arrived,
                        phase_seconds=phases,
                        recompute_fraction=done.recompute_fraction,
                        mode=params.mode,
                        finish_reason=done.finish_reason,
                        text="".join(pieces),
                        used_chunk_ids=done.used_chunk_ids or tuple(c.chunk_id for c in chunks),
                    )
                    self._metrics.observe_answer(
                        params.mode,
                        None if first_token_at is None else first_token_at - arrived,
                        done.recompute_fraction,
                        done.bytes_loaded,
                    )
                    self._metrics.e2e.labels("Query").observe(finished - arrived)
                    self._metrics.observe_usage(done.prompt_tokens, done.cached_prompt_tokens, done.completion_tokens)
                    self._metrics.requests.labels(grpc.StatusCode.OK.name).inc()
                    yield convert.stats_response(stats)
        except asyncio.CancelledError:
            cancel.set()
            self._metrics.errors.labels("Query", grpc.StatusCode.CANCELLED.name).inc()
            raise
        except Exception as exc:
            cancel.set()
            await self._fail(context, "Query", exc)
        finally:
            cancel.set()

    async def Retrieve(  # noqa: N802
        self, request: pb.RetrieveRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetrieveResponse:
        arrived = time.perf_counter()
        try:
            with self._admission.rpc():
                backend = self._ready_backend()
                question, options = convert.retrieve_request_from_proto(request)
                question, collection, top_k = validate_retrieve(question, options, self._limits)
                loop = asyncio.get_running_loop()
                chunks = await loop.run_in_executor(
                    self._retrieve_pool, backend.retrieve, collection, question, top_k
                )
                elapsed = time.perf_counter() - arrived
                self._metrics.e2e.labels("Retrieve").observe(elapsed)
                return convert.retrieve_result_to_proto(RetrieveResult(chunks, elapsed), options.snippet_chars)
        except Exception as exc:
            await self._fail(context, "Retrieve", exc)
            raise AssertionError("unreachable: abort raises") from exc

    async def ListCollections(  # noqa: N802
        self, request: pb.ListCollectionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListCollectionsResponse:
        try:
            with self._admission.rpc():
                infos = self._ready_backend().collections()
                return pb.ListCollectionsResponse(collections=[convert.collection_to_proto(c) for c in infos])
        except Exception as exc:
            await self._fail(context, "ListCollections", exc)
            raise AssertionError("unreachable: abort raises") from exc

    async def GetCollectionStats(  # noqa: N802
        self, request: pb.GetCollectionStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCollectionStatsResponse:
        try:
            with self._admission.rpc():
                backend = self._ready_backend()
                loop = asyncio.get_running_loop()
                stats = await loop.run_in_executor(
                    self._retrieve_pool, backend.collection_stats, request.name or "default"
                )
                return convert.collection_stats_to_proto(stats)
        except Exception as exc:
            await self._fail(context, "GetCollectionStats", exc)
            raise AssertionError("unreachable: abort raises") from exc
