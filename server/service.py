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
from ragkv.server.admission import Admission
from ragkv.server.answering import Answerer, ChunksEvent, TokenEvent
from ragkv.server.api_keys import ANONYMOUS, Caller, KeyRing, PermissionDeniedError, PromptBill, RateLimitedError
from ragkv.server.backend import Catalogue
from ragkv.server.metrics import ServerMetrics
from ragkv.server.status import NotServingError, status_for
from ragkv.server.validation import RequestLimits, validate_query, validate_retrieve
from ragkv.types import RetrieveResult, ToolCallDelta
from ragkv.v1 import ragkv_pb2 as pb
from ragkv.v1 import ragkv_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class RagService(pb_grpc.RagServiceServicer):
    """The ragkv.v1.RagService implementation.

    Args:
        limits: Request bounds and defaults.
        admission: Queue slots and in-flight count.
        metrics: Where to record latencies, tiers and errors.
        retrieve_pool: Runs retrieval and KV prefetch starts.
        runner: Answers a validated Query (`QueryRunner` on this host's scheduler, or the
            cluster's ingress runner that routes it to a replica: `server/cluster.py`).
        keys: Who may call, and what each key may read (server.api_keys); None = open. The
            interceptor refuses a call with no valid key before its body is parsed; here each
            method learns which key called (the cluster's ingress has no interceptor).
    """

    def __init__(
        self,
        *,
        limits: RequestLimits,
        admission: Admission,
        metrics: ServerMetrics,
        retrieve_pool: Executor,
        runner: Answerer,
        keys: KeyRing | None = None,
    ) -> None:
        self._keys = keys or KeyRing()
        self._limits = limits
        self._admission = admission
        self._metrics = metrics
        self._retrieve_pool = retrieve_pool
        self._runner = runner
        self.backend: Catalogue | None = None  # set once indexes and model are loaded

    def _ready_backend(self) -> Catalogue:
        if self.backend is None:
            raise NotServingError("the server is still loading its indexes and model")
        return self.backend

    def _caller(self, context: grpc.aio.ServicerContext, method: str) -> Caller:
        caller = self._keys.authenticate_metadata(context.invocation_metadata())
        self._metrics.key_requests.labels(caller.label, method).inc()
        return caller

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, exc: Exception,
                    caller: Caller = ANONYMOUS) -> None:
        code, message = status_for(exc)
        if isinstance(exc, (PermissionDeniedError, RateLimitedError)):
            self._metrics.key_refusals.labels(caller.label, code.name).inc()
            log.info("%s of key %s refused: %s", method, caller.label, exc)
        self._metrics.errors.labels(method, code.name).inc()
        if method == "Query":
            self._metrics.requests.labels(code.name).inc()
        if code is grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
        await context.abort(code, message)

    async def Query(  # gRPC method name
        self, request: pb.QueryRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.QueryResponse]:
        arrived = time.perf_counter()
        cancel = threading.Event()
        caller = ANONYMOUS
        try:
            caller = self._caller(context, "Query")
            with self._admission.rpc():
                backend = self._ready_backend()
                question, options = convert.query_request_from_proto(request)
                # the salt names the tenant within the key (validate_query checks its length)
                query = validate_query(question, options, self._limits, backend.modes)
                query = self._keys.admit(caller, query, options.cache_salt)
                remaining = context.time_remaining()
                deadline = None if remaining is None else time.monotonic() + remaining
                index = 0
                bill = self._keys.bill(caller)  # its prompt tokens, reserved once known, before they are computed
                async for event in self._runner.run(backend, query, arrived=arrived, cancel=cancel,
                                                    deadline=deadline, reserve=lambda n: self._reserve(bill, n)):
                    if isinstance(event, ChunksEvent):
                        yield convert.chunks_response(event.chunks, options.snippet_chars)
                    elif isinstance(event, TokenEvent):
                        yield convert.token_response(event.text, index)
                        index += 1
                    elif isinstance(event, ToolCallDelta):
                        yield convert.tool_call_response(event)
                    else:
                        self._metrics.key_prompt_tokens.labels(caller.label).inc(bill.settle(event.usage.prompt_tokens))
                        yield convert.stats_response(event)
        except asyncio.CancelledError:
            cancel.set()
            self._metrics.errors.labels("Query", grpc.StatusCode.CANCELLED.name).inc()
            raise
        except Exception as exc:
            cancel.set()
            await self._fail(context, "Query", exc, caller)
        finally:
            cancel.set()

    def _reserve(self, bill: PromptBill, prompt_tokens: int) -> None:
        bill.reserve(prompt_tokens)
        self._metrics.key_prompt_tokens.labels(bill.caller.label).inc(prompt_tokens)

    async def Retrieve(
        self, request: pb.RetrieveRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetrieveResponse:
        arrived = time.perf_counter()
        caller = ANONYMOUS
        try:
            caller = self._caller(context, "Retrieve")
            with self._admission.rpc():
                backend = self._ready_backend()
                question, options = convert.retrieve_request_from_proto(request)
                question, collection, top_k, search_mode, filters = validate_retrieve(question, options, self._limits)
                self._keys.admit_query(caller, collection)
                loop = asyncio.get_running_loop()
                chunks = await loop.run_in_executor(
                    self._retrieve_pool, backend.retrieve, collection, question, top_k, search_mode, filters
                )
                elapsed = time.perf_counter() - arrived
                self._metrics.e2e.labels("Retrieve").observe(elapsed)
                return convert.retrieve_result_to_proto(RetrieveResult(chunks, elapsed), options.snippet_chars)
        except Exception as exc:
            await self._fail(context, "Retrieve", exc, caller)
            raise AssertionError("unreachable: abort raises") from exc

    async def ListCollections(
        self, request: pb.ListCollectionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListCollectionsResponse:
        try:
            caller = self._caller(context, "ListCollections")
            with self._admission.rpc():
                infos = [c for c in self._ready_backend().collections() if caller.may_read(c.name)]
                return pb.ListCollectionsResponse(collections=[convert.collection_to_proto(c) for c in infos])
        except Exception as exc:
            await self._fail(context, "ListCollections", exc)
            raise AssertionError("unreachable: abort raises") from exc

    async def GetCollectionStats(
        self, request: pb.GetCollectionStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCollectionStatsResponse:
        caller = ANONYMOUS
        try:
            caller = self._caller(context, "GetCollectionStats")
            name = request.name or "default"
            caller.check_collection(name)  # before the lookup: a key learns nothing of collections it may not read
            with self._admission.rpc():
                backend = self._ready_backend()
                loop = asyncio.get_running_loop()
                stats = await loop.run_in_executor(self._retrieve_pool, backend.collection_stats, name)
                return convert.collection_stats_to_proto(stats)
        except Exception as exc:
            await self._fail(context, "GetCollectionStats", exc, caller)
            raise AssertionError("unreachable: abort raises") from exc
