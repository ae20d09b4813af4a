"""Request validation: wire options -> a `Query`, or InvalidArgumentError naming the field.

The one place a query's shapes meet: the wire's message (or the HTTP API's body), read
into `ragkv.types.QueryOptions`, becomes a frozen `server.query.Query` with every default
resolved (the backend's preparation builds the engine's request from it).

Runs on the event loop before any queueing, so bad input costs nothing and every
rejection says which field was wrong and what is allowed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.engine.decode import SamplingParams
from ragkv.engine.kv.retention import MAX_PRIORITY
from ragkv.server.query import Query
from ragkv.server.status import InvalidArgumentError
from ragkv.types import (
    DEFAULT_COLLECTION,
    ChatRole,
    ChatTurn,
    FilterOp,
    LengthLimit,
    MetadataFilter,
    Mode,
    QueryOptions,
    ResponseFormatKind,
    SearchMode,
    ToolChoiceMode,
)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds and defaults applied to every request."""

    max_question_chars: int = 4096  # characters
    default_top_k: int = 4  # chunks
    max_top_k: int = 32  # chunks
    default_mode: Mode = Mode.BLEND  # mode when the request leaves it unspecified (ServerSettings.default_mode)
    default_recompute_ratio: float = 0.2  # fraction of chunk tokens (docs/quality.md, issue 28)
    # answer length of a request that sets none; None = until the model stops, up to the context
    # left (`Pipeline.prepare` knows it) and max_new_tokens, as OpenAI's API and vLLM do
    default_max_new_tokens: int | None = None  # tokens
    max_new_tokens: int = 1024  # tokens: the longest answer
    max_stop_strings: int = 8  # stop strings per request
    max_stop_chars: int = 64  # characters per stop string
    max_snippet_chars: int = 1_000_000  # characters
    max_filters: int = 16  # metadata filters per request
    max_filter_chars: int = 1024  # characters of one filter's key or value (as JSON)
    max_history_turns: int = 1024  # earlier conversation turns per request
    # characters of all earlier turns together: a guard on request size only; the limit that
    # counts is the model's context in tokens, checked once the prompt is tokenized (Pipeline.prepare)
    max_history_chars: int = 2_000_000
    max_system_prompt_chars: int = 16384  # characters of a request's system message
    max_tools: int = 64  # tools per request
    max_tools_chars: int = 65536  # characters of all tool definitions and the response schema, as JSON
    max_cache_salt_chars: int = 256  # characters of a request's cache_salt (the HTTP API's bound too)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _turns(turns: Sequence[ChatTurn], where: str) -> None:
    for i, turn in enumerate(turns):
        if not isinstance(turn, ChatTurn):
            raise InvalidArgumentError(f"{where}[{i}]", f"must be a chat turn, got {turn!r}")
        if turn.role is ChatRole.TOOL and not turn.tool_call_id:
            raise InvalidArgumentError(f"{where}[{i}].tool_call_id", "a tool turn must name the call it answers")
        if not turn.content.strip() and not turn.tool_calls and turn.role is not ChatRole.TOOL:
            raise InvalidArgumentError(f"{where}[{i}]", "must have text or tool calls")


def _tenancy(options: QueryOptions, limits: RequestLimits) -> None:
    """`cache_salt` and `retain_seconds`: the salt's length, the seconds' sign (their upper
    bound, --kv-tree-retain-max-s, is the backend's to check: it knows its KV tree)."""
    salt, retain = options.cache_salt, options.retain_seconds
    if salt is not None and not 0 < len(salt) <= limits.max_cache_salt_chars:
        raise InvalidArgumentError("cache_salt", f"must have 1..{limits.max_cache_salt_chars} characters, "
                                                 f"got {len(salt)}")
    if retain is not None and not (math.isfinite(retain) and retain >= 0):
        raise InvalidArgumentError("retain_seconds", f"must be a number of seconds >= 0, got {retain!r}")
    check_priority(options.retain_priority)


