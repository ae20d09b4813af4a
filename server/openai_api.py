"""The OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/models`, `/health`.

A Starlette app served by uvicorn on the gRPC server's own event loop (server/app.py),
over the same backend, admission queue and scheduler: a chat completion is answered by
`QueryRunner.run` exactly as a gRPC Query is. `model` names the collection; ragkv's
own options (mode, top_k, recompute_ratio, search_mode, filters, snippet_chars) ride as
extra body fields (the `openai` client's `extra_body`). Sources, KV tiers and timings
come back in a `ragkv` field of the response (streaming: of the final chunk); usage
counts KV-cached prompt tokens as `prompt_tokens_details.cached_tokens`.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, with the
status `server.status.status_for` gives the same exception on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ragkv.server.admission import Admission
from ragkv.server.answering import QueryRunner
from ragkv.server.backend import ChunksEvent, QueryBackend, QueryParams, TokenEvent
from ragkv.server.metrics import ServerMetrics
from ragkv.server.status import InvalidArgumentError, NotServingError, UnknownCollectionError, status_for
from ragkv.server.validation import RequestLimits, validate_query
from ragkv.types import (
    ChatRole,
    ChatTurn,
    FinishReason,
    MetadataFilter,
    Mode,
    QueryOptions,
    QueryStats,
    RetrievedChunk,
    SearchMode,
)

log = logging.getLogger(__name__)

METHOD = "ChatCompletions"  # the `method` label of this API's metrics
# gRPC status -> (HTTP status, OpenAI error type)
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_SYSTEM_ROLES = ("system", "developer")
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class UnauthenticatedError(Exception):
    """No or a wrong bearer token (401)."""


def error_body(exc: BaseException) -> tuple[int, dict[str, Any], grpc.StatusCode]:
    """(HTTP status, OpenAI error body, gRPC code) for an exception."""
    if isinstance(exc, UnauthenticatedError):
        code, message = grpc.StatusCode.UNAUTHENTICATED, str(exc)
    else:
        code, message = status_for(exc)
    status, kind = _HTTP.get(code, (500, "server_error"))
    param = getattr(exc, "field", None)
    err_code = "model_not_found" if isinstance(exc, UnknownCollectionError) else code.name.lower()
    return status, {"error": {"message": message, "type": kind, "param": param, "code": err_code}}, code


def _text(content: object, where: str) -> str:
    """A message's content as text: a str, or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidArgumentError(f"{where}.content[{i}]", f"only text parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgumentError(f"{where}.content", f"must be a string or a list of text parts, got {content!r}")


def _split_messages(messages: object) -> tuple[str | None, tuple[ChatTurn, ...], str]:
    """(system prompt or None, earlier turns, question) from OpenAI `messages`."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "must be a non-empty list of {role, content} objects")
    system: list[str] = []
    turns: list[ChatTurn] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidArgumentError(where, f"must be an object with role and content, got {m!r}")
        role = m.get("role")
        if role in _SYSTEM_ROLES:
            if turns:
                raise InvalidArgumentError(where, "a system message must come before every user/assistant message")
            system.append(_text(m.get("content"), where))
        elif role in ("user", "assistant"):
            turns.append(ChatTurn(ChatRole(role), _text(m.get("content"), where)))
        else:
            raise InvalidArgumentError(f"{where}.role", f"must be system, developer, user or assistant, got {role!r}")
    if not turns or turns[-1].role is not ChatRole.USER:
        raise InvalidArgumentError("messages", "the last message must be the user's question")
    return ("\n\n".join(system) if system else None), tuple(turns[:-1]), turns[-1].content


def _field(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise InvalidArgumentError(name, f"must be {what}, got {value!r}")
    return value


def _enum(body: Mapping[str, Any], name: str, enum_cls: type[Mode] | type[SearchMode]) -> Any:
    value = _field(body, name, (str,), "a string")
    if value is None:
        return None
    try:
        return enum_cls(value.lower())
    except ValueError:
        allowed = ", ".join(m.value for m in enum_cls)
        raise InvalidArgumentError(name, f"must be one of {allowed}, got {value!r}") from None


def options_from_body(body: object) -> tuple[str, QueryOptions, bool, bool]:
    """Read a chat completion request into (question, options, stream, include_usage).

    Raises:
        InvalidArgumentError: A field has the wrong type, or asks for what ragkv does not do.
    """
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    model = _field(body, "model", (str,), "a collection name")
    if not model:
        raise InvalidArgumentError("model", "must name a collection (GET /v1/models lists them)")
    n = _field(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise InvalidArgumentError("n", f"only n=1 is supported, got {n}")
    if body.get("tools"):
        raise InvalidArgumentError("tools", "tool calls are not supported")
    system, history, question = _split_messages(body.get("messages"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise InvalidArgumentError("stop", f"must be a string or a list of strings, got {stop!r}")
    max_tokens = _field(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), "an integer")
    filters = _field(body, "filters", (dict,), "an object of metadata key -> JSON value")
    stream = bool(_field(body, "stream", (bool,), "a boolean"))
    stream_options = _field(body, "stream_options", (dict,), "an object") or {}
    temperature = _field(body, "temperature", (int, float), "a number")
    top_k = _field(body, "top_k", (int,), "an integer")
    snippet = _field(body, "snippet_chars", (int,), "an integer")
    options = QueryOptions(
        collection=model,
        top_k=top_k,
        mode=_enum(body, "mode", Mode),
        recompute_ratio=_field(body, "recompute_ratio", (int, float), "a number"),
        temperature=0.0 if temperature is None else float(temperature),  # ragkv answers greedily by default
        top_p=_field(body, "top_p", (int, float), "a number"),
        seed=_field(body, "seed", (int,), "an integer"),
        max_new_tokens=max_tokens,
        stop=tuple(stop or ()),
        snippet_chars=snippet,
        search_mode=_enum(body, "search_mode", SearchMode),
        filters=tuple(MetadataFilter(str(k), v) for k, v in (filters or {}).items()),
        history=history,
        system_prompt=system,
    )
    return question, options, stream, bool(stream_options.get("include_usage"))


def _source(chunk: RetrievedChunk, snippet_chars: int | None) -> dict[str, Any]:
    text = chunk.text if not snippet_chars else chunk.text[:snippet_chars]
    return {
        "chunk_id": chunk.chunk_id,
        "score": chunk.score,
        "kv_tier": None if chunk.kv_tier is None else chunk.kv_tier.value,
        "num_tokens": chunk.num_tokens,
        "found_by": [m.value for m in chunk.found_by],
        "metadata": dict(chunk.metadata),
        "text": text,
    }


def ragkv_extra(chunks: tuple[RetrievedChunk, ...], stats: QueryStats, snippet_chars: int | None) -> dict[str, Any]:
    """The `ragkv` field: sources with their KV tier, and ragkv's timings."""
    return {
        "sources": [_source(c, snippet_chars) for c in chunks],
        "used_chunk_ids": list(stats.used_chunk_ids),
        "kv_sources": {k.value: v for k, v in stats.kv_sources.items()},
        "mode": stats.mode.value,
        "recompute_fraction": stats.recompute_fraction,
        "ttft_seconds": stats.ttft_seconds,
        "total_seconds": stats.total_seconds,
        "phase_seconds": dict(stats.phase_seconds),
    }


