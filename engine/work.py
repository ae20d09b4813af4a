"""What a request's work hands the scheduler besides a finished step: a wait.

A prompt pass (`engine.blend.prompt_steps`) and a server's answer are generators; each
layer they yield (`engine.forward.LayerWork`, run by the scheduler, or by the pass itself as
it resumes when its driver did not) or `int` is one step of prompt work. A `WaitFor` says the work cannot go on
until some futures are done (a chunk's KV read, the next layer of a layer-wise read): the
scheduler parks the request and resumes it from the futures' callbacks, so no thread
sleeps on I/O. Outside the scheduler (`drain`, evals, tests) a wait simply blocks.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, cast

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WaitFor:
    """Yielded by work that cannot go on until `futures` are done (its KV reads): park it."""

    # the work resumes once all are done (or have failed). Their results are never read here, and
    # one wait may hold futures of different result types (a chunk's read, a layer's arrival): Any
    futures: tuple[Future[Any], ...]
    timeout_s: float | None = None  # ... or once this many seconds have passed (the work decides what then)

    def block(self) -> None:
        """Wait here, for callers that are not the scheduler."""
        concurrent.futures.wait(self.futures, timeout=self.timeout_s)


def wait_for(futures: Sequence[Future[Any] | None]) -> WaitFor | None:
    """A WaitFor for those of `futures` that are pending, or None when none is."""
    pending = tuple(f for f in futures if f is not None and not f.done())
    return WaitFor(pending) if pending else None


def drain(steps: Generator[object, None, T]) -> T:
    """Run work's steps to the end and return its result, blocking on its waits (not the
    scheduler's way: for evals, tests and one-off calls)."""
    while True:
        try:
            item = next(steps)
        except StopIteration as done:
            return cast(T, done.value)  # StopIteration.value is untyped: the generator's return value
        if isinstance(item, WaitFor):
            item.block()
