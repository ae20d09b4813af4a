"""What an answer must look like, and reading it back: structured output, tool calls, citations.

A request's `response_format`, `tools`/`tool_choice` and `citations` become two things:

- text in the prompt's question segment, after the chunks (`OutputSpec.before` before the
  question, `OutputSpec.after` after it), so a chunk's cached KV never depends on them;
- an llguidance grammar (`OutputSpec.grammar`) that the decode follows, so the answer
  always parses: JSON valid against the schema, tool calls valid against the tools'
  schemas, citations that can only name a retrieved chunk.

The tool-call format is the Hermes one that Qwen 2.5/3, SmolLM3 and Hermes models are
trained on, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallReader` reads it back from the streamed text, as OpenAI's streamed deltas.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.engine.constrain import GrammarError, GrammarLimitError, json_schema_grammar, lark_grammar
from ragkv.server.query import Query
from ragkv.server.status import InvalidArgumentError
from ragkv.types import (
    ChatRole,
    ChatTurn,
    Citation,
    ResponseFormatKind,
    RetrievedChunk,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
)

TOOL_OPEN = "<tool_call>\n"
TOOL_CLOSE = "\n</tool_call>"
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_SOURCE_WORDS = 8  # words of a chunk shown in the numbered source list of a cited answer


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How one request's answer is asked for and held to its shape."""

    grammar: str | None  # llguidance grammar of the answer; None = free text
    before: str  # prompt text before the question (tools, output format, sources)
    after: str  # prompt text after the question (the agent's tool calls and results so far)
    reads_tool_calls: bool  # the answer may hold tool calls (ToolCallReader reads them)
    closing: bool = False  # the answer is always structured (JSON or calls): close it before the budget ends


def output_spec(params: Query, chunks: Sequence[RetrievedChunk]) -> OutputSpec:
    """The prompt text and grammar for a request.

    The grammar is `start: calls | answer`: tool calls (when tools may be called), or an
    answer that is JSON (a response format), cited text (citations), or any text not
    beginning with "<" (only when it must be told apart from calls).

    Raises:
        InvalidArgumentError: A schema (the response format's or a tool's) does not compile;
            the grammar is validated once, and a schema is blamed only when it fails.
    """
    before: list[str] = []
    choice, fmt = params.tool_choice, params.response_format
    calls_allowed = bool(params.tools) and choice.mode is not ToolChoiceMode.NONE
    must_call = calls_allowed and choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION)
    if params.tools:
        before.append(tools_text(params.tools, choice))
    answer: str | None = None  # the lark rule of an answer that is not tool calls; None = free text
    if fmt.kind is not ResponseFormatKind.TEXT:
        schema = dict(fmt.schema or {}) if fmt.kind is ResponseFormatKind.JSON_SCHEMA else {"type": "object"}
        shown = "" if fmt.kind is ResponseFormatKind.JSON_OBJECT else f" valid against this JSON schema: {json.dumps(schema)}"
        before.append(f"Reply with only a JSON object{shown}.")
        answer = f"%json {json.dumps(_compact(schema))}"
    elif params.citations:
        before.append(sources_text(chunks))
        first = "/[^<\\[][^\\[]*/" if calls_allowed else "/[^\\[]+/"  # text not taken for a call
        answer = f"{first} (CITE TEXT?)* | (CITE TEXT?)+\nTEXT: /[^\\[]+/\nCITE: " + " | ".join(
            json.dumps(f"[{i}]") for i in range(1, len(chunks) + 1))
    elif calls_allowed:
        answer = "/[^<](.|\\n)*/"
    rules = []
    if calls_allowed:
        rules.append("start: calls" if must_call else "start: calls | answer")
        rules += _call_rules(params.tools, choice, params.parallel_tool_calls)
    elif answer is not None:
        rules.append("start: answer")
    if answer is not None and not must_call:
        rules.append(f"answer: {answer}")
    try:
        grammar = lark_grammar("\n".join(rules) + "\n") if rules else None
    except GrammarLimitError as exc:  # each schema fits, their combination does not: the client's to shrink
        raise InvalidArgumentError("tools" if params.tools else "response_format", str(exc)) from None
    except GrammarError as exc:
        _blame_schema(params)  # a schema of the request's: INVALID_ARGUMENT naming it
        raise RuntimeError(f"the answer's grammar does not compile: {exc} (a bug)") from exc
    after = agent_turns_text(params.agent_turns)
    closing = must_call or fmt.kind is not ResponseFormatKind.TEXT  # no free-text alternative
    return OutputSpec(grammar, "\n\n".join(before) + ("\n\n" if before else ""), after, calls_allowed, closing)


