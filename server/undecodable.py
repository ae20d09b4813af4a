"""Request bytes that do not parse as the method's message: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio deserializes a request before any servicer code runs, and an exception from
the deserializer ends the RPC as UNKNOWN ("Unexpected DecodeError ...") with a
traceback in the log for each one. A deserializer cannot set a status, so this
interceptor wraps every unary-request handler twice: its deserializer turns a
`DecodeError` into an `Undecodable` marker, and its behaviour answers a marker with
INVALID_ARGUMENT before the servicer sees it. Stream-request methods (reflection) are
left as grpc builds them.

Knows nothing of the service: it applies to every method the server has.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a wrapped deserializer returns for bytes that are not a valid message."""

    nbytes: int  # length of the request payload
    reason: str  # the parser's complaint


def _message(method: str, bad: Undecodable) -> str:
    return (f"request to {method} is not a valid protobuf message ({bad.nbytes} bytes): {bad.reason}")


def _tolerant(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return Undecodable(len(raw), str(exc) or type(exc).__name__)

    return deserialize


def _wrap(handler: grpc.RpcMethodHandler, method: str, on_reject: Callable[[str], None]) -> grpc.RpcMethodHandler:
    async def reject(bad: Undecodable, context: grpc.aio.ServicerContext) -> None:
        on_reject(method)
        log.debug("rejected an undecodable request to %s: %s", method, bad.reason)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, bad))

    des, ser = _tolerant(handler.request_deserializer), handler.response_serializer
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary(request: object, context: grpc.aio.ServicerContext) -> object:
            if isinstance(request, Undecodable):
                await reject(request, context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=des, response_serializer=ser)

    behavior = handler.unary_stream
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: object, context: grpc.aio.ServicerContext):
            if isinstance(request, Undecodable):
                await reject(request, context)
            async for response in behavior(request, context):
                yield response
    else:  # a coroutine writing its responses with context.write
        async def stream(request: object, context: grpc.aio.ServicerContext) -> None:  # type: ignore[misc]
            if isinstance(request, Undecodable):
                await reject(request, context)
            await behavior(request, context)

    return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=des, response_serializer=ser)


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers undecodable unary requests with INVALID_ARGUMENT, logging no traceback.

    Args:
        on_reject: Called with the full method name of each rejected call (metrics).
    """

    def __init__(self, on_reject: Callable[[str], None] = lambda _: None) -> None:
        self._on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        return _wrap(handler, handler_call_details.method, self._on_reject)
