"""RagClient and AsyncRagClient: the Python SDK of the ragkv query service.

    with RagClient("localhost:50051", token=...) as client:
        stream = client.query("Who wrote it?", mode="blend")
        for piece in stream:
            print(piece, end="")
        print(stream.chunks, stream.stats.ttft_seconds)

Every call has a deadline (the client's default `timeout` unless given), retries
UNAVAILABLE with backoff (a stream only before its first message), and raises
`grpc.RpcError` with the server's status code otherwise. This module imports
grpcio and protobuf only, never torch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio

from ragkv import convert
from ragkv.channel import ChannelConfig
from ragkv.retry import RetryPolicy, is_retryable
from ragkv.types import (
    ChatTurn,
    CollectionInfo,
    CollectionStats,
    MetadataFilter,
    Mode,
    QueryOptions,
    QueryStats,
    ResponseFormat,
    ResponseFormatKind,
    RetrievedChunk,
    RetrieveResult,
    SearchMode,
    Tool,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
)
from ragkv.v1 import ragkv_pb2 as pb
from ragkv.v1 import ragkv_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT = 120.0  # seconds, whole call (a Query stream included)


E = TypeVar("E", Mode, SearchMode)


def _enum(cls: type[E], value: E | str | None, field: str) -> E | None:
    """A caller's enum or its (case-insensitive) name as the enum; None stays None."""
    if value is None or isinstance(value, cls):
        return value
    try:
        return cls(value.lower())
    except ValueError:
        known = ", ".join(m.value for m in cls)
        raise ValueError(f"{field} must be one of {known}, got {value!r}") from None


def _mode(mode: Mode | str | None) -> Mode | None:
    return _enum(Mode, mode, "mode")


def _search_mode(mode: SearchMode | str | None) -> SearchMode | None:
    return _enum(SearchMode, mode, "search_mode")


Filters = Mapping[str, Any] | Sequence[MetadataFilter] | None  # {"key": value} means equality on each key


def _filters(filters: Filters) -> tuple[MetadataFilter, ...]:
    if not filters:
        return ()
    if isinstance(filters, Mapping):
        return tuple(MetadataFilter(str(k), v) for k, v in filters.items())
    out = tuple(filters)
    for f in out:
        if not isinstance(f, MetadataFilter):
            raise TypeError(f"filters must be a dict or MetadataFilter objects, got {type(f).__name__}")
    return out


ToolLike = Tool | Mapping[str, Any]  # a Tool, or OpenAI's {"type": "function", "function": {...}}
ToolChoiceLike = ToolChoice | str | None  # "auto", "none", "required" ("any"), or a tool's name
ResponseFormatLike = ResponseFormat | Mapping[str, Any] | str | None  # "json_object", OpenAI's dict, or a JSON schema


def tool_from(tool: ToolLike) -> Tool:
    """A Tool from itself, OpenAI's function-tool dict, or `{name, description, parameters}`."""
    if isinstance(tool, Tool):
        return tool
    if not isinstance(tool, Mapping):
        raise TypeError(f"a tool must be a Tool or a dict, got {type(tool).__name__}")
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool dict must be {{type: function, function: {{name, description, parameters}}}}, "
                         f"got {tool!r}")
    return Tool(fn["name"], str(fn.get("description") or ""),
                dict(fn.get("parameters") or {"type": "object", "properties": {}}))


def tool_choice_from(choice: ToolChoiceLike) -> ToolChoice:
    """A ToolChoice from itself, "auto"/"none"/"required" ("any" too, as LangChain says it),
    a tool's name, or OpenAI's `{"type": "function", "function": {"name": ...}}`."""
    if choice is None:
        return ToolChoice()
    if isinstance(choice, ToolChoice):
        return choice
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        return ToolChoice(ToolChoiceMode.FUNCTION, str(choice["function"].get("name")))
    if not isinstance(choice, str):
        raise TypeError(f"tool_choice must be a ToolChoice, a str or OpenAI's dict, got {type(choice).__name__}")
    if choice == "any":
        return ToolChoice(ToolChoiceMode.REQUIRED)
    if choice in ("auto", "none", "required"):
        return ToolChoice(ToolChoiceMode(choice))
    return ToolChoice(ToolChoiceMode.FUNCTION, choice)


