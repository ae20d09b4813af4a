"""What Ray Serve's proxies run of ours in a cluster (`ragkv serve --replicas`).

Ray Serve's proxies answer some calls themselves, before any replica (and so before the key
check `RagService` makes):
- HTTP: `/-/routes` lists the applications and their routes to anyone. The proxy calls
  `proxy_middlewares` (named by `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, which
  `cluster.start` sets for a Ray it starts) and wraps itself in what it returns, so that path
  is not served. `/-/healthz` stays: a load balancer's health check, it says only "success".
- gRPC: Ray's own `RayServeAPIService` answers `ListApplications` to anyone. Ray's gRPC proxy
  takes no interceptor and no option to drop that service, but it calls each of the cluster's
  servicer functions with its server after registering its own service: `refuse_ray_api`, the
  last of them, swaps the handler of each `NOT_SERVED_GRPC` method for one that answers
  UNIMPLEMENTED. `Healthz` stays, as `/-/healthz` does.

Light on purpose: the proxy imports this module, and nothing of the engine.
"""

from __future__ import annotations

import logging

import grpc
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

CALLBACK = "ragkv.server.ray_proxy:proxy_middlewares"  # RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
NOT_SERVED = ("/-/routes",)  # Ray Serve's own paths that answer without a key
GUARD = "ragkv.server.ray_proxy.refuse_ray_api"  # the last of the cluster's grpc_servicer_functions
NOT_SERVED_GRPC = ("/ray.serve.RayServeAPIService/ListApplications",)  # Ray's own methods, keyless

log = logging.getLogger(__name__)


class RefuseRayRoutes:
    """ASGI middleware: 404 for Ray Serve's own `NOT_SERVED` paths, everything else passed on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").rstrip("/") in NOT_SERVED:
            reply = PlainTextResponse("not served: ragkv's cluster does not list its routes", status_code=404)
            await reply(scope, receive, send)
            return
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's HTTP proxy callback: the middlewares it wraps itself in."""
    return [Middleware(RefuseRayRoutes)]


async def _not_served(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not served: ragkv's cluster does not list its applications")
    raise AssertionError("context.abort returned")  # it raises


def refuse_ray_api(servicer: object, server: object) -> None:
    """A servicer function for Ray's gRPC proxy (`gRPCOptions.grpc_servicer_functions`): it adds
    no service, and makes each `NOT_SERVED_GRPC` method of those already on `server` answer
    UNIMPLEMENTED. The proxy looks a method's handler up in these tables at call time, so a
    handler swapped before the server starts is the one that answers."""
    swapped = 0
    for handlers in getattr(server, "generic_rpc_handlers", ()):
        for handler in handlers:
            methods = getattr(handler, "_method_handlers", None)
            for name in NOT_SERVED_GRPC:
                if isinstance(methods, dict) and name in methods:
                    methods[name] = grpc.unary_unary_rpc_method_handler(_not_served)
                    swapped += 1
    if swapped < len(NOT_SERVED_GRPC):  # a Ray that keeps its handlers elsewhere: say it, do not fail the proxy
        log.warning("Ray's gRPC proxy still serves %s without a key: its handlers were not found (Ray changed?)",
                    ", ".join(NOT_SERVED_GRPC))
