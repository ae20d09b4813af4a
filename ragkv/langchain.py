"""LangChain adapters: `RagKVChatModel` wraps `Query`, `RagKVRetriever` wraps `Retrieve`.

    from ragkv.langchain import RagKVChatModel, RagKVRetriever

    llm = RagKVChatModel(target="localhost:50051", mode="blend", top_k=4)
    llm.invoke("Who wrote it?").response_metadata["chunk_ids"]
    RagKVRetriever(target="localhost:50051", top_k=3).invoke("Who wrote it?")

This module needs the `langchain` extra (langchain-core only); `import ragkv` never
imports it. It talks to a server through `ragkv.client` alone and knows nothing of
the engine, the KV store or the retriever behind it.

Which text is sent as the question: the last human message's text (it is also what the
server embeds for retrieval). `history_messages` > 0 sends that many earlier messages
as the request's chat history, which the server places after the chunks and before the
question. The AI tool calls and tool results after the question are always sent (an
agent's loop needs them). System messages are sent as the request's system prompt: an
index has its own (`ragkv index --system-prompt`, the shared KV prefix every chunk was
prefilled after), and another one (an agent's own instructions) is served in front of the
chunks, their KV moved after it and blended (`response_metadata["system_prompt"]` says
how), unless the server runs `--system-prompt-policy strict`.

Agents: `bind_tools` (tool_choice "auto", "none", "any"/"required", a tool's name) and
`with_structured_output` (methods json_schema, function_calling, json_mode) are served
by the server's constrained decoding, so a call always parses against its schema.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any

import grpc
from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForLLMRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils import from_env, secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from ragkv.client import AsyncRagClient, RagClient
from ragkv.errors import RagKVError
from ragkv.retry import RetryPolicy
from ragkv.types import (
    ChatRole,
    ChatTurn,
    MetadataFilter,
    Mode,
    QueryStats,
    RetrievedChunk,
    SearchMode,
    ToolCall,
    ToolCallDelta,
)

__all__ = ["RagKVChatModel", "RagKVRetriever", "RagKVServerError", "call_tools_first"]

_PROVIDER = "ragkv"
# Per-call keyword arguments `invoke`/`bind` may override, by field name.
_QUERY_OVERRIDES = frozenset(
    {"collection", "top_k", "mode", "recompute_ratio", "fidelity_kl", "temperature", "top_p", "seed", "max_tokens",
     "search_mode", "filters", "citations", "tools", "tool_choice", "parallel_tool_calls", "response_format"}
)
_NOT_FIELDS = {"tools": (), "tool_choice": None, "parallel_tool_calls": True, "response_format": None}  # bind-only
# Keywords LangChain itself may pass down to _stream; they are not ours to act on.
_LANGCHAIN_KWARGS = frozenset({"model", "stream", "ls_structured_output_format"})


class RagKVServerError(RagKVError):
    """The ragkv server answered a call with an error status.

    Attributes:
        code: The gRPC status code (NOT_FOUND for an unknown collection,
            INVALID_ARGUMENT for a bad parameter, UNAVAILABLE when unreachable, ...).
        details: The server's message.
        method: The RPC that failed ("Query" or "Retrieve").
    """

    def __init__(self, method: str, target: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"ragkv {method} at {target} failed with {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


def _server_error(exc: grpc.RpcError, method: str, target: str) -> RagKVServerError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return RagKVServerError(method, target, code, details or "(no details)")


class _Connection(BaseModel):
    """Where the server is and how to reach it; owns the lazily created clients.

    A sync RagClient is made on first use and shared by threads (gRPC channels are
    thread-safe). An AsyncRagClient is bound to the event loop it was made in, so one
    is kept per running loop and dropped with the loop.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    target: str = Field(default_factory=from_env("RAGKV_ADDR", default="localhost:50051"))
    """Server "host:port" (default $RAGKV_ADDR, else localhost:50051)."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("RAGKV_AUTH_TOKEN", default=None))
    """Bearer token of a server that requires one (default $RAGKV_AUTH_TOKEN)."""
    tls: bool = False
    """Connect with TLS (system roots unless root_certificates is given)."""
    root_certificates: str | None = None
    """Path of the PEM CA certificate that signed the server's certificate."""
    insecure: bool = False
    """Send api_key in plaintext to a host that is not this machine (a network you trust)."""
    timeout: float | None = Field(default=None, gt=0)
    """Deadline of one call in seconds, a whole Query stream included; None = 120."""
    max_retries: int | None = Field(default=None, ge=0)
    """Retries of a call the server answered UNAVAILABLE; None = the SDK's policy (3)."""

    _sync_client: RagClient | None = PrivateAttr(default=None)
    _async_clients: weakref.WeakKeyDictionary = PrivateAttr(default_factory=weakref.WeakKeyDictionary)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def _client_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "token": self.api_key.get_secret_value() if self.api_key else None,
            "tls": self.tls,
            "root_certificates": self.root_certificates,
            "insecure": self.insecure,
        }
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        if self.max_retries is not None:
            kwargs["retry"] = RetryPolicy(max_attempts=self.max_retries + 1)
        return kwargs

    def _client(self) -> RagClient:
        with self._lock:
            if self._sync_client is None:
                self._sync_client = RagClient(self.target, **self._client_kwargs())
            return self._sync_client

    def _aclient(self) -> AsyncRagClient:
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            client = AsyncRagClient(self.target, **self._client_kwargs())
            self._async_clients[loop] = client
        return client

    def close(self) -> None:
        """Close the blocking client's channel (a later call opens a new one)."""
        with self._lock:
            client, self._sync_client = self._sync_client, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        """Close the asyncio client of the running event loop."""
        client = self._async_clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()


