"""QueryRunner (server/answering.py): what a request holds goes back however its caller leaves."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ragkv.engine.kv.conversation import TreeKey, TreeSpot
from ragkv.engine.scheduler import Scheduler, SchedulerConfig
from ragkv.server.admission import Admission
from ragkv.server.answering import QueryRunner
from ragkv.server.backend import Prepared
from ragkv.server.metrics import ServerMetrics
from ragkv.server.query import Query
from tests.engine.fakes import CountingLease
from tests.server.fakes import FakeBackend


class _SlowPrepare(FakeBackend):
    """Its preparation leases the request's tree path and instructions, then waits for `go`."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.go = threading.Event(), threading.Event()
        self.leases: list[CountingLease] = []

    def prepare(self, query: Query, hits: object = None) -> Prepared:
        prepared = super().prepare(query, hits)
        self.leases = [CountingLease(), CountingLease()]
        key = TreeKey("context")
        prepared.request.tree = TreeSpot(key, (1, 2), self.leases[0])  # type: ignore[arg-type]
        prepared.request.instructions = TreeSpot(key, (3,), self.leases[1])  # type: ignore[arg-type]
        self.entered.set()
        assert self.go.wait(10), "the test never let the preparation finish"
        return prepared


def _runner(pool: ThreadPoolExecutor, scheduler: Scheduler) -> QueryRunner:
    return QueryRunner(admission=Admission(4), metrics=ServerMetrics(), retrieve_pool=pool, scheduler=scheduler)


def test_a_caller_that_leaves_during_preparation_lets_the_requests_tree_leases_go() -> None:
    """The client goes (its task cancelled) while retrieval and the tree lookup run on the pool:
    the preparation cannot be stopped there, and the request it then makes holds its tree path,
    which the tree cannot evict or shrink while leased. Its leases go as the preparation lands,
    with the collector off (the leases' own safety net, `TreeLease.__del__`, is not what frees them)."""
    backend, pool, scheduler = _SlowPrepare(), ThreadPoolExecutor(1), Scheduler(SchedulerConfig())
    runner = _runner(pool, scheduler)

    async def leave_during_prepare() -> None:
        events = runner.run(backend, Query("who wrote it"), arrived=time.perf_counter(), cancel=threading.Event())
        task = asyncio.ensure_future(anext(events))
        while not backend.entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    gc.disable()
    try:
        asyncio.run(leave_during_prepare())
        assert backend.leases == [] or [x.released for x in backend.leases] == [0, 0]  # still preparing
        backend.go.set()
        pool.shutdown(wait=True)  # the preparation lands, its caller long gone
        assert [x.released for x in backend.leases] == [1, 1]
        assert backend.started == []  # never submitted: nothing ran
    finally:
        gc.enable()
        scheduler.close()


def test_a_preparation_not_started_when_its_caller_leaves_never_runs() -> None:
    """Queued behind another on the retrieval pool, a preparation whose caller left is dropped."""
    backend, pool, scheduler = _SlowPrepare(), ThreadPoolExecutor(1), Scheduler(SchedulerConfig())
    runner = _runner(pool, scheduler)
    blocker = threading.Event()
    pool.submit(blocker.wait, 10)  # the pool's one thread is busy

    async def leave_while_queued() -> None:
        events = runner.run(backend, Query("who wrote it"), arrived=time.perf_counter(), cancel=threading.Event())
        task = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(leave_while_queued())
        blocker.set()
        backend.go.set()
        pool.shutdown(wait=True)
        assert not backend.entered.is_set()  # its preparation was cancelled before it ran
    finally:
        scheduler.close()


def test_a_caller_that_stays_is_answered_and_its_leases_go_with_its_work() -> None:
    """The same preparation awaited to the end: the answer comes, and the work's end lets go."""
    backend, pool, scheduler = _SlowPrepare(), ThreadPoolExecutor(1), Scheduler(SchedulerConfig())
    backend.go.set()
    runner = _runner(pool, scheduler)

    async def stay() -> list[object]:
        return [e async for e in runner.run(backend, Query("who wrote it"), arrived=time.perf_counter(),
                                            cancel=threading.Event())]

    try:
        events = asyncio.run(stay())
        assert type(events[-1]).__name__ == "QueryStats" and events[-1].text == "who wrote it "  # type: ignore[attr-defined]
        assert [x.released for x in backend.leases] == [1, 1]
    finally:
        pool.shutdown(wait=True)
        scheduler.close()
