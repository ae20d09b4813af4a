"""Stand-ins for the engine's collaborators, shared by the engine's and the server's tests."""

from __future__ import annotations


class CountingLease:
    """A stand-in for a KV tree lease (`TreeLease`) on no device bytes: counts its releases."""

    device_bytes = 0

    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1
