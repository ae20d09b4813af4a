"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

What the OpenAI Agents SDK (`openai-agents`) speaks by default. A request is converted into
the chat-completions body it means (its `input` items into `messages`, its flat function
tools into chat tools, `text.format` into `response_format`, `max_output_tokens` into
`max_completion_tokens`, ragkv's extra fields as they are) and answered by the chat
completions path itself (`OpenAIApi.answer`: the same validation, key checks, rate limits,
admission and `QueryRunner.run`); its metrics count it as a ChatCompletions request.

`previous_response_id` continues a stored conversation: responses made with `store` (the
default) are kept (`ResponseStore`: in memory, and in `--responses-dir` when given, so they
survive a restart; LRU, bounded in entries, bytes, bytes per entry and age), each with its
whole conversation (its input after its own previous response's expansion, plus its output)
and the tenant that made it (`Caller.tenant(cache_salt)`: the API key, and the request's
cache salt). A response is found only by its own tenant: to any other key it does not exist
(404, as an unknown id). `instructions` are not carried over, as OpenAI's are not: each
request gives its own system message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ragkv.server.answering import RunEvent, TokenEvent
from ragkv.server.api_keys import ANONYMOUS, Caller
from ragkv.server.openai_reply import METHOD, error_body, error_response, last_stats, ragkv_extra, streaming
from ragkv.server.openai_request import cache_salt
from ragkv.server.query import Query
from ragkv.server.response_store import ResponseStore, UnknownResponseError
from ragkv.server.status import InvalidArgumentError
from ragkv.types import FinishReason, LengthLimit, QueryStats, RetrievedChunk, ToolCallDelta

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from ragkv.server.openai_api import OpenAIApi
    from ragkv.server.settings import ServerSettings

log = logging.getLogger(__name__)

RETRIEVE = "Responses"  # the `method` label of GET and DELETE (POST runs, and counts, as ChatCompletions)
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
# ragkv's own request fields, passed to the chat completions reader as they are
_EXTRAS = ("mode", "top_k", "recompute_ratio", "fidelity_kl", "search_mode", "filters", "snippet_chars", "citations",
           "cache_salt", "seed", "stop", "retain_seconds", "retain_priority")
# fields OpenAI's Responses API has that ragkv cannot honour, refused rather than ignored
_REFUSED = {"conversation": "conversations are not served here; continue with previous_response_id",
            "prompt": "stored prompt templates are not served here; send instructions and input",
            "background": "background responses are not served here"}
# chat completions' (and the gRPC proto's) field names -> this API's
_RENAMES = (
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^response_format\.json_schema(\.schema)?$"), "text.format.schema"),
    (re.compile(r"^response_format.*"), "text.format"),
    (re.compile(r"^sampling\.(temperature|top_p)$"), r"\1"),
    (re.compile(r"^(max_new_tokens|max_completion_tokens|max_tokens)$"), "max_output_tokens"),
    (re.compile(r"^(system_prompt)$"), "instructions"),
    (re.compile(r"^(messages|history|question|agent_turns)(\[\d+\].*)?$"), "input"),
)


# ---- the request: Responses items -> chat completions' body ----


def _parts_text(content: object, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgumentError(f"{where}.content", f"must be a string or a list of text parts, got {content!r}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidArgumentError(f"{where}.content[{j}]",
                                       f"only input_text and output_text parts are supported, got {kind!r}")
        out.append(part["text"])
    return "".join(out)


def _str(item: Mapping[str, Any], name: str, where: str, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not (value or empty):
        raise InvalidArgumentError(f"{where}.{name}", f"must be a {'' if empty else 'non-empty '}string, got {value!r}")
    return value


def _item(raw: object, where: str) -> dict[str, Any] | None:
    """One input item in its canonical form (None: an item that carries nothing for ragkv)."""
    if not isinstance(raw, dict):
        raise InvalidArgumentError(where, f"must be an object (a message, function_call or function_call_output), "
                                          f"got {raw!r}")
    kind = raw.get("type", "message")
    if kind == "message":
        role = raw.get("role")
        if role not in _ROLES:
            raise InvalidArgumentError(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}")
        text = _parts_text(raw.get("content"), where)
        return {"type": "message", "role": role,
                "content": [{"type": "output_text" if role == "assistant" else "input_text", "text": text}]}
    if kind == "function_call":
        args = raw.get("arguments")
        return {"type": "function_call", "call_id": _str(raw, "call_id", where), "name": _str(raw, "name", where),
                "arguments": "{}" if args in (None, "") else _str(raw, "arguments", where)}
    if kind == "function_call_output":
        output = raw.get("output")
        text = output if isinstance(output, str) else _parts_text(output, where).strip() if isinstance(output, list) \
            else None
        if text is None:
            raise InvalidArgumentError(f"{where}.output", f"must be a string or a list of input_text parts, got {output!r}")
        return {"type": "function_call_output", "call_id": _str(raw, "call_id", where), "output": text}
    if kind == "reasoning":  # ragkv's models give none; one from another model carries nothing it reads
        return None
    raise InvalidArgumentError(f"{where}.type", "must be message, function_call or function_call_output "
                                                f"(ragkv serves text and function tools only), got {kind!r}")


def input_items(value: object) -> list[tuple[str, dict[str, Any]]]:
    """`input` as (where, canonical item) pairs: a string is one user message."""
    if isinstance(value, str):
        return [("input", {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]})]
    if not isinstance(value, list):
        raise InvalidArgumentError("input", f"must be a string or a list of items, got {value!r}")
    out = []
    for i, raw in enumerate(value):
        item = _item(raw, f"input[{i}]")
        if item is not None:
            out.append((f"input[{i}]", item))
    return out


def to_messages(items: list[tuple[str, dict[str, Any]]],
                instructions: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat completions' `messages` for a conversation's items, and where each came from.

    System and developer messages go first (each text once), after `instructions`; a
    function_call joins the assistant message before it (or opens one); a function
    call's output is a tool message.
    """
    system: list[tuple[str, str]] = [("instructions", instructions)] if instructions else []
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    for where, item in items:
        kind = item["type"]
        if kind == "message" and item["role"] in ("system", "developer"):
            text = item["content"][0]["text"]
            if all(text != t for _, t in system):
                system.append((where, text))
        elif kind == "message":
            messages.append({"role": item["role"], "content": item["content"][0]["text"]})
            origins.append(where)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            origins.append(where)
    return [{"role": "system", "content": t} for _, t in system] + messages, [w for w, _ in system] + origins


def _chat_tools(raw: object) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat completions' tools, the tools as the response echoes them) from Responses' flat function tools."""
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise InvalidArgumentError("tools", f"must be a list of function tools, got {raw!r}")
    chat, echo = [], []
    for i, t in enumerate(raw):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise InvalidArgumentError(f"tools[{i}].type", f"ragkv serves function tools only, got {kind!r}")
        name, desc, params = t.get("name"), t.get("description"), t.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"tools[{i}].name", f"must name the function, got {name!r}")
        if desc is not None and not isinstance(desc, str):
            raise InvalidArgumentError(f"tools[{i}].description", f"must be a string, got {desc!r}")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgumentError(f"tools[{i}].parameters", f"must be a JSON schema object, got {params!r}")
        chat.append({"type": "function", "function": {"name": name, "description": desc or "", "parameters": params}})
        echo.append({"type": "function", "name": name, "description": desc, "parameters": params,
                     "strict": bool(t.get("strict", True))})
    return chat, echo


def _chat_tool_choice(choice: object) -> object:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidArgumentError("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "name": ...} '
                                              f"(ragkv serves function tools only), got {choice!r}")


def _chat_format(text: object) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat completions' response_format, the `text` the response echoes) from `text.format`."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise InvalidArgumentError("text", f"must be an object with a format, got {text!r}")
    fmt = text.get("format")
    if fmt is None:
        return None, {**text, "format": {"type": "text"}}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}, text
    if kind != "json_schema":
        raise InvalidArgumentError("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidArgumentError("text.format.schema", "must be a JSON schema object")
    name = fmt.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError("text.format.name", f"must be a string, got {name!r}")
    return {"type": "json_schema", "json_schema": {"name": name or "", "schema": fmt["schema"],
                                                   "strict": bool(fmt.get("strict"))}}, text


def _optional(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise InvalidArgumentError(name, f"must be {what}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Parsed:
    """A Responses request, read: the chat completions body it means, and what the response echoes."""

    chat: dict[str, Any]
    items: tuple[dict[str, Any], ...]  # the conversation's input: the previous response's, then this request's
    origins: tuple[str, ...]  # where each of `chat["messages"]` came from (error messages name it)
    echo: dict[str, Any]  # tools, tool_choice, text, instructions, ... as the response shows them
    store: bool
    previous_response_id: str | None


def parse_request(body: object, previous: tuple[dict[str, Any], ...] = ()) -> Parsed:
    """Read a Responses request; `previous` is its previous response's conversation.

    Raises:
        InvalidArgumentError: A field has the wrong type, or asks for what ragkv does not do.
    """
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise InvalidArgumentError(name, why)
    instructions = _optional(body, "instructions", str, "a string")
    store = _optional(body, "store", bool, "a boolean")
    metadata = _optional(body, "metadata", dict, "an object of string -> string")
    new = input_items(body.get("input"))
    if not new:
        raise InvalidArgumentError("input", "must hold at least one item")
    conversation = [("previous_response_id", i) for i in previous] + new
    messages, origins = to_messages(conversation, instructions)
    tools, echo_tools = _chat_tools(body.get("tools"))
    response_format, echo_text = _chat_format(body.get("text"))
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": messages,
        "tools": tools,
        "tool_choice": _chat_tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "max_completion_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "stream": body.get("stream"),
        "response_format": response_format,
        **{k: body[k] for k in _EXTRAS if k in body},
    }
    parallel = body.get("parallel_tool_calls")
    echo = {
        "instructions": instructions,
        "tools": echo_tools,
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True if parallel is None else parallel,
        "text": echo_text,
        "metadata": metadata or {},
    }
    return Parsed(chat, tuple(previous) + tuple(i for _, i in new), tuple(origins), echo,
                  True if store is None else store, _optional(body, "previous_response_id", str, "a response id"))


def renamed(exc: BaseException, origins: tuple[str, ...] = ()) -> BaseException:
    """An error naming a chat completions field, renamed to the Responses field it came from."""
    if not isinstance(exc, InvalidArgumentError):
        return exc
    field, prefix = exc.field, f"{exc.field}: "
    message = str(exc)[len(prefix):] if str(exc).startswith(prefix) else str(exc)
    m = re.match(r"^messages\[(\d+)\](.*)$", field)
    if m and int(m.group(1)) < len(origins):
        new = origins[int(m.group(1))] + ("" if origins[int(m.group(1))] == "previous_response_id" else m.group(2))
    else:
        new = field
        for pattern, repl in _RENAMES:
            if pattern.match(field):
                new = pattern.sub(repl, field)
                break
    return exc if new == field else InvalidArgumentError(new, message)


# ---- the response ----


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_body(stats: QueryStats) -> dict[str, Any]:
    u = stats.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []}


def _function_call(fc_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": fc_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _status(stats: QueryStats) -> str:
    return "incomplete" if stats.finish_reason is FinishReason.LENGTH else "completed"


def output_items(stats: QueryStats) -> list[dict[str, Any]]:
    """A finished answer's output items: its text as a message, then its function calls."""
    status = _status(stats)
    out = [_message(_id("msg"), stats.text, status)] if stats.text or not stats.tool_calls else []
    return out + [_function_call(_id("fc"), c.id, c.name, c.arguments, status) for c in stats.tool_calls]


class ResponsesApi:
    """The Responses routes, on an `OpenAIApi`'s checks, runner and error bodies."""

    def __init__(self, api: OpenAIApi, store: ResponseStore | None = None) -> None:
        self._api = api
        self.store = store if store is not None else ResponseStore()

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]

    def _error(self, exc: BaseException, method: str, caller: Caller = ANONYMOUS) -> JSONResponse:
        if isinstance(exc, UnknownResponseError):
            self._api.metrics.errors.labels(method, "NOT_FOUND").inc()
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.field,
                                           "code": "not_found"}}, status_code=404)
        return error_response(exc, method, self._api.metrics, caller)

    def _response(self, response_id: str, created: int, query: Query, parsed: Parsed, status: str,
                  output: list[dict[str, Any]], stats: QueryStats | None,
                  chunks: tuple[RetrievedChunk, ...] = (), snippet: int | None = None) -> dict[str, Any]:
        sampling = query.sampling
        body: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "model": query.collection, "output": output,
            "usage": None if stats is None else usage_body(stats),
            "previous_response_id": parsed.previous_response_id,
            **parsed.echo,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            # what the client set (null: none, the answer runs until the model stops)
            "max_output_tokens": sampling.max_new_tokens if query.length_limit is LengthLimit.MAX_TOKENS else None,
            "store": parsed.store,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "truncation": "disabled",
        }
        if stats is not None:
            body["ragkv"] = ragkv_extra(chunks, stats, snippet)
        return body

    async def _keep(self, tenant: str, parsed: Parsed, response: dict[str, Any]) -> None:
        """Store the response when asked (off the event loop: with a directory it is a file written
        and synced); the answer stands even when it cannot be kept."""
        if not parsed.store:
            return
        try:
            kept = await asyncio.to_thread(self.store.put, response["id"], tenant,
                                           parsed.items + tuple(response["output"]), response)
        except OSError as exc:
            log.error("response %s not stored: writing its file failed (%s)", response["id"], exc)
            return
        if not kept:
            log.warning("response %s not stored: its conversation is over %d bytes", response["id"],
                        self.store.max_entry_bytes)

    async def create(self, request: Request) -> Response:
        api = self._api
        arrived = time.perf_counter()
        cancel = threading.Event()
        caller = api.caller(request, METHOD)
        origins: tuple[str, ...] = ()
        try:
            body = await api.body(request)
            tenant = caller.tenant(cache_salt(body))
            previous: tuple[dict[str, Any], ...] = ()
            prev_id = body.get("previous_response_id") if isinstance(body, dict) else None
            if prev_id is not None:
                if not isinstance(prev_id, str):
                    raise InvalidArgumentError("previous_response_id", f"must be a response id, got {prev_id!r}")
                entry = self.store.get(prev_id, tenant)
                if entry is None:
                    raise UnknownResponseError(prev_id, "previous_response_id")
                caller.check_collection(str(entry.response.get("model", "")))  # its key's collections now
                previous = entry.items
            parsed = parse_request(body, previous)
            origins = parsed.origins
            if parsed.store and (size := ResponseStore.size_of(list(parsed.items))) > self.store.max_entry_bytes:
                raise InvalidArgumentError("previous_response_id" if previous else "input",
                                           f"the conversation is {size} bytes, more than a stored response may hold "
                                           f"({self.store.max_entry_bytes}); begin a new one, or send store=false")
            answer = await api.answer(parsed.chat, caller, arrived, cancel)
            query, snippet, stream = answer.query, answer.chat.options.snippet_chars, answer.chat.stream
            events, first = answer.events, answer.first
        except Exception as exc:
            cancel.set()
            return self._error(renamed(exc, origins), METHOD, caller)
        response_id, created = _id("resp"), int(time.time())
        if stream:
            return streaming(self._sse(events, first.chunks, query, parsed, snippet, response_id, created, tenant,
                                       cancel))
        try:
            stats = await last_stats(events)
        except Exception as exc:
            return self._error(exc, METHOD)
        finally:
            cancel.set()
        if stats is None:
            raise RuntimeError("the answer ended without stats: a bug")
        response = self._response(response_id, created, query, parsed, _status(stats), output_items(stats), stats,
                                  first.chunks, snippet)
        await self._keep(tenant, parsed, response)
        return JSONResponse(response)

    async def _sse(self, events: AsyncIterator[RunEvent], chunks: tuple[RetrievedChunk, ...], query: Query,
                   parsed: Parsed, snippet: int | None, response_id: str, created: int, tenant: str,
                   cancel: threading.Event) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, **fields, "sequence_number": seq}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"

        items: list[dict[str, Any]] = []  # the output items, in the order they were opened
        text: list[str] = []
        message: dict[str, Any] | None = None  # the open message item
        calls: dict[int, dict[str, Any]] = {}  # ToolCallDelta.index -> its function_call item
        current: dict[str, Any] | None = None  # the open function_call item

        def close_message(status: str) -> list[str]:
            nonlocal message
            if message is None:
                return []
            full, i, msg_id = "".join(text), items.index(message), message["id"]
            part = {"type": "output_text", "text": full, "annotations": []}
            message.update(_message(msg_id, full, status))
            message = None
            return [event("response.output_text.done", item_id=msg_id, output_index=i, content_index=0, text=full,
                          logprobs=[]),
                    event("response.content_part.done", item_id=msg_id, output_index=i, content_index=0, part=part),
                    event("response.output_item.done", output_index=i, item=items[i])]

        def close_call(status: str) -> list[str]:
            nonlocal current
            if current is None:
                return []
            item, i = current, items.index(current)
            current = None
            item["status"] = status
            return [event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                          name=item["name"], arguments=item["arguments"]),
                    event("response.output_item.done", output_index=i, item=item)]

        try:
            shell = self._response(response_id, created, query, parsed, "in_progress", [], None)
            yield event("response.created", response=shell)
            yield event("response.in_progress", response=shell)
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    if message is None:
                        for line in close_call("completed"):
                            yield line
                        message = _message(_id("msg"), "", "in_progress")
                        items.append(message)
                        i = len(items) - 1
                        yield event("response.output_item.added", output_index=i, item=dict(message))
                        yield event("response.content_part.added", item_id=message["id"], output_index=i,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text.append(ev.text)
                    yield event("response.output_text.delta", item_id=message["id"], output_index=items.index(message),
                                content_index=0, delta=ev.text, logprobs=[])
                elif isinstance(ev, ToolCallDelta):
                    if ev.id is not None:
                        for line in close_message("completed") + close_call("completed"):
                            yield line
                        current = _function_call(_id("fc"), ev.id, ev.name or "", "", "in_progress")
                        calls[ev.index] = current
                        items.append(current)
                        yield event("response.output_item.added", output_index=len(items) - 1, item=dict(current))
                    item = calls.get(ev.index)
                    if item is not None and ev.arguments:
                        item["arguments"] += ev.arguments
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=items.index(item), delta=ev.arguments)
                elif isinstance(ev, QueryStats):
                    status = _status(ev)
                    final = {i: c.arguments for i, c in enumerate(ev.tool_calls)}
                    if not items:  # an empty answer: still one (empty) message
                        message = _message(_id("msg"), "", "in_progress")
                        items.append(message)
                        yield event("response.output_item.added", output_index=0, item=dict(message))
                        yield event("response.content_part.added", item_id=message["id"], output_index=0,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    for i, c in calls.items():  # the parsed calls are the truth
                        c["arguments"] = final.get(i, c["arguments"])
                    for line in close_message(status) + close_call(status):
                        yield line
                    response = self._response(response_id, created, query, parsed, status, items, ev, chunks, snippet)
                    await self._keep(tenant, parsed, response)
                    yield event(f"response.{status}", response=response)
        except Exception as exc:  # headers are sent: the error goes in the stream, as OpenAI's does
            _, body, code = error_body(exc)
            self._api.metrics.errors.labels(METHOD, code.name).inc()
            self._api.metrics.requests.labels(code.name).inc()
            err = body["error"]
            yield event("error", code=err["code"], message=err["message"], param=err["param"])
            failed = self._response(response_id, created, query, parsed, "failed", items, None)
            failed["error"] = {"code": err["code"], "message": err["message"]}
            yield event("response.failed", response=failed)
        finally:
            cancel.set()
            await events.aclose()  # type: ignore[attr-defined]

    def _lookup(self, request: Request) -> tuple[Caller, str]:
        caller = self._api.caller(request, RETRIEVE)
        salt = request.query_params.get("cache_salt")
        return caller, caller.tenant(None if salt is None else cache_salt({"cache_salt": salt}))

    async def retrieve(self, request: Request) -> Response:
        caller = ANONYMOUS
        try:
            caller, tenant = self._lookup(request)
            response_id = request.path_params["response_id"]
            if request.query_params.get("stream") in ("true", "1"):
                raise InvalidArgumentError("stream", "a stored response is returned whole, not streamed")
            with self._api.admission.rpc():
                entry = self.store.get(response_id, tenant)
                if entry is None:
                    raise UnknownResponseError(response_id, None)
                # the key's collections now, not when it was stored (a key file changed since)
                caller.check_collection(str(entry.response.get("model", "")))
                return JSONResponse(entry.response)
        except Exception as exc:
            return self._error(exc, RETRIEVE, caller)

    async def delete(self, request: Request) -> Response:
        caller = ANONYMOUS
        try:
            caller, tenant = self._lookup(request)
            response_id = request.path_params["response_id"]
            with self._api.admission.rpc():
                if not self.store.delete(response_id, tenant):
                    raise UnknownResponseError(response_id, None)
                return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        except Exception as exc:
            return self._error(exc, RETRIEVE, caller)


def with_responses(api: OpenAIApi, settings: ServerSettings | None = None) -> Starlette:
    """`api`'s ASGI app with the Responses API's routes beside chat completions' (the app the
    server and the cluster's ingress serve), its stored responses as `settings` say (None: in
    memory, the default bounds); this module builds on openai_api, not the reverse."""
    store = ResponseStore() if settings is None else ResponseStore.from_settings(settings)
    api.app.router.routes.extend(ResponsesApi(api, store).routes())
    return api.app
