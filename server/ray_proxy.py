"""What Ray Serve's HTTP proxy runs of ours in a cluster (`ragkv serve --replicas`).

Ray Serve's proxy answers some paths itself, before any replica (and so before the key check
`RagService` makes): `/-/routes` lists the applications and their routes to anyone. The proxy
calls `proxy_middlewares` (named by `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, which
`cluster.start` sets for a Ray it starts) and wraps itself in what it returns, so that path is
not served. `/-/healthz` stays: a load balancer's health check, it says only "success".

Light on purpose: the proxy imports this module, and nothing of the engine.
"""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

CALLBACK = "ragkv.server.ray_proxy:proxy_middlewares"  # RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
NOT_SERVED = ("/-/routes",)  # Ray Serve's own paths that answer without a key


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