def _last_human(messages: Sequence[BaseMessage]) -> int:
    last = next((i for i in range(len(messages) - 1, -1, -1) if isinstance(messages[i], HumanMessage)), None)
    if last is None:
        kinds = [m.type for m in messages]
        raise ValueError(f"RagKVChatModel needs a human message to ask; got messages of types {kinds}")
    return last


def question_from_messages(messages: Sequence[BaseMessage]) -> str:
    """The question sent to Query: the last human message's text.

    Raises:
        ValueError: No human message with text.
    """
    question = messages[_last_human(messages)].text.strip()
    if not question:
        raise ValueError("the last human message has no text to ask")
    return question


def _turn(m: BaseMessage) -> ChatTurn | None:
    """A human, AI (text and tool calls) or tool message as a chat turn; None for others and empty ones."""
    if isinstance(m, ToolMessage):
        return ChatTurn(ChatRole.TOOL, m.text.strip() or "(no output)", tool_call_id=m.tool_call_id)
    if isinstance(m, AIMessage):
        calls = tuple(ToolCall(c.get("id") or f"call_{i}", c["name"], json.dumps(c.get("args") or {}))
                      for i, c in enumerate(m.tool_calls))
        return ChatTurn(ChatRole.ASSISTANT, m.text.strip(), calls) if m.text.strip() or calls else None
    if isinstance(m, HumanMessage) and m.text.strip():
        return ChatTurn(ChatRole.USER, m.text.strip())
    return None


def history_from_messages(messages: Sequence[BaseMessage], history_messages: int) -> tuple[ChatTurn, ...]:
    """The last `history_messages` human/AI/tool messages before the question, as the request's history."""
    if history_messages <= 0:
        return ()
    earlier = [t for m in messages[:_last_human(messages)] if (t := _turn(m)) is not None]
    return tuple(earlier[-history_messages:])


def agent_turns_from_messages(messages: Sequence[BaseMessage]) -> tuple[ChatTurn, ...]:
    """The AI tool calls and tool results after the question (an agent's loop so far)."""
    return tuple(t for m in messages[_last_human(messages) + 1:] if (t := _turn(m)) is not None
                 and t.role is not ChatRole.USER)


def system_prompt_from_messages(messages: Sequence[BaseMessage]) -> str | None:
    """The system messages' text (joined by blank lines), or None when there is none."""
    texts = [m.text.strip() for m in messages if isinstance(m, SystemMessage) and m.text.strip()]
    return "\n\n".join(texts) if texts else None


def _chunk_metadata(chunks: Sequence[RetrievedChunk], text_chars: int) -> dict[str, Any]:
    entries = []
    for c in chunks:
        entry: dict[str, Any] = {
            "chunk_id": c.chunk_id,
            "score": c.score,
            "kv_tier": c.kv_tier.value if c.kv_tier else None,
            "num_tokens": c.num_tokens,
            "metadata": dict(c.metadata),
        }
        if text_chars > 0:
            entry["text"] = c.text
        entries.append(entry)
    return {
        "chunk_ids": [c.chunk_id for c in chunks],
        "scores": [c.score for c in chunks],
        "chunks": entries,
    }


