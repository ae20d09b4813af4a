"""Bearer-token authentication as a grpc.aio server interceptor.

Every RPC except the standard health service must carry
`authorization: Bearer <token>`; anything else ends with UNAUTHENTICATED before the
handler runs. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc
import grpc.aio

# Load balancers and orchestrators probe health without credentials.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
TOKEN_ENV = "RAGKV_AUTH_TOKEN"


def read_token(token_file: Path | None, env: dict[str, str] | None = None) -> str | None:
    """The server token: from token_file if given, else $RAGKV_AUTH_TOKEN, else None.

    Raises:
        ValueError: token_file is empty.
    """
    if token_file is not None:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"auth token file {token_file} is empty")
        return token
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    return token or None


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_stream or handler.stream_stream:
        factory = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return factory(abort_stream, request_deserializer=des, response_serializer=ser)
    factory = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
    return factory(abort, request_deserializer=des, response_serializer=ser)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects RPCs without the right bearer token (health exempt).

    Args:
        token: The accepted token.
        on_reject: Called with the method name of each rejected call (metrics).
    """

    def __init__(self, token: str, on_reject: Callable[[str], None] = lambda _: None) -> None:
        if not token:
            raise ValueError("token must be non-empty")
        self._expected = f"Bearer {token}".encode()
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
        refused = bearer_refusal(handler_call_details.invocation_metadata or (), self._expected)
        if refused is not None:
            self._on_reject(method)
            return _deny(handler, refused)
        return handler


def bearer_refusal(metadata: Iterable[tuple[str, str | bytes]], expected: bytes) -> str | None:
    """Why a call with this metadata is refused (UNAUTHENTICATED), or None when it carries
    `expected` (b"Bearer <token>"); compared in constant time. The grpc.aio interceptor and the
    cluster's ingress (Ray Serve's gRPC proxy takes no interceptor) both ask it."""
    got = dict(metadata).get("authorization")
    if got is None:
        return "missing 'authorization: Bearer <token>' metadata"
    if not hmac.compare_digest(got.encode() if isinstance(got, str) else got, expected):
        return "invalid bearer token"
    return None
