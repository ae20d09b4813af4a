"""Admission: the bounded request queue and the count of RPCs in flight.

A Query holds a slot from admission until its stream ends; when every slot is
taken the next Query is refused at once (RESOURCE_EXHAUSTED) rather than waiting
behind a queue no deadline could survive. The in-flight count lets a drain wait
for the running requests. Event-loop only: not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ragkv.server.status import NotServingError, OverloadedError


class Admission:
    """Bounded slots for Query plus an in-flight counter for every RPC.

    Args:
        capacity: Queries admitted at once (the one decoding plus those waiting).
        on_depth: Called with the number of admitted Queries whenever it changes.
    """

    def __init__(self, capacity: int, on_depth: Callable[[int], None] = lambda _: None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._on_depth = on_depth
        self._queries = 0
        self._in_flight = 0
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def depth(self) -> int:
        """Queries admitted and not finished."""
        return self._queries

    @property
    def in_flight(self) -> int:
        """RPCs of any kind running now."""
        return self._in_flight

    @property
    def draining(self) -> bool:
        """Whether new RPCs are refused (the server is stopping)."""
        return self._draining

    def start_draining(self) -> None:
        """Refuse every new RPC from now on (UNAVAILABLE)."""
        self._draining = True

    @contextmanager
    def rpc(self) -> Iterator[None]:
        """Count one RPC in flight.

        Raises:
            NotServingError: The server is draining.
        """
        if self._draining:
            raise NotServingError("the server is shutting down; retry on another replica")
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @contextmanager
    def query_slot(self) -> Iterator[None]:
        """Hold one queue slot.

        Raises:
            OverloadedError: Every slot is taken.
        """
        if self._queries >= self._capacity:
            raise OverloadedError(f"the request queue is full ({self._capacity} queries); retry later")
        self._queries += 1
        self._on_depth(self._queries)
        try:
            yield
        finally:
            self._queries -= 1
            self._on_depth(self._queries)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no RPC is in flight; False if `timeout` seconds passed first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