def tools_text(tools: Sequence[Tool], choice: ToolChoice) -> str:
    """The tools and how to call them, for the prompt."""
    lines = ["You can call these tools, described as JSON schemas:", "<tools>"]
    lines += [json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}}) for t in tools]
    lines += ["</tools>", "To call a tool, reply with one block per call:",
              f'{TOOL_OPEN}{{"name": <tool name>, "arguments": <arguments object>}}{TOOL_CLOSE}']
    lines.append({
        ToolChoiceMode.AUTO: "Call a tool when you need its result; otherwise answer directly.",
        ToolChoiceMode.NONE: "Do not call any tool now: answer directly.",
        ToolChoiceMode.REQUIRED: "You must call a tool now.",
        ToolChoiceMode.FUNCTION: f"You must call the tool {choice.name} now.",
    }[choice.mode])
    return "\n".join(lines)


def call_text(call: ToolCall) -> str:
    """One tool call in the format the model writes it."""
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        arguments = call.arguments  # a client-made call with unparsable arguments: shown as given
    return f"{TOOL_OPEN}{json.dumps({'name': call.name, 'arguments': arguments})}{TOOL_CLOSE}"


def turn_text(turn: ChatTurn) -> str:
    """A turn's text as the prompt shows it: an assistant's calls in the call format, a tool's
    result in <tool_response> tags."""
    if turn.role is ChatRole.TOOL:
        return f"<tool_response>\n{turn.content.strip()}\n</tool_response>"
    parts = [turn.content.strip()] if turn.content.strip() else []
    return "\n".join(parts + [call_text(c) for c in turn.tool_calls])


def agent_turns_text(turns: Sequence[ChatTurn]) -> str:
    """The tool calls made for this question and their results, after the question."""
    if not turns:
        return ""
    body = "\n".join(turn_text(t) for t in turns)
    return f"\n\nYour tool calls for this question so far, and their results:\n{body}\n"


def sources_text(chunks: Sequence[RetrievedChunk]) -> str:
    """The numbered source list of a cited answer: each chunk by its first words.

    The chunks themselves cannot carry their numbers (their cached KV would change with
    them), so the list names them in the order they stand in the context.
    """
    lines = ["The context's passages, numbered in the order they appear:"]
    for i, c in enumerate(chunks, 1):
        words = c.text.split()
        lines.append(f"[{i}] {' '.join(words[:_SOURCE_WORDS])}{' ...' if len(words) > _SOURCE_WORDS else ''}")
    lines.append("After each fact you use, cite its passage as [n].")
    return "\n".join(lines)


def _call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """One call: `{"name": <a tool>, "arguments": <that tool's schema>}`."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters) or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _blame_schema(params: Query) -> None:
    """Raise InvalidArgumentError naming the request's first schema that does not compile
    alone (the response format's, or a tool's); return if each one does."""
    fmt = params.response_format
    named = [(f"tools[{i}].function.parameters", dict(t.parameters) or {"type": "object"})
             for i, t in enumerate(params.tools)]
    if fmt.kind is ResponseFormatKind.JSON_SCHEMA:
        named.insert(0, ("response_format.json_schema", dict(fmt.schema or {})))
    for where, schema in named:
        try:
            json_schema_grammar(schema)
        except GrammarError as exc:
            raise InvalidArgumentError(where, str(exc)) from None


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema closed (`_closed`), with llguidance told to emit compact JSON (no free
    whitespace for a weak model to loop in)."""
    return {**_closed(schema), "x-guidance": {"whitespace_flexible": False}}


