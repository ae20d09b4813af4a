"""Authentication, before any handler runs: a grpc.aio server interceptor, and a Starlette
authentication backend for the HTTP API.

Every RPC except the standard health service, and every HTTP request except `/health`,
must carry `authorization: Bearer <key>` naming one of the server's keys
(`server.api_keys.KeyRing`: the `--api-keys` file's named keys, or the single token); anything
else ends with UNAUTHENTICATED (HTTP 401) before the handler runs and before its request
body is parsed (the refusing gRPC handler takes the raw bytes). An HTTP handler finds its
caller as `request.user.caller` (`KeyUser`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, BaseUser
from starlette.requests import HTTPConnection

from ragkv.server.api_keys import ANONYMOUS, Caller, KeyRing, UnauthenticatedError

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


HTTP_EXEMPT = ("/health",)  # probed without credentials


class KeyUser(BaseUser):
    """An HTTP request's caller (`request.user`), once its key is checked."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.caller.label


class KeyAuth(AuthenticationBackend):
    """Starlette's authentication backend over `keys` (`AuthenticationMiddleware`): the request's
    caller, or an `AuthenticationError` whose cause is the `UnauthenticatedError` saying why."""

    def __init__(self, keys: KeyRing) -> None:
        self._keys = keys

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser]:
        if conn.url.path in HTTP_EXEMPT:
            return AuthCredentials(), KeyUser(ANONYMOUS)
        try:
            caller = self._keys.authenticate(conn.headers.get("authorization"))
        except UnauthenticatedError as exc:
            raise AuthenticationError(str(exc)) from exc
        return AuthCredentials(["authenticated"]), KeyUser(caller)
