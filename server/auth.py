"""Authentication as a grpc.aio server interceptor.

Every RPC except the standard health service must carry `authorization: Bearer <key>`
naming one of the server's keys (`server.keys.KeyRing`: the `--api-keys` file's named
keys, or the single token); anything else ends with UNAUTHENTICATED before the handler
runs and before its request body is parsed (the refusing handler takes the raw bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio

from ragkv.server.keys import KeyRing, UnauthenticatedError

log = logging.getLogger(__name__)

# Load balancers and orchestrators probe health without credentials.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request: object, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    # no request deserializer: a refused call's body is never parsed
    des, ser = None, handler.response_serializer
    if handler.unary_stream or handler.stream_stream:
        factory = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return factory(abort_stream, request_deserializer=des, response_serializer=ser)
    factory = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
    return factory(abort, request_deserializer=des, response_serializer=ser)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects RPCs whose credentials name none of `keys` (health exempt).

    Args:
        keys: The accepted keys (enabled: a server with no keys needs no interceptor).
        on_reject: Called with the method name of each rejected call (metrics).
    """

    def __init__(self, keys: KeyRing, on_reject: Callable[[str], None] = lambda _: None) -> None:
        if not keys.enabled:
            raise ValueError("keys must hold at least one key")
        self._keys = keys
        self._on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        try:
            self._keys.authenticate_metadata(handler_call_details.invocation_metadata)
        except UnauthenticatedError as exc:
            self._on_reject(method)
            log.info("refused %s: %s", method, exc)
            return _deny(handler, str(exc))
        return handler