def check_priority(priority: object) -> None:
    """`retain_priority`: None, or an integer in [-MAX_PRIORITY, MAX_PRIORITY]."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        raise InvalidArgumentError("retain_priority", f"must be an integer in -{MAX_PRIORITY}..{MAX_PRIORITY}, "
                                                      f"got {priority!r}")


def _output(options: QueryOptions, limits: RequestLimits) -> None:
    """Tools, tool_choice, response_format and citations: each well formed, and together possible."""
    tools = tuple(options.tools)
    if len(tools) > limits.max_tools:
        raise InvalidArgumentError("tools", f"at most {limits.max_tools} tools, got {len(tools)}")
    names = set()
    for i, t in enumerate(tools):
        if not _TOOL_NAME.fullmatch(t.name or ""):
            raise InvalidArgumentError(f"tools[{i}].function.name", f"must match [A-Za-z0-9_-]{{1,64}}, got {t.name!r}")
        if t.name in names:
            raise InvalidArgumentError(f"tools[{i}].function.name", f"{t.name!r} is defined twice")
        names.add(t.name)
        if not isinstance(t.parameters, dict):
            raise InvalidArgumentError(f"tools[{i}].function.parameters", "must be a JSON schema object")
    fmt = options.response_format
    # everything of them that reaches the prompt counts: names, descriptions and schemas
    size = len(json.dumps([[t.name, t.description, t.parameters] for t in tools] + [fmt.name, fmt.schema],
                          default=str))
    if size > limits.max_tools_chars:
        raise InvalidArgumentError("tools", f"tool definitions (names, descriptions, schemas) and the response "
                                            f"schema are {size} characters as JSON, the limit is "
                                            f"{limits.max_tools_chars}")
    choice = options.tool_choice
    if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION) and not tools:
        raise InvalidArgumentError("tool_choice", f"{choice.mode.value!r} needs tools to call; none were given")
    if choice.mode is ToolChoiceMode.FUNCTION and choice.name not in names:
        raise InvalidArgumentError("tool_choice", f"names {choice.name!r}, which is not among the tools "
                                                  f"({', '.join(sorted(names))})")
    if fmt.kind is ResponseFormatKind.JSON_SCHEMA and not isinstance(fmt.schema, dict):
        raise InvalidArgumentError("response_format.json_schema.schema", "must be a JSON schema object")
    if options.citations and fmt.kind is not ResponseFormatKind.TEXT:
        raise InvalidArgumentError("citations", "apply to text answers, not to a JSON response_format")


def _question(question: str, limits: RequestLimits) -> str:
    if not question.strip():
        raise InvalidArgumentError("question", "must not be empty")
    if len(question) > limits.max_question_chars:
        raise InvalidArgumentError(
            "question", f"is {len(question)} characters, the limit is {limits.max_question_chars}"
        )
    return question


def _top_k(top_k: int | None, limits: RequestLimits) -> int:
    k = limits.default_top_k if top_k is None else top_k
    if not 1 <= k <= limits.max_top_k:
        raise InvalidArgumentError("top_k", f"must be in [1, {limits.max_top_k}], got {k}")
    return k


def _snippet(snippet_chars: int | None, limits: RequestLimits) -> None:
    if snippet_chars is not None and not 0 <= snippet_chars <= limits.max_snippet_chars:
        raise InvalidArgumentError(
            "snippet_chars", f"must be in [0, {limits.max_snippet_chars}], got {snippet_chars}"
        )


def _search(options: QueryOptions, limits: RequestLimits) -> tuple[SearchMode | None, tuple[MetadataFilter, ...]]:
    mode = options.search_mode
    if mode is not None and not isinstance(mode, SearchMode):
        allowed = ", ".join(m.value for m in SearchMode)
        raise InvalidArgumentError("search_mode", f"must be one of {allowed}, got {mode!r}")
    filters = tuple(options.filters)
    if len(filters) > limits.max_filters:
        raise InvalidArgumentError("filters", f"at most {limits.max_filters} filters, got {len(filters)}")
    for i, f in enumerate(filters):
        size = max(len(f.key), len(json.dumps(f.value, default=str)))
        if size > limits.max_filter_chars:
            raise InvalidArgumentError(f"filters[{i}]", f"key or value is {size} characters, the limit is "
                                                        f"{limits.max_filter_chars}")
        if f.op is FilterOp.PREFIX and not f.value:
            raise InvalidArgumentError(f"filters[{i}]", f"prefix filter on {f.key!r} needs a non-empty prefix")
    return mode, filters


def validate_retrieve(question: str, options: QueryOptions, limits: RequestLimits
                      ) -> tuple[str, str, int, SearchMode | None, tuple[MetadataFilter, ...]]:
    """Check a Retrieve request.

    Returns:
        (question, collection, top_k, search mode, filters).

    Raises:
        InvalidArgumentError: A field is out of range.
    """
    _snippet(options.snippet_chars, limits)
    return (_question(question, limits), options.collection or DEFAULT_COLLECTION, _top_k(options.top_k, limits),
            *_search(options, limits))


def validate_query(
    question: str, options: QueryOptions, limits: RequestLimits, modes: frozenset[Mode]
) -> Query:
    """Check a Query request and resolve its defaults: the request the server prepares.

    Args:
        question: The question text.
        options: The options as read from the wire (None = default).
        limits: Bounds and defaults.
        modes: Modes the backend can serve.

    Raises:
        InvalidArgumentError: A field is out of range or names an unsupported mode.
    """
    question = _question(question, limits)
    top_k = _top_k(options.top_k, limits)
    _snippet(options.snippet_chars, limits)
    search_mode, filters = _search(options, limits)
    mode = options.mode or limits.default_mode
    if options.mode is None and mode not in modes and Mode.FULL in modes:
        mode = Mode.FULL  # the model serves fewer modes than the default (a hybrid: FULL only)
    if mode not in modes:
        allowed = ", ".join(sorted(m.value for m in modes))
        raise InvalidArgumentError("mode", f"{mode.value!r} is not served here (allowed: {allowed})")
    ratio = limits.default_recompute_ratio if options.recompute_ratio is None else options.recompute_ratio
    if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
        raise InvalidArgumentError("recompute_ratio", f"must be in [0, 1], got {ratio}")
    fidelity = options.fidelity_kl
    if fidelity is not None:
        if not (math.isfinite(fidelity) and fidelity > 0.0):
            raise InvalidArgumentError("fidelity_kl", f"must be a KL in nats > 0 (e.g. 0.01), got {fidelity}")
        if options.recompute_ratio is not None:
            raise InvalidArgumentError("fidelity_kl", "give recompute_ratio or fidelity_kl, not both: the target "
                                                      "chooses the ratio")
        if mode not in (Mode.BLEND, Mode.FOCUS):
            raise InvalidArgumentError("fidelity_kl", f"chooses blend's recompute ratio; mode {mode.value!r} "
                                                      "has none (use blend or focus)")
    temperature = options.temperature
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 10.0):
        raise InvalidArgumentError("sampling.temperature", f"must be in [0, 10], got {temperature}")
    top_p = 1.0 if options.top_p is None else options.top_p
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidArgumentError("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if options.max_new_tokens is not None:
        max_new, length_limit = options.max_new_tokens, LengthLimit.MAX_TOKENS
    elif limits.default_max_new_tokens is not None:
        max_new, length_limit = limits.default_max_new_tokens, LengthLimit.SERVER_DEFAULT
    else:  # the context left may bound it further, once the prompt is known
        max_new, length_limit = limits.max_new_tokens, LengthLimit.SERVER_CAP
    if not 1 <= max_new <= limits.max_new_tokens:
        raise InvalidArgumentError("max_new_tokens", f"must be in [1, {limits.max_new_tokens}], got {max_new}")
    if len(options.stop) > limits.max_stop_strings:
        raise InvalidArgumentError("stop", f"at most {limits.max_stop_strings} strings, got {len(options.stop)}")
    for s in options.stop:
        if not s or len(s) > limits.max_stop_chars:
            raise InvalidArgumentError("stop", f"each must have 1..{limits.max_stop_chars} characters, got {s!r}")
    history, agent = tuple(options.history), tuple(options.agent_turns)
    if len(history) + len(agent) > limits.max_history_turns:
        raise InvalidArgumentError("history", f"at most {limits.max_history_turns} turns, got {len(history) + len(agent)}")
    _turns(history, "history")
    _turns(agent, "agent_turns")
    for i, turn in enumerate(agent):
        if turn.role is ChatRole.USER:
            raise InvalidArgumentError(f"agent_turns[{i}]", "turns after the question are the assistant's or tools'")
    _output(options, limits)
    _tenancy(options, limits)
    history_chars = sum(len(t.content) + sum(len(c.arguments) for c in t.tool_calls) for t in history + agent)
    if history_chars > limits.max_history_chars:
        raise InvalidArgumentError("history", f"is {history_chars} characters, the limit is {limits.max_history_chars}")
    system = options.system_prompt
    if system is not None and len(system) > limits.max_system_prompt_chars:
        raise InvalidArgumentError("system_prompt", f"is {len(system)} characters, the limit is "
                                                    f"{limits.max_system_prompt_chars}")
    return Query(
        question=question,
        collection=options.collection or DEFAULT_COLLECTION,
        top_k=top_k,
        mode=mode,
        recompute_ratio=float(ratio),
        recompute_ratio_set=options.recompute_ratio is not None,
        fidelity_kl=None if fidelity is None else float(fidelity),
        sampling=SamplingParams(max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p),
                                seed=options.seed, stop=tuple(options.stop)),
        length_limit=length_limit,
        search_mode=search_mode,
        filters=filters,
        history=history,
        system_prompt=system,
        agent_turns=agent,
        response_format=options.response_format,
        tools=tuple(options.tools),
        tool_choice=options.tool_choice,
        parallel_tool_calls=options.parallel_tool_calls,
        citations=options.citations,
        retain_seconds=None if options.retain_seconds is None else float(options.retain_seconds),
        retain_priority=options.retain_priority or 0,
    )