def _closed(schema: Any) -> Any:
    """`additionalProperties: false` on every object schema that names its properties and
    leaves the rest open: the output still validates against the schema as given, and holds
    only the properties it names (what a function's caller expects)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k not in ("const", "enum", "default", "examples") else v for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_rules(tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> list[str]:
    """Lark rules of `calls`: one call, or several separated by a newline."""
    if choice.mode is ToolChoiceMode.FUNCTION:
        tools, parallel = [t for t in tools if t.name == choice.name], False
    return ["calls: call+" if parallel else "calls: call",
            f"call: {json.dumps(TOOL_OPEN)} %json {json.dumps(_compact(_call_schema(tools)))} {json.dumps(TOOL_CLOSE)}"]


def find_citations(text: str, chunks: Sequence[RetrievedChunk]) -> tuple[Citation, ...]:
    """The `[n]` markers of a cited answer, each with the chunk it names and the text it marks."""
    out: list[Citation] = []
    sentence_start = 0
    for m in re.finditer(r"\[(\d+)\]", text):
        n = int(m.group(1))
        if not 1 <= n <= len(chunks):
            raise RuntimeError(f"citation [{n}] names no retrieved chunk: the grammar was not applied (a bug)")
        ends = [text.rfind(p, sentence_start, m.start()) for p in (". ", "! ", "? ", "\n")]
        cut = max(ends)
        begin = cut + 2 if cut >= 0 and text[cut] != "\n" else (cut + 1 if cut >= 0 else sentence_start)
        out.append(Citation(n, chunks[n - 1].chunk_id, m.start(), m.end(), max(begin, sentence_start)))
        sentence_start = m.end()
    return tuple(out)


class ToolCallReader:
    """Splits an answer's streamed text into content and tool calls.

    With tools allowed, an answer that begins with `<tool_call>` is calls (the grammar
    admits nothing else after it); any other answer is content. Pieces of arguments are
    held back only as long as they could be the end of the call.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._calls_mode: bool | None = None  # undecided until the first character
        self._pos = 0  # parsed up to here in _buf
        self._args_at: int | None = None  # where the current call's arguments begin
        self._sent = 0  # characters of the current call's arguments already streamed
        self.calls: list[ToolCall] = []
        self._current: tuple[str, str] | None = None  # (id, name) of the call being read

    def feed(self, piece: str) -> list[str | ToolCallDelta]:
        """The content pieces and call deltas the new text completes."""
        if self._calls_mode is None:
            head = (self._buf + piece).lstrip()
            if not head:
                self._buf += piece
                return []
            self._calls_mode = head.startswith("<")
            piece, self._buf = self._buf + piece, ""
        if not self._calls_mode:
            return [piece] if piece else []
        self._buf += piece
        return self._parse(final=False)

    def finish(self) -> list[str | ToolCallDelta]:
        """What is left at the end of the answer."""
        if self._calls_mode is None:
            return [self._buf] if self._buf else []
        return self._parse(final=True) if self._calls_mode else []

    def _parse(self, final: bool) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        while True:
            if self._args_at is None:  # between calls: expect the next call's head
                rest = self._buf[self._pos:]
                start = rest.find(TOOL_OPEN)
                if start < 0:
                    return out
                m = _CALL_HEAD.match(rest, start + len(TOOL_OPEN))
                if m is None:
                    return out
                name = json.loads(f'"{m.group(1)}"')
                self._current = (f"call_{uuid.uuid4().hex[:24]}", name)
                self._args_at, self._sent = self._pos + m.end(), 0
                out.append(ToolCallDelta(len(self.calls), self._current[0], name, ""))
            end = self._buf.find(TOOL_CLOSE, self._args_at)
            tail = "}" + TOOL_CLOSE
            if end >= 0:
                args = self._buf[self._args_at:end].rstrip()
                args = args[:-1] if args.endswith("}") else args  # the call object's own closing brace
            else:
                avail = self._buf[self._args_at:]
                args = avail if final else avail[:max(0, len(avail) - len(tail))]
            if len(args) > self._sent:
                out.append(ToolCallDelta(len(self.calls), None, None, args[self._sent:]))
                self._sent = len(args)
            if end < 0:
                if final and self._current is not None:  # cut short (max tokens): the call as far as it got
                    self.calls.append(ToolCall(self._current[0], self._current[1], args))
                    self._current = None
                return out
            assert self._current is not None
            self.calls.append(ToolCall(self._current[0], self._current[1], args.strip()))
            self._pos, self._args_at, self._current = end + len(TOOL_CLOSE), None, None
