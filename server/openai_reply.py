"""The OpenAI-compatible HTTP API's reply side: an answer's typed events as a chat
completion (one JSON body, or server-sent events), and errors as OpenAI's body.

Sources, KV tiers and timings come back in a `ragkv` field of the response (streaming: of
the final chunk); usage counts KV-cached prompt tokens as
`prompt_tokens_details.cached_tokens`. Errors use OpenAI's body, `{"error": {"message",
"type", "param", "code"}}`, with the status `server.status.status_for` gives the same
exception on gRPC.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from starlette.responses import JSONResponse, StreamingResponse

from ragkv.server.answering import RunEvent, TokenEvent
from ragkv.server.api_keys import ANONYMOUS, Caller, PermissionDeniedError, RateLimitedError
from ragkv.server.metrics import ServerMetrics
from ragkv.server.status import RequestTooLargeError, UnknownCollectionError, status_for
from ragkv.types import FinishReason, QueryStats, RetrievedChunk, ToolCallDelta

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
FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any], grpc.StatusCode]:
    """(HTTP status, OpenAI error body, gRPC code) for an exception."""
    code, message = status_for(exc)
    status, kind = _HTTP.get(code, (500, "server_error"))
    if isinstance(exc, RequestTooLargeError):
        status, kind = 413, "invalid_request_error"
    param = getattr(exc, "field", None)
    err_code = "model_not_found" if isinstance(exc, UnknownCollectionError) else code.name.lower()
    return status, {"error": {"message": message, "type": kind, "param": param, "code": err_code}}, code




async def last_stats(events: AsyncIterator[RunEvent]) -> QueryStats | None:
    """Run a non-streamed answer's events to their end: its final stats (None: a bug upstream)."""
    stats = None
    async for event in events:
        if isinstance(event, QueryStats):
            stats = event
    return stats


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
        # the ratio blend ran at (null outside blend), and the KL from full prefill the collection's
        # calibration predicts for it (0 for full prefill; null without a calibration)
        "recompute_ratio": stats.recompute_ratio,
        "predicted_kl": stats.predicted_kl,
        "tree_prompt_tokens": stats.usage.tree_prompt_tokens,  # of cached_tokens, the KV tree's
        # how the request's system message was served: indexed (the index's own), prefix or suffix
        "system_prompt": stats.system_prompt.value,
        # an answer cut by a length limit: which (max_tokens, server_default, server_cap, context); null otherwise
        "length_limit": None if stats.length_limit is None else stats.length_limit.value,
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


def error_response(exc: BaseException, method: str, metrics: ServerMetrics, caller: Caller = ANONYMOUS
                   ) -> JSONResponse:
    """`exc` as OpenAI's error body with its status, counted in `metrics` (a key's refusals by key)."""
    status, body, code = error_body(exc)
    if isinstance(exc, (PermissionDeniedError, RateLimitedError)):
        metrics.key_refusals.labels(caller.label, code.name).inc()
        log.info("%s of key %s refused: %s", method, caller.label, exc)
    metrics.errors.labels(method, code.name).inc()
    if method == METHOD:
        metrics.requests.labels(code.name).inc()
    if status == 500:
        log.error("%s failed", method, exc_info=exc)
    return JSONResponse(body, status_code=status)


def completion_body(reply_id: str, created: int, collection: str, chunks: tuple[RetrievedChunk, ...],
                    stats: QueryStats, snippet: int | None) -> dict[str, Any]:
    """A whole (not streamed) chat completion."""
    return {
        "id": reply_id, "object": "chat.completion", "created": created, "model": collection,
        "choices": [{"index": 0, "message": message_body(stats),
                     "finish_reason": FINISH.get(stats.finish_reason, "stop"), "logprobs": None}],
        "usage": usage_body(stats),
        "ragkv": ragkv_extra(chunks, stats, snippet),
    }


async def completion_stream(events: AsyncIterator[RunEvent], chunks: tuple[RetrievedChunk, ...], collection: str,
                            snippet: int | None, include_usage: bool, reply_id: str, created: int,
                            cancel: threading.Event, metrics: ServerMetrics) -> AsyncIterator[str]:
    """A chat completion's server-sent events; an error after the headers goes in the stream,
    as OpenAI's does. The events are closed and `cancel` set however it ends."""
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        msg = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": collection,
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
                    yield chunk({}, FINISH.get(event.finish_reason, "stop"), ragkv=extra)
                    msg = {"id": reply_id, "object": "chat.completion.chunk", "created": created,
                           "model": collection, "choices": [], "usage": usage_body(event), "ragkv": extra}
                    yield f"data: {json.dumps(msg, default=str)}\n\n"
                else:
                    yield chunk({}, FINISH.get(event.finish_reason, "stop"), usage=usage_body(event), ragkv=extra)
        yield "data: [DONE]\n\n"
    except Exception as exc:
        _, body, code = error_body(exc)
        metrics.errors.labels(METHOD, code.name).inc()
        metrics.requests.labels(code.name).inc()
        yield f"data: {json.dumps(body)}\n\n"
    finally:
        cancel.set()
        await events.aclose()  # type: ignore[attr-defined]


def streaming(lines: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events as a response."""
    return StreamingResponse(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
