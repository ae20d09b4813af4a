"""The OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/models`, `/health`.

A Starlette app served by uvicorn on the gRPC server's own event loop (server/app.py),
over the same backend, admission queue and scheduler: a chat completion is answered by
`QueryRunner.run` exactly as a gRPC Query is. `model` names the collection; ragkv's
own options (mode, top_k, recompute_ratio, search_mode, filters, snippet_chars) ride as
extra body fields (the `openai` client's `extra_body`), `citations` and `retain_seconds`
(seconds a tool-calling answer's KV-tree path is pinned) among them. `tools`,
`tool_choice`, `parallel_tool_calls` and `response_format` are OpenAI's, served by
constrained decoding (server/structured.py). Sources, KV tiers and timings
come back in a `ragkv` field of the response (streaming: of the final chunk); usage
counts KV-cached prompt tokens as `prompt_tokens_details.cached_tokens`.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, with the
status `server.status.status_for` gives the same exception on gRPC.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ragkv.engine.request import ChunksReady
from ragkv.server.admission import Admission
from ragkv.server.answering import Answerer, RunEvent, TokenEvent
from ragkv.server.backend import QueryBackend
from ragkv.server.keys import ANONYMOUS, Caller, KeyRing, PermissionDeniedError, RateLimitedError
from ragkv.server.metrics import ServerMetrics
from ragkv.server.query import Query
from ragkv.server.status import (
    InvalidArgumentError,
    NotServingError,
    RequestTooLargeError,
    UnknownCollectionError,
    status_for,
)
from ragkv.server.validation import RequestLimits, check_priority, validate_query
from ragkv.types import (
    ChatRole,
    ChatTurn,
    FinishReason,
    MetadataFilter,
    Mode,
    QueryOptions,
    QueryStats,
    ResponseFormat,
    ResponseFormatKind,
    RetrievedChunk,
    SearchMode,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
)

log = logging.getLogger(__name__)

METHOD = "ChatCompletions"  # the `method` label of this API's metrics
# gRPC status -> (HTTP status, OpenAI error type)
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_SYSTEM_ROLES = ("system", "developer")
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}


_MAX_SALT_CHARS = 256  # characters of a request's cache_salt


def error_body(exc: BaseException) -> tuple[int, dict[str, Any], grpc.StatusCode]:
    """(HTTP status, OpenAI error body, gRPC code) for an exception."""
    code, message = status_for(exc)
    status, kind = _HTTP.get(code, (500, "server_error"))
    if isinstance(exc, RequestTooLargeError):
        status, kind = 413, "invalid_request_error"
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


def _tool_calls(value: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{where}.tool_calls", f"must be a list, got {value!r}")
    calls = []
    for j, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise InvalidArgumentError(f"{where}.tool_calls[{j}]",
                                       "must be {id, type: function, function: {name, arguments}}")
        args = fn.get("arguments") or "{}"
        if not isinstance(args, str):
            raise InvalidArgumentError(f"{where}.tool_calls[{j}].function.arguments", "must be a JSON string")
        calls.append(ToolCall(c["id"], fn["name"], args))
    return tuple(calls)


def _split_messages(messages: object) -> tuple[str | None, tuple[ChatTurn, ...], str, tuple[ChatTurn, ...]]:
    """(system prompt or None, earlier turns, question, agent turns) from OpenAI `messages`.

    The question is the last user message; the assistant's tool calls and the tools'
    results after it are the agent's turns on it so far.
    """
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
        elif role == "user":
            turns.append(ChatTurn(ChatRole.USER, _text(m.get("content"), where)))
        elif role == "assistant":
            calls = _tool_calls(m.get("tool_calls"), where)
            content = "" if m.get("content") is None and calls else _text(m.get("content"), where)
            turns.append(ChatTurn(ChatRole.ASSISTANT, content, calls))
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidArgumentError(f"{where}.tool_call_id", "a tool message must name the call it answers")
            turns.append(ChatTurn(ChatRole.TOOL, _text(m.get("content"), where), tool_call_id=call_id))
        else:
            raise InvalidArgumentError(f"{where}.role",
                                       f"must be system, developer, user, assistant or tool, got {role!r}")
    users = [i for i, t in enumerate(turns) if t.role is ChatRole.USER]
    if not users:
        raise InvalidArgumentError("messages", "there must be a user message: the question")
    q = users[-1]
    after = tuple(turns[q + 1:])
    if after and after[-1].role is ChatRole.ASSISTANT and not after[-1].tool_calls:
        raise InvalidArgumentError("messages", "the last message must be the user's question or a tool's result")
    return ("\n\n".join(system) if system else None), tuple(turns[:q]), turns[q].content, after


def _tools(body: Mapping[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice, bool]:
    """`tools`, `tool_choice` and `parallel_tool_calls`."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise InvalidArgumentError(legacy, "is OpenAI's deprecated form; send tools and tool_choice instead")
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise InvalidArgumentError("tools", f"must be a list of function tools, got {raw!r}")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidArgumentError(f"tools[{i}]", "must be {type: function, function: {name, description, "
                                                      "parameters}}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidArgumentError(f"tools[{i}].function.parameters", f"must be a JSON schema object, got {params!r}")
        tools.append(Tool(fn["name"], str(fn.get("description") or ""), params))
    choice = body.get("tool_choice")
    if choice is None:
        tool_choice = ToolChoice(ToolChoiceMode.AUTO)
    elif isinstance(choice, str) and choice in ("auto", "none", "required"):
        tool_choice = ToolChoice(ToolChoiceMode(choice))
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        tool_choice = ToolChoice(ToolChoiceMode.FUNCTION, choice["function"]["name"])
    else:
        raise InvalidArgumentError("tool_choice", 'must be "auto", "none", "required" or '
                                                  f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}')
    parallel = _field(body, "parallel_tool_calls", (bool,), "a boolean")
    return tuple(tools), tool_choice, True if parallel is None else parallel


def _response_format(body: Mapping[str, Any]) -> ResponseFormat:
    fmt = _field(body, "response_format", (dict,), "an object with a type")
    if fmt is None:
        return ResponseFormat()
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidArgumentError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if kind != "json_schema":
        return ResponseFormat(ResponseFormatKind(kind))
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidArgumentError("response_format.json_schema", "must be {name, schema: <JSON schema object>, strict}")
    return ResponseFormat(ResponseFormatKind.JSON_SCHEMA, spec["schema"], str(spec.get("name") or ""),
                          bool(spec.get("strict")))


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
    system, history, question, agent_turns = _split_messages(body.get("messages"))
    tools, tool_choice, parallel = _tools(body)
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
        agent_turns=agent_turns,
        response_format=_response_format(body),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        citations=bool(_field(body, "citations", (bool,), "a boolean")),
    )
    return question, options, stream, bool(stream_options.get("include_usage"))


