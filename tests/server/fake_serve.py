"""`python -m tests.server.fake_serve PORT_FILE`: the real server entry point over a slow fake backend.

Used by the SIGTERM test: the same `server.app.run` as `ragkv serve`, signals included.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from ragkv.server.app import RagServer, run
from tests.server.fakes import FakeBackend, settings


def main() -> int:
    port_file = Path(sys.argv[1])
    original_start = RagServer.start

    async def start_and_report(self: RagServer) -> int:
        port = await original_start(self)
        port_file.write_text(str(port))
        return port

    RagServer.start = start_and_report  # report the bound port to the test
    return asyncio.run(run(settings(grace_seconds=10.0), lambda _: FakeBackend(token_delay=0.05, n_pieces=20)))


if __name__ == "__main__":
    sys.exit(main())