def usage_body(stats: QueryStats) -> dict[str, Any]:
    """OpenAI's usage object; KV-cached prompt tokens as prompt_tokens_details.cached_tokens."""
    u = stats.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


class OpenAIApi:
    """The HTTP handlers; `app` is the ASGI application.

    Args:
        runner: Answers queries (shared with the gRPC service).
        admission: The server's admission (draining refuses new requests here too).
        limits: Request bounds and defaults (the gRPC service's).
        metrics: Where errors are counted.
        backend: Returns the loaded backend, or None while loading.
        token: The bearer token every route but /health needs; None = no auth.
    """

    def __init__(self, *, runner: QueryRunner, admission: Admission, limits: RequestLimits, metrics: ServerMetrics,
                 backend: Callable[[], QueryBackend | None], token: str | None) -> None:
        self._runner = runner
        self._admission = admission
        self._limits = limits
        self._metrics = metrics
        self._backend = backend
        self._expected = None if token is None else f"Bearer {token}".encode()
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.get_model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    def _check_auth(self, request: Request) -> None:
        if self._expected is None:
            return
        got = request.headers.get("authorization")
        if got is None:
            raise UnauthenticatedError("missing 'Authorization: Bearer <token>' header")
        if not hmac.compare_digest(got.encode(), self._expected):
            raise UnauthenticatedError("invalid bearer token")

    def _ready(self) -> QueryBackend:
        backend = self._backend()
        if backend is None:
            raise NotServingError("the server is still loading its indexes and model")
        return backend

    def _error(self, exc: BaseException, method: str) -> JSONResponse:
        status, body, code = error_body(exc)
        self._metrics.errors.labels(method, code.name).inc()
        if method == METHOD:
            self._metrics.requests.labels(code.name).inc()
        if status == 500:
            log.error("%s failed", method, exc_info=exc)
        return JSONResponse(body, status_code=status)

    async def health(self, request: Request) -> Response:
        if self._backend() is None or self._admission.draining:
            return JSONResponse({"status": "not_serving"}, status_code=503)
        return JSONResponse({"status": "serving"})

    def _model(self, info: Any) -> dict[str, Any]:  # info: CollectionInfo
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "ragkv",
                "ragkv": {"num_chunks": info.num_chunks, "model_fingerprint": info.model_fingerprint}}

    async def list_models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
            with self._admission.rpc():
                infos = self._ready().collections()
                return JSONResponse({"object": "list", "data": [self._model(i) for i in infos]})
        except Exception as exc:
            return self._error(exc, "ListModels")

    async def get_model(self, request: Request) -> Response:
        try:
            self._check_auth(request)
            name = request.path_params["name"]
            with self._admission.rpc():
                for info in self._ready().collections():
                    if info.name == name:
                        return JSONResponse(self._model(info))
                raise UnknownCollectionError(f"collection {name!r} is not served here")
        except Exception as exc:
            return self._error(exc, "ListModels")

    async def _events(self, body: object, arrived: float, cancel: threading.Event) -> AsyncIterator[object]:
        """Yields (params, snippet_chars, stream, include_usage) first, then the answer's events."""
        with self._admission.rpc():
            backend = self._ready()
            question, options, stream, include_usage = options_from_body(body)
            params = validate_query(question, options, self._limits, backend.modes)
            yield params, options.snippet_chars, stream, include_usage
            async for event in self._runner.run(backend, params, arrived=arrived, cancel=cancel, method=METHOD):
                yield event

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        cancel = threading.Event()
        events: AsyncIterator[object] | None = None
        try:
            self._check_auth(request)
            try:
                body = await request.json()
            except ValueError as exc:
                raise InvalidArgumentError("body", f"is not valid JSON ({exc})") from None
            events = self._events(body, arrived, cancel)
            params, snippet, stream, include_usage = await anext(events)
            first = await anext(events)  # the chunks: retrieval and KV loads done, errors still map to a status
        except Exception as exc:
            cancel.set()
            if events is not None:
                await events.aclose()  # type: ignore[attr-defined]
            return self._error(exc, METHOD)
        if not isinstance(first, ChunksEvent):
            raise RuntimeError(f"the answer began with {type(first).__name__}, not the chunks: a bug")
        reply_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            return StreamingResponse(
                self._sse(events, first.chunks, params, snippet, include_usage, reply_id, created, cancel),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            stats = None
            async for event in events:
                if isinstance(event, QueryStats):
                    stats = event
        except Exception as exc:
            return self._error(exc, METHOD)
        finally:
            cancel.set()
        if stats is None:
            raise RuntimeError("the answer ended without stats: a bug")
        return JSONResponse({
            "id": reply_id, "object": "chat.completion", "created": created, "model": params.collection,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": stats.text},
                         "finish_reason": _FINISH.get(stats.finish_reason, "stop"), "logprobs": None}],
            "usage": usage_body(stats),
            "ragkv": ragkv_extra(first.chunks, stats, snippet),
        })

    async def _sse(self, events: AsyncIterator[object], chunks: tuple[RetrievedChunk, ...], params: QueryParams,
                   snippet: int | None, include_usage: bool, reply_id: str, created: int,
                   cancel: threading.Event) -> AsyncIterator[str]:
        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            msg = {"id": reply_id, "object": "chat.completion.chunk", "created": created,
                   "model": params.collection,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(msg, default=str)}\n\n"

        try:
            yield chunk({"role": "assistant", "content": ""})
            async for event in events:
                if isinstance(event, TokenEvent):
                    yield chunk({"content": event.text})
                elif isinstance(event, QueryStats):
                    extra = ragkv_extra(chunks, event, snippet)
                    if include_usage:  # as OpenAI does: a last chunk with no choices carries the usage
                        yield chunk({}, _FINISH.get(event.finish_reason, "stop"), ragkv=extra)
                        msg = {"id": reply_id, "object": "chat.completion.chunk", "created": created,
                               "model": params.collection, "choices": [], "usage": usage_body(event),
                               "ragkv": extra}
                        yield f"data: {json.dumps(msg, default=str)}\n\n"
                    else:
                        yield chunk({}, _FINISH.get(event.finish_reason, "stop"), usage=usage_body(event),
                                    ragkv=extra)
            yield "data: [DONE]\n\n"
        except Exception as exc:  # headers are sent: the error goes in the stream, as OpenAI's does
            _, body, code = error_body(exc)
            self._metrics.errors.labels(METHOD, code.name).inc()
            self._metrics.requests.labels(code.name).inc()
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            cancel.set()
            await events.aclose()  # type: ignore[attr-defined]


class HttpServer:
    """uvicorn serving an ASGI app on the running event loop (the gRPC server's).

    uvicorn's own signal capture is off: `ragkv serve` drains on SIGTERM itself, and
    stops this server as part of the drain.
    """

    def __init__(self, app: Any, host: str, port: int, tls_cert: Any = None, tls_key: Any = None) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # noqa: ANN202 - the RagServer owns SIGTERM/SIGINT
                yield

        self._host, self._port = host, port
        self._config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                      timeout_graceful_shutdown=1,
                                      ssl_certfile=None if tls_cert is None else str(tls_cert),
                                      ssl_keyfile=None if tls_key is None else str(tls_key))
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None  # bound port, after start()

    async def start(self) -> int:
        """Bind and serve; returns the bound port.

        Raises:
            OSError: The port cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as exc:
            sock.close()
            raise OSError(f"could not bind the HTTP port at {self._host}:{self._port}: {exc}") from exc
        sock.listen(128)
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed at startup
                self._task.result()
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close connections, and wait (at most `timeout` seconds)."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self._server.force_exit = True
            self._task.cancel()
        self._task = None
