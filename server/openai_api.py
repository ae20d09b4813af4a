"""The OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/models`, `/health`.

A Starlette app served by uvicorn on the gRPC server's own event loop (server/app.py),
over the same backend, admission queue and scheduler: a chat completion is answered by
`QueryRunner.run` exactly as a gRPC Query is. A chat completion passes each of its rooms
once, in order:

1. the key (`server.auth.KeyAuth`, Starlette's authentication middleware: before the body
   is read), then the body, refused unparsed past `--max-request-bytes`;
2. the body read (`server.openai_request.parse_chat`: types, and what ragkv does not do);
3. validation (`server.validation.validate_query`: bounds and defaults, into a `Query`);
4. the key's rights and limits, and the query's tenant (`KeyRing.admit`);
5. the answer (`server.answering`: its events, begun up to the chunks so that retrieval's
   and the KV loads' errors still map to a status);
6. the reply (`server.openai_reply`: one JSON body or server-sent events, errors as
   OpenAI's body).

The Responses API (server/responses_api.py) answers through the same `OpenAIApi.answer`.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.authentication import AuthenticationError
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ragkv.server.admission import Admission
from ragkv.server.answering import Answerer, ChunksEvent, RunEvent, answer_events, begin
from ragkv.server.api_keys import Caller, KeyRing, UnauthenticatedError
from ragkv.server.auth import KeyAuth
from ragkv.server.backend import Catalogue
from ragkv.server.metrics import ServerMetrics
from ragkv.server.openai_reply import (
    METHOD,
    completion_body,
    completion_stream,
    error_response,
    last_stats,
    streaming,
)
from ragkv.server.openai_request import ChatBody, parse_chat
from ragkv.server.query import Query
from ragkv.server.status import InvalidArgumentError, NotServingError, RequestTooLargeError, UnknownCollectionError
from ragkv.server.validation import RequestLimits, validate_query
from ragkv.types import QueryStats

LIST_MODELS = "ListModels"  # the `method` label of /v1/models


@dataclass(slots=True)
class Answer:
    """A chat completion begun: what was asked, and its events from the second on (the first,
    the chunks, is `first`)."""

    chat: ChatBody
    query: Query
    events: AsyncIterator[RunEvent]
    first: ChunksEvent


class OpenAIApi:
    """The HTTP handlers; `app` is the ASGI application.

    Args:
        runner: Answers queries (shared with the gRPC service).
        admission: The server's admission (draining refuses new requests here too).
        limits: Request bounds and defaults (the gRPC service's).
        metrics: Where errors are counted.
        backend: Returns the loaded backend, or None while loading.
        keys: The keys every route but /health needs (server.api_keys); None or empty = open.
        max_body_bytes: Larger request bodies are refused (413) before they are parsed.
    """

    def __init__(self, *, runner: Answerer, admission: Admission, limits: RequestLimits, metrics: ServerMetrics,
                 backend: Callable[[], Catalogue | None], keys: KeyRing | None = None,
                 max_body_bytes: int = 8 * 1024**2) -> None:
        self._runner = runner
        self._admission = admission
        self._limits = limits
        self._metrics = metrics
        self._backend = backend
        self._keys = keys or KeyRing()
        self._max_body = max_body_bytes
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.get_model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], middleware=[Middleware(AuthenticationMiddleware, backend=KeyAuth(self._keys), on_error=self._refused)])

    @property
    def metrics(self) -> ServerMetrics:
        return self._metrics

    @property
    def admission(self) -> Admission:
        return self._admission

    def caller(self, request: Request, method: str) -> Caller:
        """The request's caller (`KeyAuth` checked its key), counted under `method`."""
        caller: Caller = request.user.caller
        self._metrics.key_requests.labels(caller.label, method).inc()
        return caller

    def _refused(self, conn: HTTPConnection, exc: AuthenticationError) -> Response:
        """A request whose key `KeyAuth` refused: 401, counted under its route's method."""
        cause = exc.__cause__ if isinstance(exc.__cause__, UnauthenticatedError) else UnauthenticatedError(str(exc))
        path = conn.url.path
        method = LIST_MODELS if path.startswith("/v1/models") else (
            "Responses" if path.startswith("/v1/responses/") else METHOD)
        return error_response(cause, method, self._metrics)

    async def body(self, request: Request) -> object:
        """The request's JSON body, refused unparsed when it is larger than the cap."""
        length = request.headers.get("content-length", "")
        too_large = RequestTooLargeError(f"the request body is larger than {self._max_body} bytes "
                                         f"(ragkv serve --max-request-bytes)")
        if length.isdigit() and int(length) > self._max_body:
            raise too_large
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self._max_body:
                raise too_large
            parts.append(part)
        try:
            return json.loads(b"".join(parts))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError("body", f"is not valid JSON ({exc})") from None

    def _ready(self) -> Catalogue:
        backend = self._backend()
        if backend is None:
            raise NotServingError("the server is still loading its indexes and model")
        return backend

    async def health(self, request: Request) -> Response:
        if self._backend() is None or self._admission.draining:
            return JSONResponse({"status": "not_serving"}, status_code=503)
        return JSONResponse({"status": "serving"})

    def _model(self, info: Any) -> dict[str, Any]:  # info: CollectionInfo
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "ragkv",
                "ragkv": {"num_chunks": info.num_chunks, "model_fingerprint": info.model_fingerprint}}

    async def list_models(self, request: Request) -> Response:
        caller = self.caller(request, LIST_MODELS)
        try:
            with self._admission.rpc():
                infos = [i for i in self._ready().collections() if caller.may_read(i.name)]
                return JSONResponse({"object": "list", "data": [self._model(i) for i in infos]})
        except Exception as exc:
            return error_response(exc, LIST_MODELS, self._metrics)

    async def get_model(self, request: Request) -> Response:
        caller = self.caller(request, LIST_MODELS)
        try:
            name = request.path_params["name"]
            caller.check_collection(name)  # a key learns nothing of collections it may not read
            with self._admission.rpc():
                for info in self._ready().collections():
                    if info.name == name:
                        return JSONResponse(self._model(info))
                raise UnknownCollectionError(f"collection {name!r} is not served here")
        except Exception as exc:
            return error_response(exc, LIST_MODELS, self._metrics, caller)

    async def answer(self, body: object, caller: Caller, arrived: float, cancel: threading.Event) -> Answer:
        """Read, validate and admit a chat completion's body, and begin its answer: every
        error before the first byte is sent is raised here."""
        backend = self._ready()
        chat = parse_chat(body)
        query = validate_query(chat.question, chat.options, self._limits, backend.modes)
        query = self._keys.admit(caller, query, chat.options.cache_salt)

        bill = self._keys.bill(caller)  # the key's prompt tokens, against its per-minute limit

        def reserve(prompt_tokens: int) -> None:  # once the prompt is known, before it is computed
            bill.reserve(prompt_tokens)
            self._metrics.key_prompt_tokens.labels(caller.label).inc(prompt_tokens)

        def settle(stats: QueryStats) -> None:  # what the answer counted past the reservation
            self._metrics.key_prompt_tokens.labels(caller.label).inc(bill.settle(stats.usage.prompt_tokens))

        events = answer_events(self._runner, backend, query, self._admission, arrived=arrived, cancel=cancel,
                               method=METHOD, on_stats=settle, reserve=reserve)
        return Answer(chat, query, events, await begin(events))

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        cancel = threading.Event()
        caller = self.caller(request, METHOD)
        try:
            body = await self.body(request)
            answer = await self.answer(body, caller, arrived, cancel)
        except Exception as exc:
            cancel.set()
            return error_response(exc, METHOD, self._metrics, caller)
        chat, query, chunks = answer.chat, answer.query, answer.first.chunks
        reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if chat.stream:
            return streaming(completion_stream(answer.events, chunks, query.collection, chat.options.snippet_chars,
                                               chat.include_usage, reply_id, created, cancel, self._metrics))
        try:
            stats = await last_stats(answer.events)
        except Exception as exc:
            return error_response(exc, METHOD, self._metrics)
        finally:
            cancel.set()
        if stats is None:
            raise RuntimeError("the answer ended without stats: a bug")
        return JSONResponse(completion_body(reply_id, created, query.collection, chunks, stats,
                                            chat.options.snippet_chars))