def _retain_seconds(body: object) -> float | None:
    """`retain_seconds` (a ragkv extra); the backend checks its bound, --kv-tree-retain-max-s."""
    value = _field(body, "retain_seconds", (int, float), "a number of seconds") if isinstance(body, dict) else None
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError("retain_seconds", f"must be a number of seconds >= 0, got {value!r}")
    return None if value is None else float(value)


def _retain_priority(body: object) -> int | None:
    """`retain_priority` (a ragkv extra): an integer in -100..100."""
    value = body.get("retain_priority") if isinstance(body, dict) else None
    check_priority(value)
    return value if isinstance(value, int) else None


@dataclass(frozen=True, slots=True)
class ChatCall:
    """A chat completion's body, validated: its Query and how the answer goes back."""

    query: Query
    snippet_chars: int | None  # chunk text in the sources, in characters; None = whole
    stream: bool  # server-sent events
    include_usage: bool  # a last streamed chunk with the usage (stream_options)


async def last_stats(events: AsyncIterator[RunEvent]) -> QueryStats | None:
    """Run a non-streamed answer's events to their end: its final stats (None: a bug upstream)."""
    stats = None
    async for event in events:
        if isinstance(event, QueryStats):
            stats = event
    return stats


def _cache_salt(body: object) -> str | None:
    """The request's `cache_salt` (vLLM's field): its KV-tree paths are shared only with requests
    of the same key giving the same salt."""
    salt = _field(body, "cache_salt", (str,), "a string") if isinstance(body, dict) else None
    if salt is not None and not 0 < len(salt) <= _MAX_SALT_CHARS:
        raise InvalidArgumentError("cache_salt", f"must have 1..{_MAX_SALT_CHARS} characters, got {len(salt)}")
    return salt


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
        "tree_prompt_tokens": stats.usage.tree_prompt_tokens,  # of cached_tokens, the KV tree's
        "ttft_seconds": stats.ttft_seconds,
        "total_seconds": stats.total_seconds,
        "phase_seconds": dict(stats.phase_seconds),
        "citations": [{"number": c.number, "chunk_id": c.chunk_id, "start": c.start, "end": c.end,
                       "sentence_start": c.sentence_start} for c in stats.citations],
        # focus only: a lookup or a handover, and how sure the rule was (docs/quality.md); null otherwise
        "focus": None if stats.focus is None else {"handed_over": stats.focus.handed_over,
                                                   "kept_attention": stats.focus.kept_attention,
                                                   "spread": stats.focus.spread},
    }


def message_body(stats: QueryStats) -> dict[str, Any]:
    """The assistant's message: its text, or its tool calls (content null, as OpenAI sends it)."""
    if not stats.tool_calls:
        return {"role": "assistant", "content": stats.text}
    return {"role": "assistant", "content": stats.text or None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in stats.tool_calls]}


