"""A RagServer in its own event-loop thread of this process: for `ragkv bench --concurrency`,
the soak and the tests, which drive it through real gRPC clients on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from ragkv.server.app import BackendFactory, RagServer
from ragkv.server.settings import ServerSettings


class InProcessServer:
    """Start a RagServer on a background loop; `addr` is where clients connect.

    Args:
        settings: The server's settings (port 0 = any free port).
        factory: Builds the backend from the settings (e.g. `build_pipeline`).
        wait_loaded: Block until the backend is loaded (health SERVING).
        load_timeout: Seconds to wait for that.
    """

    def __init__(self, settings: ServerSettings, factory: BackendFactory, wait_loaded: bool = True,
                 load_timeout: float = 30.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ragkv-server-loop", daemon=True)
        self._thread.start()
        self.server = RagServer(settings, factory)
        self.port = self._call(self.server.start())
        self.addr = f"{settings.host}:{self.port}"
        if wait_loaded and not self.wait_loaded(load_timeout):
            self.stop()
            raise TimeoutError(f"the server did not load its backend within {load_timeout:.0f} s")

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_loaded(self, timeout: float = 30.0) -> bool:
        """Whether the backend finished loading within `timeout` seconds."""
        return self._call(self.server.wait_loaded(timeout), timeout + 1)

    def stop(self, grace: float = 0.0) -> None:
        """Drain (in-flight requests get `grace` seconds), then stop the loop."""
        if self.loop.is_running():
            self._call(self.server.drain(grace), grace + 30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