def response_format_from(fmt: ResponseFormatLike) -> ResponseFormat:
    """A ResponseFormat from itself, "json_object", OpenAI's `response_format` dict, or a bare
    JSON schema."""
    if fmt is None or fmt == "text":
        return ResponseFormat()
    if isinstance(fmt, ResponseFormat):
        return fmt
    if fmt == "json_object":
        return ResponseFormat(ResponseFormatKind.JSON_OBJECT)
    if not isinstance(fmt, Mapping):
        raise TypeError(f"response_format must be a ResponseFormat, 'json_object' or a dict, got {fmt!r}")
    kind = fmt.get("type")
    if kind == "json_schema" and isinstance(fmt.get("json_schema"), Mapping):
        spec = fmt["json_schema"]
        return ResponseFormat(ResponseFormatKind.JSON_SCHEMA, dict(spec.get("schema") or {}),
                              str(spec.get("name") or ""), bool(spec.get("strict")))
    if kind in ("json_object", "text"):
        return ResponseFormat(ResponseFormatKind(kind))
    return ResponseFormat(ResponseFormatKind.JSON_SCHEMA, dict(fmt))  # a JSON schema itself


def _answer_shape(agent_turns: Sequence[ChatTurn], tools: Sequence[ToolLike], tool_choice: ToolChoiceLike,
                  parallel_tool_calls: bool, response_format: ResponseFormatLike, citations: bool) -> dict[str, Any]:
    """QueryOptions' answer-shape fields from the SDK's friendlier arguments."""
    typed = tuple(tool_from(t) for t in tools)
    return dict(agent_turns=tuple(agent_turns), tools=typed, tool_choice=tool_choice_from(tool_choice),
                parallel_tool_calls=parallel_tool_calls, response_format=response_format_from(response_format),
                citations=citations)


def _options(
    collection: str | None,
    top_k: int | None,
    mode: Mode | str | None,
    recompute_ratio: float | None,
    temperature: float,
    top_p: float | None,
    seed: int | None,
    max_new_tokens: int | None,
    stop: Sequence[str],
    snippet_chars: int | None,
    search_mode: SearchMode | str | None = None,
    filters: Filters = None,
    history: Sequence[ChatTurn] = (),
    system_prompt: str | None = None,
    shape: Mapping[str, Any] | None = None,
) -> QueryOptions:
    return QueryOptions(
        **(shape or {}),
        history=tuple(history),
        system_prompt=system_prompt,
        collection=collection,
        top_k=top_k,
        mode=_mode(mode),
        recompute_ratio=recompute_ratio,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        max_new_tokens=max_new_tokens,
        stop=tuple(stop),
        snippet_chars=snippet_chars,
        search_mode=_search_mode(search_mode),
        filters=_filters(filters),
    )


class _StreamState:
    """What a Query stream has delivered so far (shared by the sync and async streams)."""

    def __init__(self) -> None:
        self.chunks: tuple[RetrievedChunk, ...] | None = None  # first message
        self.stats: QueryStats | None = None  # last message
        self.pieces: list[str] = []  # token pieces received

    def absorb(self, msg: pb.QueryResponse) -> str | ToolCallDelta | None:
        """Record one message; return its token piece or tool-call piece, if it is one."""
        event = convert.query_event_from_proto(msg)
        if isinstance(event, str):
            self.pieces.append(event)
            return event
        if isinstance(event, ToolCallDelta):
            return event
        if isinstance(event, QueryStats):
            self.stats = event
        else:
            self.chunks = event
        return None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class QueryStream:
    """A running Query: iterate for token pieces; `chunks` and `stats` fill in as they arrive.

    An answer that calls tools yields `ToolCallDelta`s instead of text; `stats.tool_calls`
    holds the whole calls at the end."""

    def __init__(self, start: Callable[[float], grpc.Call], retry: RetryPolicy, timeout: float) -> None:
        self._start = start
        self._retry = retry
        self._deadline = time.monotonic() + timeout
        self._state = _StreamState()
        self._buffer: deque[str | ToolCallDelta] = deque()
        # The call starts now, not at the first read: the server queues it at once.
        self._call: grpc.Call = start(timeout)
        self._events = self._run()

    def _run(self) -> Iterator[str | ToolCallDelta | None]:
        delays = self._retry.delays()
        first = True
        while True:
            if not first:
                self._call = self._start(max(0.0, self._deadline - time.monotonic()))
            first = False
            received = False
            try:
                for msg in self._call:
                    received = True
                    yield self._state.absorb(msg)
                return
            except grpc.RpcError as exc:
                delay = next(delays, None) if is_retryable(exc) and not received else None
                if delay is None or time.monotonic() + delay >= self._deadline:
                    raise
                time.sleep(delay)

    def _pull(self) -> bool:
        """Read one more message; False at the end of the stream."""
        try:
            piece = next(self._events)
        except StopIteration:
            return False
        if piece is not None:
            self._buffer.append(piece)
        return True

    def __iter__(self) -> Iterator[str | ToolCallDelta]:
        while True:
            while self._buffer:
                yield self._buffer.popleft()
            if not self._pull():
                return

    @property
    def chunks(self) -> tuple[RetrievedChunk, ...]:
        """The retrieved chunks (waits for the first message if it has not arrived)."""
        while self._state.chunks is None and self._pull():
            pass
        if self._state.chunks is None:
            raise RuntimeError("the server ended the Query stream without a chunks message: a server bug")
        return self._state.chunks

    @property
    def stats(self) -> QueryStats | None:
        """The final stats; None until the stream has been read to its end."""
        return self._state.stats

    @property
    def text(self) -> str:
        """The answer text received so far."""
        return self._state.text

    def result(self) -> QueryStats:
        """Read the stream to its end and return the final stats."""
        for _ in self:
            pass
        if self._state.stats is None:
            raise RuntimeError("the server ended the Query stream without stats: a server bug")
        return self._state.stats

    def cancel(self) -> None:
        """Cancel the call; the server frees its work at once."""
        self._call.cancel()


