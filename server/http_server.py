"""HttpServer: uvicorn serving an ASGI app (the OpenAI-compatible API) on the running event
loop, the gRPC server's, so both share one loop, backend and scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp


class HttpServer:
    """uvicorn serving an ASGI app on the running event loop (the gRPC server's).

    uvicorn's own signal capture is off: `ragkv serve` drains on SIGTERM itself, and
    stops this server as part of the drain.
    """

    def __init__(self, app: ASGIApp, host: str, port: int, tls_cert: Path | None = None,
                 tls_key: Path | None = None) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the RagServer owns SIGTERM/SIGINT
                yield

        self._host, self._port = host, port
        self._config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                      timeout_graceful_shutdown=1,
                                      ssl_certfile=None if tls_cert is None else str(tls_cert),
                                      ssl_keyfile=None if tls_key is None else str(tls_key))
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None  # bound port, after start()

    async def start(self) -> int:
        """Bind and serve; returns the bound port.

        Raises:
            OSError: The port cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as exc:
            sock.close()
            raise OSError(f"could not bind the HTTP port at {self._host}:{self._port}: {exc}") from exc
        sock.listen(128)
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed at startup
                self._task.result()
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close connections, and wait (at most `timeout` seconds)."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self._server.force_exit = True
            self._task.cancel()
        self._task = None