def tool_call_delta(d: ToolCallDelta) -> dict[str, Any]:
    """A streamed tool-call piece as OpenAI's `delta.tool_calls` item."""
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


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
        keys: The keys every route but /health needs (server.keys); None or empty = open.
        max_body_bytes: Larger request bodies are refused (413) before they are parsed.
    """

    def __init__(self, *, runner: Answerer, admission: Admission, limits: RequestLimits, metrics: ServerMetrics,
                 backend: Callable[[], QueryBackend | None], keys: KeyRing | None = None,
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
        ])

    def _check_auth(self, request: Request, method: str = METHOD) -> Caller:
        """The caller the request's `Authorization` header names (before its body is read)."""
        caller = self._keys.authenticate(request.headers.get("authorization"))
        self._metrics.key_requests.labels(caller.label, method).inc()
        return caller

    async def _body(self, request: Request) -> object:
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

    def _ready(self) -> QueryBackend:
        backend = self._backend()
        if backend is None:
            raise NotServingError("the server is still loading its indexes and model")
        return backend

    def _error(self, exc: BaseException, method: str, caller: Caller = ANONYMOUS) -> JSONResponse:
        status, body, code = error_body(exc)
        if isinstance(exc, (PermissionDeniedError, RateLimitedError)):
            self._metrics.key_refusals.labels(caller.label, code.name).inc()
            log.info("%s of key %s refused: %s", method, caller.label, exc)
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
            caller = self._check_auth(request, "ListModels")
            with self._admission.rpc():
                infos = [i for i in self._ready().collections() if caller.may_read(i.name)]
                return JSONResponse({"object": "list", "data": [self._model(i) for i in infos]})
        except Exception as exc:
            return self._error(exc, "ListModels")

    async def get_model(self, request: Request) -> Response:
        caller = ANONYMOUS
        try:
            caller = self._check_auth(request, "ListModels")
            name = request.path_params["name"]
            caller.check_collection(name)  # a key learns nothing of collections it may not read
            with self._admission.rpc():
                for info in self._ready().collections():
                    if info.name == name:
                        return JSONResponse(self._model(info))
                raise UnknownCollectionError(f"collection {name!r} is not served here")
        except Exception as exc:
            return self._error(exc, "ListModels", caller)

    def _call(self, body: object, caller: Caller) -> ChatCall:
        """A chat completion's body, validated into its Query (the caller's key may read its
        collection and is within its limits), before any answering begins."""
        backend = self._ready()
        question, options, stream, include_usage = options_from_body(body)
        query = validate_query(question, options, self._limits, backend.modes, caller.tenant(_cache_salt(body)))
        if (retain := _retain_seconds(body)) is not None:
            query = dataclasses.replace(query, retain_seconds=retain)
        if (priority := _retain_priority(body)) is not None:
            query = dataclasses.replace(query, retain_priority=priority)
        self._keys.admit_query(caller, query.collection)
        return ChatCall(query, options.snippet_chars, stream, include_usage)

    async def _events(self, call: ChatCall, caller: Caller, arrived: float,
                      cancel: threading.Event) -> AsyncIterator[RunEvent]:
        """The answer's typed events (the chunks first), its prompt tokens counted to the caller."""
        with self._admission.rpc():
            backend = self._ready()
            async for event in self._runner.run(backend, call.query, arrived=arrived, cancel=cancel, method=METHOD):
                if isinstance(event, QueryStats):
                    self._keys.charge_tokens(caller, event.usage.prompt_tokens)
                    self._metrics.key_prompt_tokens.labels(caller.label).inc(event.usage.prompt_tokens)
                yield event

    async def begin(self, call: ChatCall, caller: Caller, arrived: float, cancel: threading.Event
                    ) -> tuple[AsyncIterator[RunEvent], RunEvent]:
        """Start answering `call`: its events, and the first of them (the chunks: retrieval and KV
        loads done, so their errors still map to a status); the events are closed if that fails."""
        events = self._events(call, caller, arrived, cancel)
        try:
            return events, await anext(events)
        except BaseException:
            await events.aclose()  # type: ignore[attr-defined]
            raise

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        cancel = threading.Event()
        caller = ANONYMOUS
        try:
            caller = self._check_auth(request)  # before the body is read
            call = self._call(await self._body(request), caller)
            params, snippet, stream, include_usage = call.query, call.snippet_chars, call.stream, call.include_usage
            events, first = await self.begin(call, caller, arrived, cancel)
        except Exception as exc:
            cancel.set()
            return self._error(exc, METHOD, caller)
        if not isinstance(first, ChunksReady):
            raise RuntimeError(f"the answer began with {type(first).__name__}, not the chunks: a bug")
        reply_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            return StreamingResponse(
                self._sse(events, first.chunks, params, snippet, include_usage, reply_id, created, cancel),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            stats = await last_stats(events)
        except Exception as exc:
            return self._error(exc, METHOD)
        finally:
            cancel.set()
        if stats is None:
            raise RuntimeError("the answer ended without stats: a bug")
        return JSONResponse({
            "id": reply_id, "object": "chat.completion", "created": created, "model": params.collection,
            "choices": [{"index": 0, "message": message_body(stats),
                         "finish_reason": _FINISH.get(stats.finish_reason, "stop"), "logprobs": None}],
            "usage": usage_body(stats),
            "ragkv": ragkv_extra(first.chunks, stats, snippet),
        })

    async def _sse(self, events: AsyncIterator[RunEvent], chunks: tuple[RetrievedChunk, ...], params: Query,
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
                elif isinstance(event, ToolCallDelta):
                    yield chunk({"tool_calls": [tool_call_delta(event)]})
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