class RagClient:
    """Blocking client of a ragkv server.

    Args:
        target: "host:port" of the server.
        token: Bearer token, when the server requires one.
        tls: Connect with TLS (system roots unless root_certificates is given).
        root_certificates: PEM bytes or path of the CA that signed the server's cert.
        server_name: TLS name to verify instead of the target's host.
        timeout: Default deadline of each call, seconds.
        retry: Retry policy for UNAVAILABLE.
        insecure: Send `token` in plaintext to a host that is not this machine (a network you
            trust; it warns). Without it, a token needs TLS to any host but loopback (ValueError).
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | str | Path | None = None,
        server_name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy = RetryPolicy(),
        insecure: bool = False,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self._config = ChannelConfig.create(
            target, token=token, tls=tls, root_certificates=root_certificates, server_name=server_name,
            insecure=insecure,
        )
        self._timeout = timeout
        self._retry = retry
        self._channel = self._config.sync_channel()
        self._stub = pb_grpc.RagServiceStub(self._channel)

    def __enter__(self) -> RagClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; running calls are cancelled."""
        self._channel.close()

    def _unary(self, method: Callable[..., object], request: object, timeout: float | None) -> object:
        deadline = time.monotonic() + (timeout or self._timeout)
        delays = self._retry.delays()
        while True:
            try:
                return method(
                    request, timeout=max(0.0, deadline - time.monotonic()), metadata=self._config.metadata()
                )
            except grpc.RpcError as exc:
                delay = next(delays, None) if is_retryable(exc) else None
                if delay is None or time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)

    def query(
        self,
        question: str,
        *,
        collection: str | None = None,
        top_k: int | None = None,
        mode: Mode | str | None = None,
        recompute_ratio: float | None = None,
        temperature: float = 0.0,
        top_p: float | None = None,
        seed: int | None = None,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        snippet_chars: int | None = None,
        search_mode: SearchMode | str | None = None,
        filters: Filters = None,
        history: Sequence[ChatTurn] = (),
        system_prompt: str | None = None,
        agent_turns: Sequence[ChatTurn] = (),
        tools: Sequence[ToolLike] = (),
        tool_choice: ToolChoiceLike = None,
        parallel_tool_calls: bool = True,
        response_format: ResponseFormatLike = None,
        citations: bool = False,
        cache_salt: str | None = None,
        retain_seconds: float | None = None,
        retain_priority: int | None = None,
        fidelity_kl: float | None = None,
        timeout: float | None = None,
    ) -> QueryStream:
        """Start a Query; None options take the server's defaults.

        ``search_mode`` is dense, lexical or hybrid (server default: hybrid); ``filters`` is a
        ``{"key": value}`` dict of equality conditions, or ``MetadataFilter`` objects (prefix
        filters: ``MetadataFilter("source", "docs/", "prefix")``), applied before top_k.
        ``history`` holds earlier turns (``ChatTurn``), placed after the chunks, before the
        question; ``system_prompt``, when given, is served even when it is not the collection's
        (the stats' ``system_prompt`` says how; a server run with ``--system-prompt-policy strict``
        refuses another with INVALID_ARGUMENT).

        Agents: ``tools`` (``Tool`` or OpenAI's function-tool dicts) with ``tool_choice``
        ("auto", "none", "required", or a tool's name) and ``parallel_tool_calls``; the
        calls made so far and the tools' results go in ``agent_turns`` (after the
        question). ``response_format`` ("json_object", a JSON schema, or OpenAI's dict)
        holds the answer to JSON; ``citations`` marks sources as [n], naming only
        retrieved chunks. All are enforced by constrained decoding. ``retain_seconds`` keeps
        an answer's KV-tree path pinned that long for the agent's next call (at most the
        server's --kv-tree-retain-max-s); ``retain_priority`` (-100..100) says how much this
        conversation's KV-tree path matters against the key's others: lower leaves first, and
        above 0 holds within the key's share of the tree; ``cache_salt`` shares KV-tree paths
        only with this key's requests giving the same salt (one per end user, say).

        ``fidelity_kl``, instead of ``recompute_ratio``, asks for the cheapest blend whose
        next-token KL from full prefill the collection's calibration predicts at most this
        (full prefill when none does); the stats' ``recompute_ratio`` and ``predicted_kl`` say
        what ran.

        Returns:
            A QueryStream; iterating it yields the answer's text pieces.
        """
        options = _options(
            collection, top_k, mode, recompute_ratio, temperature, top_p, seed, max_new_tokens, stop, snippet_chars,
            search_mode, filters, history, system_prompt,
            {**_answer_shape(agent_turns, tools, tool_choice, parallel_tool_calls, response_format, citations),
             "cache_salt": cache_salt, "retain_seconds": retain_seconds, "retain_priority": retain_priority,
             "fidelity_kl": fidelity_kl},
        )
        request = convert.query_request_to_proto(question, options)

        def start(remaining: float) -> grpc.Call:
            return self._stub.Query(request, timeout=remaining, metadata=self._config.metadata())

        return QueryStream(start, self._retry, timeout or self._timeout)

    def retrieve(
        self,
        question: str,
        *,
        collection: str | None = None,
        top_k: int | None = None,
        snippet_chars: int | None = None,
        search_mode: SearchMode | str | None = None,
        filters: Filters = None,
        timeout: float | None = None,
    ) -> RetrieveResult:
        """Retrieve chunks only."""
        request = convert.retrieve_request_to_proto(
            question, collection, top_k, snippet_chars, _search_mode(search_mode), _filters(filters)
        )
        return convert.retrieve_result_from_proto(self._unary(self._stub.Retrieve, request, timeout))

    def list_collections(self, *, timeout: float | None = None) -> list[CollectionInfo]:
        """The collections the server serves."""
        resp = self._unary(self._stub.ListCollections, pb.ListCollectionsRequest(), timeout)
        return [convert.collection_from_proto(c) for c in resp.collections]

    def collection_stats(self, name: str = "default", *, timeout: float | None = None) -> CollectionStats:
        """One collection with its KV-tier statistics."""
        resp = self._unary(self._stub.GetCollectionStats, pb.GetCollectionStatsRequest(name=name), timeout)
        return convert.collection_stats_from_proto(resp)


