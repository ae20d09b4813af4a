"""The OpenAI-compatible HTTP API's request side: a chat completion's JSON body read into
the question and `QueryOptions` that `server.validation.validate_query` takes.

`model` names the collection; ragkv's own options (mode, top_k, recompute_ratio, fidelity_kl,
search_mode, filters, snippet_chars, citations, cache_salt, retain_seconds,
retain_priority) ride as extra body fields (the `openai` client's `extra_body`). `tools`,
`tool_choice`, `parallel_tool_calls` and `response_format` are OpenAI's. Here each field's
type is checked and what ragkv does not do is refused; the bounds are validation's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ragkv.server.status import InvalidArgumentError
from ragkv.types import (
    ChatRole,
    ChatTurn,
    MetadataFilter,
    Mode,
    QueryOptions,
    ResponseFormat,
    ResponseFormatKind,
    SearchMode,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)

_SYSTEM_ROLES = ("system", "developer")
MAX_SALT_CHARS = 256  # characters of a request's cache_salt (RequestLimits.max_cache_salt_chars' default)


@dataclass(frozen=True, slots=True)
class ChatBody:
    """A chat completion's body as read: what validation takes, and how the answer goes back."""

    question: str
    options: QueryOptions  # the collection is `model`; cache_salt and the retention extras ride here too
    stream: bool  # server-sent events
    include_usage: bool  # a last streamed chunk with the usage (stream_options)


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


def parse_chat(body: object) -> ChatBody:
    """Read a chat completion request's body (its types and what ragkv does not do; the bounds
    are `validate_query`'s).

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
    retain = _field(body, "retain_seconds", (int, float), "a number of seconds")
    options = QueryOptions(
        collection=model,
        top_k=top_k,
        mode=_enum(body, "mode", Mode),
        recompute_ratio=_field(body, "recompute_ratio", (int, float), "a number"),
        fidelity_kl=_field(body, "fidelity_kl", (int, float), "a number (nats)"),
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
        cache_salt=cache_salt(body),
        retain_seconds=None if retain is None else float(retain),
        retain_priority=body.get("retain_priority"),  # an integer; validation says which
    )
    return ChatBody(question, options, stream, bool(stream_options.get("include_usage")))


def cache_salt(body: object) -> str | None:
    """The request's `cache_salt` (vLLM's field): its KV-tree paths are shared only with requests
    of the same key giving the same salt."""
    salt = _field(body, "cache_salt", (str,), "a string") if isinstance(body, dict) else None
    if salt is not None and not 0 < len(salt) <= MAX_SALT_CHARS:
        raise InvalidArgumentError("cache_salt", f"must have 1..{MAX_SALT_CHARS} characters, got {len(salt)}")
    return salt