class RagKVChatModel(_Connection, BaseChatModel):
    """A chat model answered by a ragkv server: retrieval, blended chunk KVs, streamed tokens.

    Every call is one `Query`. The answer's `response_metadata` holds the retrieved
    `chunk_ids`, `scores` and `chunks` (id, score, KV tier, tokens, source metadata),
    and the server's `ttft_seconds`, `total_seconds`, `phase_seconds`,
    `recompute_fraction`, `mode`, `finish_reason` and `used_chunk_ids` (the chunks the
    answer was computed over: focus mode keeps a subset); `usage_metadata` counts prompt
    tokens, answer tokens, and prompt tokens read from the KV cache (`cache_read`).
    When streaming, the retrieval metadata comes with the first chunk and the rest
    with the last one.

    Fields left None take the server's defaults. `invoke`, `stream` and `bind` accept
    per-call `collection`, `top_k`, `mode`, `recompute_ratio`, `temperature`, `top_p`,
    `seed` and `max_tokens`.

    Raises (from invoke, stream and their async twins):
        RagKVServerError: The server refused or failed the Query (its status code and message).
        ValueError: No human message to ask, or an unknown mode.
    """

    model_name: str = Field(default="ragkv", alias="model")
    """Name reported in traces and response_metadata; the server decides the actual model."""
    collection: str | None = None
    """Collection to search; None = "default"."""
    top_k: int | None = Field(default=None, ge=1)
    """Chunks to retrieve."""
    mode: Mode | None = None
    """How the prompt KV is assembled: full, prefix, reuse, blend, focus."""
    search_mode: SearchMode | None = None
    """Which index retrieval searches: dense, lexical or hybrid; None = the server's default (hybrid)."""
    filters: dict[str, Any] | list[MetadataFilter] | None = None
    """Metadata conditions applied before top_k: {"key": value} for equality, or MetadataFilter objects."""
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fraction of context tokens recomputed in blend mode."""
    fidelity_kl: float | None = Field(default=None, gt=0.0)
    """Instead of recompute_ratio: the largest next-token KL from full prefill the collection's
    calibration may predict for the answer; the cheapest ratio that meets it serves."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0 = greedy."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    seed: int | None = None
    """Sampling seed."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Answer length cap in tokens (the API's max_new_tokens)."""
    stop: list[str] | None = None
    """Stop strings; a call's own `stop` replaces them."""
    streaming: bool = False
    """Stream tokens even from invoke (LangGraph's messages mode streams regardless)."""
    history_messages: int = Field(default=0, ge=0)
    """Earlier human/AI messages sent as chat history (after the chunks, before the question); 0 = none."""
    chunk_text_chars: int = Field(default=0, ge=0)
    """Characters of each chunk's text to put in response_metadata; 0 = no text."""
    citations: bool = False
    """Mark sources as [n] (only retrieved chunks can be named); response_metadata["citations"] lists them."""

    @property
    def _llm_type(self) -> str:
        return "ragkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "target": self.target,
            "collection": self.collection,
            "top_k": self.top_k,
            "mode": self.mode.value if self.mode else None,
            "recompute_ratio": self.recompute_ratio,
            "fidelity_kl": self.fidelity_kl,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=_PROVIDER,
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def _query_args(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> dict:
        unknown = set(kwargs) - _QUERY_OVERRIDES - _LANGCHAIN_KWARGS
        if unknown:
            raise TypeError(
                f"RagKVChatModel got unknown keyword argument(s) {sorted(unknown)}; "
                f"per-call overrides are {sorted(_QUERY_OVERRIDES)}"
            )
        # Bad values (an unknown mode, top_k 0...) fail in the SDK or as the server's INVALID_ARGUMENT.
        values = {k: kwargs.get(k, _NOT_FIELDS[k] if k in _NOT_FIELDS else getattr(self, k)) for k in _QUERY_OVERRIDES}
        return {
            "question": question_from_messages(messages),
            "history": history_from_messages(messages, self.history_messages),
            "agent_turns": agent_turns_from_messages(messages),
            "tools": values["tools"] or (),
            "tool_choice": values["tool_choice"],
            "parallel_tool_calls": values["parallel_tool_calls"],
            "response_format": values["response_format"],
            "citations": values["citations"],
            "system_prompt": system_prompt_from_messages(messages),
            "collection": values["collection"],
            "top_k": values["top_k"],
            "mode": values["mode"],
            "search_mode": values["search_mode"],
            "filters": values["filters"],
            "recompute_ratio": values["recompute_ratio"],
            "fidelity_kl": values["fidelity_kl"],
            "temperature": values["temperature"],
            "top_p": values["top_p"],
            "seed": values["seed"],
            "max_new_tokens": values["max_tokens"],
            "stop": tuple(stop if stop is not None else self.stop or ()),
            # Chunk text is only wanted in metadata when asked for; 1 char keeps the wire small.
            "snippet_chars": self.chunk_text_chars or 1,
        }

    def _token_chunk(self, piece: str | ToolCallDelta, chunks: Sequence[RetrievedChunk] | None) -> ChatGenerationChunk:
        metadata = _chunk_metadata(chunks, self.chunk_text_chars) if chunks is not None else {}
        if isinstance(piece, ToolCallDelta):
            part = tool_call_chunk(name=piece.name, args=piece.arguments, id=piece.id, index=piece.index)
            return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[part],
                                                              response_metadata=metadata))
        return ChatGenerationChunk(message=AIMessageChunk(content=piece, response_metadata=metadata))

    def _last_chunk(
        self, stats: QueryStats, chunks: Sequence[RetrievedChunk] | None, collection: str | None
    ) -> ChatGenerationChunk:
        """The closing chunk: stats and usage (and the retrieval, if no token carried it)."""
        metadata: dict[str, Any] = _chunk_metadata(chunks, self.chunk_text_chars) if chunks is not None else {}
        metadata.update(
            model_name=self.model_name,
            model_provider=_PROVIDER,
            collection=collection or "default",
            mode=stats.mode.value,
            finish_reason=stats.finish_reason.value,
            recompute_fraction=stats.recompute_fraction,
            recompute_ratio=stats.recompute_ratio,  # the ratio blend ran at (None outside blend)
            predicted_kl=stats.predicted_kl,  # the calibration's predicted KL from full prefill for it
            tree_prompt_tokens=stats.usage.tree_prompt_tokens,  # prompt tokens the server's KV tree held
            system_prompt=stats.system_prompt.value,  # how the system message was served (indexed, prefix, suffix)
            length_limit=None if stats.length_limit is None else stats.length_limit.value,  # what cut the answer
            used_chunk_ids=list(stats.used_chunk_ids),
            ttft_seconds=stats.ttft_seconds,
            total_seconds=stats.total_seconds,
            phase_seconds=dict(stats.phase_seconds),
        )
        if stats.citations:
            metadata["citations"] = [{"number": c.number, "chunk_id": c.chunk_id, "start": c.start, "end": c.end,
                                      "sentence_start": c.sentence_start} for c in stats.citations]
        u = stats.usage
        usage = UsageMetadata(
            input_tokens=u.prompt_tokens,
            output_tokens=u.completion_tokens,
            total_tokens=u.prompt_tokens + u.completion_tokens,
            input_token_details={"cache_read": u.cached_prompt_tokens},
        )
        message = AIMessageChunk(content="", response_metadata=metadata, usage_metadata=usage, chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": stats.finish_reason.value})

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | Any],
        *,
        tool_choice: dict | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """This model with `tools` the server may call (OpenAI's semantics).

        Args:
            tools: LangChain tools, functions, pydantic models or OpenAI tool dicts.
            tool_choice: "auto" (the default), "none", "any"/"required" or True (call one or
                more), a tool's name or OpenAI's `{"type": "function", ...}` (call that one).
            parallel_tool_calls: False allows one call per answer.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is True:
            tool_choice = "required"
        elif tool_choice is False:
            tool_choice = None
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """This model answering as `schema` (a pydantic class, TypedDict or JSON schema).

        Args:
            method: "json_schema" (the answer is JSON held to the schema), "function_calling"
                (one forced call of a tool whose parameters are the schema), or "json_mode"
                (a JSON object; held to the schema too when one is given, since the server can).
            include_raw: Return {"raw", "parsed", "parsing_error"} instead of the parsed value.
        """
        if kwargs:
            raise TypeError(f"with_structured_output got unknown keyword argument(s) {sorted(kwargs)}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            if schema is None:
                raise ValueError("with_structured_output(method='function_calling') needs a schema")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, parallel_tool_calls=False,
                                  ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                if schema is None:
                    raise ValueError("with_structured_output(method='json_schema') needs a schema")
                json_schema = convert_to_json_schema(schema)
                fmt: dict[str, Any] = {"type": "json_schema", "json_schema": {
                    "name": json_schema.get("title", "output"), "schema": json_schema, "strict": bool(strict)}}
            elif schema is not None:  # JSON mode with a schema to parse by: hold the JSON to it too
                fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": convert_to_json_schema(schema)}}
            else:
                fmt = {"type": "json_object"}
            llm = self.bind(response_format=fmt,
                            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method must be json_schema, function_calling or json_mode, got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # langchain-core itself reports each yielded chunk to the callbacks (and so to LangGraph).
        args = self._query_args(messages, stop, kwargs)
        stream = None
        done = False
        try:
            stream = self._client().query(**args)
            first = True
            for piece in stream:
                yield self._token_chunk(piece, stream.chunks if first else None)
                first = False
            last = self._last_chunk(stream.result(), stream.chunks if first else None, args["collection"])
            done = True
        except grpc.RpcError as exc:
            done = True
            raise _server_error(exc, "Query", self.target) from exc
        finally:
            if stream is not None and not done:  # the caller stopped reading: free the server's work
                stream.cancel()
        yield last

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        args = self._query_args(messages, stop, kwargs)
        stream = self._aclient().query(**args)
        done = False
        try:
            first = True
            async for piece in stream:
                yield self._token_chunk(piece, stream.chunks if first else None)
                first = False
            if stream.stats is None or stream.chunks is None:
                raise RuntimeError("the server ended the Query stream without chunks or stats: a server bug")
            last = self._last_chunk(stream.stats, stream.chunks if first else None, args["collection"])
            done = True
        except grpc.RpcError as exc:
            done = True
            raise _server_error(exc, "Query", self.target) from exc
        finally:
            if not done:
                stream.cancel()
        yield last

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))


def call_tools_first(model: BaseChatModel, tools: Sequence[Any]) -> Callable[..., Runnable]:
    """A dynamic model for LangGraph's `create_react_agent(model=..., tools=...)`: a new
    question's first step must call one of `tools` (tool_choice "required"); after a tool's
    result the model decides (tool_choice "auto"): answer, or call again.

    For models too weak to decide on their own that a question needs a tool (SmolLM2-135M
    answers from its context instead); any chat model with `bind_tools` works.
    """
    first = model.bind_tools(tools, tool_choice="required")
    then = model.bind_tools(tools)

    def pick(state: Any, runtime: Any = None) -> Runnable:
        messages = state["messages"] if isinstance(state, dict) else state.messages
        return then if messages and isinstance(messages[-1], ToolMessage) else first

    return pick


class RagKVRetriever(_Connection, BaseRetriever):
    """Chunks from a ragkv server's `Retrieve` as `Document`s, best first.

    Each Document's `page_content` is the chunk text (or its first `snippet_chars`
    characters) and its `metadata` the chunk's own metadata (source, offsets...) plus
    `chunk_id`, `score` and `collection`; its `id` is the chunk id. `invoke(q, top_k=3)`
    overrides top_k for one call, as `search_mode=` and `filters=` override theirs.

    Raises (from invoke and ainvoke):
        RagKVServerError: The server refused or failed the call.
    """

    collection: str | None = None
    """Collection to search; None = "default"."""
    top_k: int | None = Field(default=None, ge=1)
    """Chunks to return; None = the server's default."""
    snippet_chars: int | None = Field(default=None, ge=1)
    """Characters of chunk text per Document; None = the whole text."""
    search_mode: SearchMode | None = None
    """Which index to search: dense, lexical or hybrid; None = the server's default (hybrid)."""
    filters: dict[str, Any] | list[MetadataFilter] | None = None
    """Metadata conditions applied before top_k: {"key": value} for equality, or MetadataFilter objects."""

    def _documents(self, chunks: Sequence[RetrievedChunk]) -> list[Document]:
        collection = self.collection or "default"
        return [
            Document(
                id=c.chunk_id,
                page_content=c.text,
                metadata={**c.metadata, "chunk_id": c.chunk_id, "score": c.score, "collection": collection},
            )
            for c in chunks
        ]

    def _top_k(self, top_k: int | None) -> int | None:
        top_k = self.top_k if top_k is None else top_k
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        return top_k

    def _search(self, search_mode: SearchMode | str | None, filters: Any) -> dict[str, Any]:
        return {"search_mode": self.search_mode if search_mode is None else search_mode,
                "filters": self.filters if filters is None else filters}

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, top_k: int | None = None,
        search_mode: SearchMode | str | None = None, filters: Any = None,
    ) -> list[Document]:
        try:
            result = self._client().retrieve(
                query, collection=self.collection, top_k=self._top_k(top_k), snippet_chars=self.snippet_chars,
                **self._search(search_mode, filters),
            )
        except grpc.RpcError as exc:
            raise _server_error(exc, "Retrieve", self.target) from exc
        return self._documents(result.chunks)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, top_k: int | None = None,
        search_mode: SearchMode | str | None = None, filters: Any = None,
    ) -> list[Document]:
        try:
            result = await self._aclient().retrieve(
                query, collection=self.collection, top_k=self._top_k(top_k), snippet_chars=self.snippet_chars,
                **self._search(search_mode, filters),
            )
        except grpc.RpcError as exc:
            raise _server_error(exc, "Retrieve", self.target) from exc
        return self._documents(result.chunks)