class AsyncQueryStream:
    """A running Query on asyncio: `async for piece in stream`; `chunks`/`stats` fill in."""

    def __init__(self, start: Callable[[float], grpc.aio.UnaryStreamCall], retry: RetryPolicy, timeout: float) -> None:
        self._start = start
        self._retry = retry
        self._deadline = time.monotonic() + timeout
        self._state = _StreamState()
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._consumed = False

    async def __aiter__(self) -> AsyncIterator[str | ToolCallDelta]:
        if self._consumed:
            raise RuntimeError("an AsyncQueryStream can be iterated once")
        self._consumed = True
        delays = self._retry.delays()
        while True:
            self._call = self._start(max(0.0, self._deadline - time.monotonic()))
            received = False
            try:
                async for msg in self._call:
                    received = True
                    piece = self._state.absorb(msg)
                    if piece is not None:
                        yield piece
                return
            except grpc.RpcError as exc:
                delay = next(delays, None) if is_retryable(exc) and not received else None
                if delay is None or time.monotonic() + delay >= self._deadline:
                    raise
                await asyncio.sleep(delay)

    @property
    def chunks(self) -> tuple[RetrievedChunk, ...] | None:
        """The retrieved chunks; None until the first message arrived."""
        return self._state.chunks

    @property
    def stats(self) -> QueryStats | None:
        """The final stats; None until the stream ended."""
        return self._state.stats

    @property
    def text(self) -> str:
        """The answer text received so far."""
        return self._state.text

    async def result(self) -> QueryStats:
        """Read the stream to its end and return the final stats."""
        async for _ in self:
            pass
        if self._state.stats is None:
            raise RuntimeError("the server ended the Query stream without stats: a server bug")
        return self._state.stats

    def cancel(self) -> None:
        """Cancel the call; the server frees its work at once."""
        if self._call is not None:
            self._call.cancel()


class AsyncRagClient:
    """asyncio client of a ragkv server; same arguments and methods as RagClient.

    Create it inside the running event loop that uses it.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | str | Path | None = None,
        server_name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy = RetryPolicy(),
        insecure: bool = False,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self._config = ChannelConfig.create(
            target, token=token, tls=tls, root_certificates=root_certificates, server_name=server_name,
            insecure=insecure,
        )
        self._timeout = timeout
        self._retry = retry
        self._channel = self._config.aio_channel()
        self._stub = pb_grpc.RagServiceStub(self._channel)

    async def __aenter__(self) -> AsyncRagClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; running calls are cancelled."""
        await self._channel.close()

    async def _unary(self, method: Callable[..., object], request: object, timeout: float | None) -> object:
        deadline = time.monotonic() + (timeout or self._timeout)
        delays = self._retry.delays()
        while True:
            try:
                return await method(
                    request, timeout=max(0.0, deadline - time.monotonic()), metadata=self._config.metadata()
                )
            except grpc.RpcError as exc:
                delay = next(delays, None) if is_retryable(exc) else None
                if delay is None or time.monotonic() + delay >= deadline:
                    raise
                await asyncio.sleep(delay)

    def query(
        self,
        question: str,
        *,
        collection: str | None = None,
        top_k: int | None = None,
        mode: Mode | str | None = None,
        recompute_ratio: float | None = None,
        temperature: float = 0.0,
        top_p: float | None = None,
        seed: int | None = None,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        snippet_chars: int | None = None,
        search_mode: SearchMode | str | None = None,
        filters: Filters = None,
        history: Sequence[ChatTurn] = (),
        system_prompt: str | None = None,
        agent_turns: Sequence[ChatTurn] = (),
        tools: Sequence[ToolLike] = (),
        tool_choice: ToolChoiceLike = None,
        parallel_tool_calls: bool = True,
        response_format: ResponseFormatLike = None,
        citations: bool = False,
        cache_salt: str | None = None,
        retain_seconds: float | None = None,
        retain_priority: int | None = None,
        fidelity_kl: float | None = None,
        timeout: float | None = None,
    ) -> AsyncQueryStream:
        """Start a Query (the call begins when the stream is iterated)."""
        options = _options(
            collection, top_k, mode, recompute_ratio, temperature, top_p, seed, max_new_tokens, stop, snippet_chars,
            search_mode, filters, history, system_prompt,
            {**_answer_shape(agent_turns, tools, tool_choice, parallel_tool_calls, response_format, citations),
             "cache_salt": cache_salt, "retain_seconds": retain_seconds, "retain_priority": retain_priority,
             "fidelity_kl": fidelity_kl},
        )
        request = convert.query_request_to_proto(question, options)

        def start(remaining: float) -> grpc.aio.UnaryStreamCall:
            return self._stub.Query(request, timeout=remaining, metadata=self._config.metadata())

        return AsyncQueryStream(start, self._retry, timeout or self._timeout)

    async def retrieve(
        self,
        question: str,
        *,
        collection: str | None = None,
        top_k: int | None = None,
        snippet_chars: int | None = None,
        search_mode: SearchMode | str | None = None,
        filters: Filters = None,
        timeout: float | None = None,
    ) -> RetrieveResult:
        """Retrieve chunks only."""
        request = convert.retrieve_request_to_proto(
            question, collection, top_k, snippet_chars, _search_mode(search_mode), _filters(filters)
        )
        return convert.retrieve_result_from_proto(await self._unary(self._stub.Retrieve, request, timeout))

    async def list_collections(self, *, timeout: float | None = None) -> list[CollectionInfo]:
        """The collections the server serves."""
        resp = await self._unary(self._stub.ListCollections, pb.ListCollectionsRequest(), timeout)
        return [convert.collection_from_proto(c) for c in resp.collections]

    async def collection_stats(self, name: str = "default", *, timeout: float | None = None) -> CollectionStats:
        """One collection with its KV-tier statistics."""
        resp = await self._unary(self._stub.GetCollectionStats, pb.GetCollectionStatsRequest(name=name), timeout)
        return convert.collection_stats_from_proto(resp)
