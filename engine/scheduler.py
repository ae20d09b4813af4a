"""The scheduler: one thread owns every admitted request and runs them step by step.

Each iteration is schedule, execute, update:
1. **schedule** (`_schedule`) decides, without running anything, a typed `Plan`: which
   requests are dropped (client cancelled, deadline passed) and the one step that runs
   next: a `PromptStep` (one decoder layer of one request's prompt pass, or a piece of
   one: a long prompt's layers run in pieces of `Engine.step_rows()` rows) or a
   `DecodeStep` (one batched forward for every decoding request). Prompt work goes to
   the pass with the least work left (the `prompt_cost` it was submitted with, in seconds
   at its mode's measured rate, times the share of its `prompt_rows` still to compute,
   aged by the time it was passed over: shortest remaining first, without starving a long
   one). While
   others decode, prompt work runs in slices between decode steps, whatever pass it
   belongs to: each slice lasts as long as the last decode step took, times
   `prompt_share / (1 - prompt_share)` (at the default 0.6, 1.5 decode steps), so prompt
   work gets that share of the engine and a decoding request waits about 2.5 steps at most
   for its next token, however many passes arrive at once. A step expected to overrun the
   slice (it would take as long as its pass's last step took) waits for the next slice,
   after a decode step. A slice runs one step at least (no pass starves) and lasts
   `prompt_slice_s` at least. A short pass (reuse over a few chunks) fits one slice whole;
   a long one (full prefill) goes on across many. With nobody decoding, prompt work goes on;
2. **execute** runs that step: for a prompt step, the request's work generator to its next
   layer (a `LayerWork` it yields) and that layer, as one forward with the same layer of the
   other passes that stand there, within `prompt_batch_rows` rows (`engine.forward.run_layers`;
   with it, every pass first goes to its next layer, so passes that came in together go on
   together); `engine.decode.decode_batch` for a decode step (the weights are read once per
   step for all of them);
3. **update** moves the requests on from what the step returned (below). A request
   submitted meanwhile, or whose KV has arrived, is admitted before the next schedule:
   it can take the very next step.

A request is an `engine.request.Request`, submitted with its work (`Engine.work`), a
generator that yields
- a `LayerWork`: one layer of its prompt pass for the scheduler to run, alone or with other
  passes' same layer (the pass reads the output as it resumes); an `int`: a step of prompt
  work it did itself (either way the scheduler may switch to other work here);
- `WaitFor(futures, timeout_s)`: the work cannot go on until these are done (its chunks' KV
  reads): the scheduler parks it and resumes it from a future's done-callback, or once
  `timeout_s` has passed. A parked request costs nothing: the scheduler never polls, sleeps
  on I/O or counts the wait as prompt time, so a slow read stalls nobody's decode;
- `Decode(stream)`: the prompt is ready; the scheduler decodes `stream` in batches,
  sending each token id out as `TokenOut` (the consumer detokenizes them and applies stop
  strings off this thread, telling the request `stop_after`), and resumes the work when
  the stream ends;
- `ChunksReady`, `ChunkComputed`, `TokenOut`: outputs, handed to the request's sink as
  they come.
Its return value (`Answered`) goes out in `Finished`, the last output of every request,
which also carries the error of a work that raised.

Each request has a status (`Request.status`), and every transition is made in this module:
QUEUED (submitted) -> PROMPT (its prompt pass runs, layer by layer) <-> WAITING_KV
(parked on a `WaitFor`) -> DECODING (batched decode steps) -> FINISHED, with
`end_reason` (`EndReason`) set; a cancelled, expired or failed request goes to FINISHED
from any status.

When it goes idle, and every `heap_trim_s` seconds under load, it hands the host heap's
free pages back to the OS (`engine.kv.host_allocator.trim_host_heap`).

Admission counts KV bytes in flight as well as requests: `submit` refuses, with
`SchedulerFullError`, a request whose cache would take the total past `kv_budget_bytes`
(the KV tree's device bytes count too, shrunk first; the nodes the request's own lease holds
are its prompt's KV, counted once). A request refused or ended before its work ran lets its
tree leases go at once (`Request.let_go`).
Sampling is per request (each stream has its own generator); greedy decoding gives the
same tokens in a batch as alone (tests/engine/test_scheduler.py).

Knows nothing of gRPC, storage or the server: requests, token ids and tensors. The
scheduler holds only typed work (tests/engine/test_scheduler.py checks it holds no `Any`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ragkv.engine.decode import DecodeStream, decode_batch, pick_greedy
from ragkv.engine.decode_graphs import PooledDecoder
from ragkv.engine.forward import LayerWork, Step, run_layers
from ragkv.engine.host_threads import take_cores
from ragkv.engine.kv.host_allocator import trim_host_heap
from ragkv.engine.request import (
    Answered,
    ChunkComputed,
    ChunksReady,
    Decode,
    EndReason,
    Finished,
    Output,
    Request,
    RequestStatus,
    TokenOut,
    Work,
)
from ragkv.engine.speed import EngineSpeed
from ragkv.engine.work import WaitFor
from ragkv.errors import RagKVError

log = logging.getLogger(__name__)

_PARKED_CHECK_S = 0.1  # while jobs wait for KV, the idle loop looks for their cancels this often
_R = TypeVar("_R")  # a parked future's result, whatever it is (only its being done is read)


class SchedulerFullError(RagKVError):
    """A request would take the scheduler past its KV-memory or request budget."""


class SchedulerStoppedError(RagKVError):
    """The scheduler stopped (the server is shutting down) before the request finished."""


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 or nbytes == 0 else f"{nbytes / 2**10:.0f} KiB"


def _discard(request: Request, work: Work) -> None:
    """End a request's work, and let its KV tree leases go: a work that never ran (refused,
    stopped, cancelled while queued) runs none of its own cleanup when closed."""
    work.close()
    request.let_go()


class SharedKV(Protocol):
    """Device KV kept beside the requests' under the same budget (engine.kv.tree.KVTree is one)."""

    @property
    def nbytes(self) -> int: ...  # bytes held now

    def shrink(self, limit_bytes: int) -> int: ...  # give up what no request holds; bytes held after


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Budgets of the scheduler."""

    kv_budget_bytes: int = 8 << 30  # KV cache bytes of all requests in flight
    max_batch: int = 32  # requests decoding in one step at most
    # while requests decode, the share of the engine's time that prompt work gets: each slice of
    # prompt work between two decode steps lasts the last decode step's seconds x share / (1 -
    # share) (at 0.6, 1.5 decode steps: a decoding request waits about 2.5 steps at most); a step
    # goes in when it fits what is left, at its pass's last step's seconds
    prompt_share: float = 0.6
    prompt_slice_s: float = 0.05  # a slice lasts this long at least, whatever the decode step took
    # the order of prompt work: least remaining work first (submit's prompt_cost, less what the
    # pass has done), a second of waiting counting as this many seconds less work (no starving;
    # at 0.1 a full prefill with 1 s left goes before a newcomer's 0.2 s pass after 8 s)
    aging: float = 0.1
    heap_trim_s: float = 10.0  # under load, free host heap pages go back to the OS this often; 0 = never
    # prompt rows one step may carry from several passes at the same layer, run as one forward (a
    # layer's weights read once for all of them); 0 = one pass per step (the server's
    # --prompt-batch-rows is 512: docs/quality.md, Serving under load)
    prompt_batch_rows: int = 0

    def __post_init__(self) -> None:
        if (self.kv_budget_bytes < 1 or self.max_batch < 1 or self.prompt_slice_s <= 0
                or not 0 < self.prompt_share < 1 or self.aging < 0 or self.heap_trim_s < 0
                or self.prompt_batch_rows < 0):
            raise ValueError(f"scheduler budgets must be positive, got {self}")


Sink = Callable[[Output], None]  # where a request's outputs go (called on the scheduler thread)


@dataclass(slots=True, eq=False)  # identity: a job is itself, whatever its fields
class _Job:
    """A submitted request with what only the scheduler keeps of it."""

    request: Request  # status, budgets and timings live there
    work: Work  # the request's work (Engine.work)
    sink: Sink  # where its outputs go
    decode: DecodeStream | None = None  # set once it decodes
    next_token: int | None = None  # picked, not yet run through the model (the next decode step does)
    next_pick: int | None = None  # greedy: the token its last decode step's batched argmax chose
    wait: WaitFor | None = None  # WAITING_KV: what it waits for
    wake_at: float | None = None  # WAITING_KV: time.monotonic() when it resumes whatever its futures do
    step_s: float = 0.0  # seconds its last prompt step took: what its next one is expected to (0 = unknown)
    rows_done: int = 0  # rows its prompt steps have computed: its progress, against request.prompt_rows
    passed_over_s: float = 0.0  # seconds of other passes' prompt steps it waited through, ready to run
    layer: LayerWork | None = None  # PROMPT: the layer its pass stands at, yielded and not run yet


@dataclass(frozen=True, slots=True)
class PromptStep:
    """Run one step (a decoder layer, or a wait) of this request's prompt pass."""

    job: _Job


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """Pick these decoding requests' next tokens, then run them through the model in one batch."""

    jobs: tuple[_Job, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """What one iteration does, decided before anything runs (`Scheduler._schedule`)."""

    dropped: tuple[tuple[_Job, EndReason], ...]  # cancelled or expired: FINISHED without running
    step: PromptStep | DecodeStep | None  # the one step that runs; None = nothing can run now


@dataclass(slots=True)
class SchedulerStats:
    """Counters the server's metrics read (written by the scheduler thread only)."""

    running: int = 0  # requests admitted and in a prompt pass or decoding
    waiting: int = 0  # submitted, not run yet
    waiting_kv: int = 0  # parked until their KV reads are done
    kv_bytes: int = 0  # KV bytes admitted in flight
    backlog_s: float = 0.0  # estimated seconds of prompt work left in the passes it holds (`Scheduler.backlog_s`)
    steps: int = 0  # decode steps run
    on_step: list[Callable[[int, float], None]] = field(default_factory=list)  # (batch size, seconds)
    prompt_layers: int = 0  # prompt steps that ran a layer
    shared_layers: int = 0  # ... of them, those that ran several passes' same layer as one forward
    on_prompt_layer: list[Callable[[int, int], None]] = field(default_factory=list)  # (passes, rows)


class Scheduler:
    """Runs jobs on one thread, one planned step at a time (see the module docstring)."""

    def __init__(self, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.config = config
        self.stats = SchedulerStats()
        self._lock = threading.Condition()
        self._incoming: collections.deque[_Job] = collections.deque()  # QUEUED, under _lock
        self._wake = False  # a parked job's future is done (set by its callback, under _lock)
        self._kv_bytes = 0  # admitted, under _lock
        self._shared: SharedKV | None = None  # device KV kept beside the requests' (the engine's KV tree)
        self._stopping = False
        # the requests by status, scheduler thread only
        self._prompting: list[_Job] = []  # PROMPT
        self._parked: list[_Job] = []  # WAITING_KV
        self._decoding: list[_Job] = []  # DECODING
        self._slice_t0 = time.perf_counter()  # when the current slice of prompt work began
        self._slice_steps = 0  # prompt steps in it (a slice has one at least: no pass starves)
        self._decode_s = 0.0  # seconds the last decode step took: what a slice of prompt work is sized by
        self._trimmed = time.monotonic()  # last heap trim
        self._speed = EngineSpeed()  # prompt work's measured rate; the engine's own once shared (share_engine)
        self._decoder: PooledDecoder | None = None  # the engine's pooled decoder (share_engine); None = ragged
        self._thread = threading.Thread(target=self._loop, name="ragkv-scheduler", daemon=True)
        self._thread.start()

    def share_engine(self, shared: SharedKV | None, speed: EngineSpeed, decoder: PooledDecoder | None = None) -> None:
        """Run the engine's requests with what the engine keeps: count `shared`'s bytes (its KV
        tree) in the KV budget (a request is admitted when its KV, the requests' in flight and
        what `shared` holds fit, `shared` first giving up what no request holds to make room),
        learn prompt work's rate into the engine's `speed`, where the rest of its rates are, and
        decode with the engine's `decoder` (`Engine.decoder`: one pool, CUDA graphs) where it has one."""
        with self._lock:
            self._shared = shared
            self._speed = speed
            self._decoder = decoder

    def submit(self, request: Request, work: Work, sink: Sink) -> None:
        """Admit a request with its work (`Engine.work`), or raise SchedulerFullError naming the
        budget it would exceed. Its outputs go to `sink`, `Finished` last.

        The request's `kv_bytes` count against the budget; its `prompt_cost` (about how much
        work its prompt pass is) orders prompt work, the pass with the least work left first
        (0 = unknown: such passes go first, oldest first); its `cancel` and `deadline` end it.
        """
        budget = self.config.kv_budget_bytes
        kv_bytes = request.kv_bytes
        with self._lock:
            if self._stopping:
                _discard(request, work)
                raise SchedulerStoppedError("the server is stopping: no new requests")
            if kv_bytes > budget:
                _discard(request, work)
                raise SchedulerFullError(
                    f"this request needs {_mib(kv_bytes)} of KV cache, more than the whole budget of "
                    f"{_mib(budget)} (--kv-budget-bytes): ask for fewer chunks or tokens")
            # the tree's nodes its own leases hold are KV of its prompt, in `kv_bytes` already: counted
            # twice, a request whose path is most of the budget would be refused however often it came
            shared = 0 if self._shared is None else self._shared.nbytes
            own = min(request.leased_bytes, shared)
            if self._kv_bytes + kv_bytes + shared - own > budget and self._shared is not None:
                shared = self._shared.shrink(budget - self._kv_bytes - kv_bytes + own)
            if self._kv_bytes + kv_bytes + shared - own > budget:
                _discard(request, work)
                raise SchedulerFullError(
                    f"KV memory budget full: {_mib(self._kv_bytes)} of {_mib(budget)} (--kv-budget-bytes) in "
                    f"flight and {_mib(shared - own)} of the KV tree held by them, this request needs "
                    f"{_mib(kv_bytes)}: retry later")
            self._kv_bytes += kv_bytes
            request.status, request.submitted_at = RequestStatus.QUEUED, time.perf_counter()
            self._incoming.append(_Job(request, work, sink))
            self.stats.waiting = len(self._incoming)
            self._lock.notify()

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop after the current step; requests still running end STOPPED (their sink gets Finished)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)

    # ---- the loop (scheduler thread only)

    def _loop(self) -> None:
        take_cores()  # a server's one computing thread (engine/host_threads.py): a no-op elsewhere
        while self._admit():
            plan = self._schedule()
            self._execute(plan)
            self.stats.running = len(self._prompting) + len(self._decoding)
            self.stats.waiting_kv = len(self._parked)
            self.stats.backlog_s = self._backlog_s()
        for job in [*self._prompting, *self._decoding, *self._parked]:
            self._end(job, EndReason.STOPPED,
                      error=SchedulerStoppedError("the server stopped before this request finished: retry on another replica"))

    def _admit(self) -> bool:
        """Sleep until there is something to do; then QUEUED -> PROMPT for every newcomer and
        WAITING_KV -> PROMPT for every parked job whose KV is in. False once stopping."""
        self._trim_when_due()
        with self._lock:
            busy = self._prompting or self._decoding
            if not (self._incoming or self._wake or busy or self._parked or self._stopping) and self.config.heap_trim_s:
                self._trim()  # going idle: nothing in flight needs the free pages
            while not (self._incoming or self._wake or self._prompting or self._decoding or self._stopping
                       or self._due()):
                self._lock.wait(self._park_timeout())  # parked jobs wake us from their futures
            if self._stopping:
                self._prompting.extend(self._incoming)  # ended with the others
                self._incoming.clear()
                return False
            for job in self._incoming:
                job.request.status = RequestStatus.PROMPT
            self._prompting.extend(self._incoming)
            self._incoming.clear()
            self.stats.waiting = 0
        if self._wake or self._parked:
            self._unpark()
        return True

    # ---- schedule: decide the iteration's step, change nothing

    def _schedule(self) -> Plan:
        now = time.monotonic()
        dropped = tuple((job, reason) for job in (*self._prompting, *self._decoding, *self._parked)
                        if (reason := self._dropped(job, now)) is not None)
        gone = {job for job, _ in dropped}
        prompting = [j for j in self._prompting if j not in gone]
        decoding = tuple(j for j in self._decoding if j not in gone)
        return Plan(dropped, self._next_step(prompting, decoding))

    @staticmethod
    def _dropped(job: _Job, now: float) -> EndReason | None:
        req = job.request
        if req.deadline is not None and now > req.deadline:
            return EndReason.DEADLINE
        return EndReason.CANCELLED if req.cancel.is_set() else None

    def _next_step(self, prompting: list[_Job], decoding: tuple[_Job, ...]) -> PromptStep | DecodeStep | None:
        """The pass with the least work left gets the next layer step, unless others decode and
        its step does not fit what is left of this slice (`_fits`). A full batch takes no new pass."""
        if prompting and len(decoding) < self.config.max_batch:
            job = min(prompting, key=self._priority)  # stable: the oldest of equals
            if not decoding or self._fits(job):
                return PromptStep(job)
        return DecodeStep(decoding) if decoding else None

    def _slice_s(self) -> float:
        """Seconds of prompt work between two decode steps: the last decode step's seconds
        scaled so that prompt work gets `prompt_share` of the engine, `prompt_slice_s` at least."""
        share = self.config.prompt_share
        return max(self.config.prompt_slice_s, self._decode_s * share / (1.0 - share))

    def _fits(self, job: _Job) -> bool:
        """Whether `job`'s next step fits this slice of prompt work: the slice has run no step yet
        (one at least: no pass starves), or the step, expected to take as long as its pass's last
        step did (a pass's steps are layers over the same rows, or pieces of them), ends within
        the slice (`_slice_s`). A pass's own last step predicts its next one far better than one
        token rate for every step: a question-only step (reuse, a scoring pass) of 20 rows runs
        at about a tenth of a 1K-row step's tokens per second (a layer's fixed cost), and such
        steps pulled a shared rate down until a full prefill's step seldom fitted a slice after
        another step."""
        if not self._slice_steps:
            return True
        return time.perf_counter() - self._slice_t0 + job.step_s <= self._slice_s()

    def _priority(self, job: _Job) -> float:
        """Seconds of prompt work the pass has left (`_left_s`), less `aging` x the seconds it was
        passed over (other passes' steps ran while it was ready); the lowest goes next (shortest
        remaining first). A pass of unknown cost: 0 left.

        A cheap pass (reuse, blend, focus) that arrives while a full prefill runs takes over
        at the next layer and finishes in its own few steps, which keeps the mean time to
        first token low; the aging term bounds how long a full prefill can be passed over.
        It counts only the time passed over: counted from submission, a full prefill's own
        steps and the decode steps between them aged it too, and one 4 s into its pass went
        ahead of a fresh focus pass with less work left (the slowest focus of a 4-client run)."""
        cost = job.request.prompt_cost
        if not cost:
            return 0.0
        left = self._left_s(job)
        if left is None:  # no pass measured yet: by cost
            left = cost
        return left - self.config.aging * job.passed_over_s

    def _left_s(self, job: _Job) -> float | None:
        """Seconds of prompt work the pass has left: its cost at its mode's measured rate (once one
        of its mode finished; else every pass's), times the share of its rows still to compute
        (`Request.prompt_rows`, scaled by what its mode's passes computed of their estimates:
        `EngineSpeed.rows_scale`, against those its steps have yielded). A pass whose seconds
        outrun its estimate still has its rows to go: counted by seconds alone, it would have
        none, and it went ahead of every newcomer to its end (a focus pass 0.35 s past its
        estimate held a fresh reuse pass 0.5 s). Without rows: the estimate less the seconds it
        has had. None when its cost or a rate is unknown."""
        req = job.request
        rate = self._speed.cost_per_s(req.mode)
        if not req.prompt_cost or not rate:
            return None
        estimate = req.prompt_cost / rate
        if req.prompt_rows:  # its estimate scaled by what its mode's passes computed of theirs
            rows = req.prompt_rows * self._speed.rows_scale(req.mode)
            return estimate * max(1.0 - job.rows_done / rows, 0.0)
        return max(estimate - req.prompt_s, 0.0)

    def _backlog_s(self) -> float:
        """Seconds of prompt work left in the passes this scheduler holds (in a pass, or parked
        on their KV): what a request submitted now would wait behind at worst. A pass of unknown
        cost counts as the mean pass. The router prices a replica's load in it (`server/routing.py`)."""
        mean = self._speed.pass_s or 0.0
        return sum(mean if (left := self._left_s(job)) is None else left for job in (*self._prompting, *self._parked))

    # ---- execute and update

    def _execute(self, plan: Plan) -> None:
        for job, reason in plan.dropped:
            job.request.cancel.set()
            self._leave(job)
            self._end(job, reason)
        match plan.step:
            case PromptStep(job):
                if not self._decoding:  # nobody waits on this prompt work: the slice starts anew
                    self._new_slice()
                self._slice_steps += 1
                self._prompt_step(job)
            case DecodeStep(jobs):
                self._decode_step(list(jobs))
                self._new_slice()

    def _new_slice(self) -> None:
        self._slice_t0, self._slice_steps = time.perf_counter(), 0

    def _prompt_step(self, job: _Job) -> None:
        """Run one step of a prompt pass: its next layer, as one forward with the same layer of the
        other passes that stand there (`prompt_batch_rows`; each first goes to its next layer, so
        passes that came in together go on together). A pass that ends has its first token picked
        and sent at once (then DECODING), one that waits is parked (WAITING_KV)."""
        t0 = time.perf_counter()
        if self.config.prompt_batch_rows:
            for other in [j for j in self._prompting if j is not job and j.layer is None]:
                self._advance(other)
        item = job.layer if job.layer is not None else self._advance(job)
        computed = isinstance(item, LayerWork) or (type(item) is int and item > 0)
        ran = [job]
        if isinstance(item, LayerWork):
            shared = [(job, item), *self._joining(job, item)]
            ran = [j for j, _ in shared]
            run_layers([w for _, w in shared])
            st = self.stats
            st.prompt_layers += 1
            st.shared_layers += len(shared) > 1
            for hook in st.on_prompt_layer:
                hook(len(shared), sum(w.rows for _, w in shared))
            for j, w in shared:
                j.request.prompt_s += w.took_s
                j.rows_done += w.rows
                j.layer = None
        elif isinstance(item, int) and computed:  # a step that computed `item` rows itself
            job.rows_done += item
        took = time.perf_counter() - t0
        if computed:
            for j in ran:  # its pass's next step is expected to take as long
                j.step_s = took
        for other in self._prompting:  # ready, and passed over for this step
            if other not in ran:
                other.passed_over_s += took

    def _joining(self, job: _Job, work: LayerWork) -> list[tuple[_Job, LayerWork]]:
        """The passes whose next layer runs with `job`'s (`work`), each with that layer: those
        standing at the same layer (`LayerWork.joins`), least work left first, while the step's
        rows stay within `prompt_batch_rows` (none when it is 0)."""
        room = self.config.prompt_batch_rows - work.rows
        if room <= 0:
            return []
        out = []
        standing = [(j, j.layer) for j in self._prompting if j is not job and j.layer is not None]
        for other, layer in sorted(((j, w) for j, w in standing if work.joins(w)), key=lambda jw: self._priority(jw[0])):
            if layer.rows <= room:
                out.append((other, layer))
                room -= layer.rows
        return out

    def _advance(self, job: _Job) -> Step | Decode | None:
        """Run a prompt pass's work to its next step (it starts, the first time): a layer to run is
        kept as its `layer`; a wait parks it (WAITING_KV); a pass that ends has its first token
        picked and sent at once (DECODING), or has ended."""
        req = job.request
        t0 = time.perf_counter()
        if req.started_at is None:
            req.started_at = t0
        item = self._resume(job)
        req.prompt_s += time.perf_counter() - t0
        if isinstance(item, LayerWork):
            job.layer = item
        elif isinstance(item, WaitFor):  # waiting for its KV: parked, off the prompt work
            self._prompting.remove(job)
            self._park(job, item)
        elif job.decode is not None or item is None:  # decoding now, or ended
            self._prompting.remove(job)
            self._learn_rate(job)
            if job.decode is not None:
                job.request.status = RequestStatus.DECODING
                self._decoding.append(job)
                self._pick(job)  # its first token goes out now
        return item

    def _decode_step(self, jobs: list[_Job]) -> None:
        """Pick each decoding request's next token, then one batched forward for those that go on."""
        t0 = time.perf_counter()
        live = [j for j in jobs if j.next_token is not None or self._pick(j)]
        if not live:
            return
        streams: list[DecodeStream] = []
        tokens: list[int] = []
        for job in live:
            stream, token = job.decode, job.next_token
            assert stream is not None and token is not None, "a live job decodes, its next token picked"
            streams.append(stream)
            tokens.append(token)
            job.next_token = None
        try:
            caches = [s.cache for s in streams]
            logits = self._decoder.step(caches, tokens) if self._decoder is not None \
                else decode_batch(streams[0].lm, caches, tokens)  # [B, V]
        except Exception as exc:  # a bug or out of memory: every request of the step fails
            for job in live:
                self._fail(job, exc)
            return
        ok = []  # rows whose logits were taken
        for j, stream in enumerate(streams):
            try:
                stream.receive(logits[j])  # a constrained stream masks its row in place
                ok.append(j)
            except Exception as exc:  # a bug in one request's constraint fails that request alone
                self._fail(live[j], exc)
        greedy = [j for j in ok if streams[j].greedy]
        if greedy:  # one argmax over the batch's greedy rows; sampled rows pick per request (own seeds)
            for j, token in zip(greedy, pick_greedy(logits[greedy])):
                live[j].next_pick = token
        st = self.stats
        st.steps += 1
        dt = time.perf_counter() - t0
        self._decode_s = dt
        for hook in st.on_step:
            hook(len(live), dt)

    def _pick(self, job: _Job) -> bool:
        """Take a decoding job's next token and emit it; False once the job has left
        (its stream ended, or failed)."""
        stream = job.decode
        assert stream is not None, "_pick takes a decoding job"
        if job.request.stopped_after is not None:  # the consumer found a stop string
            stream.stop_after(job.request.stopped_after)
        try:
            token = stream.advance(job.next_pick)
            job.next_pick = None
        except Exception as exc:
            self._fail(job, exc)
            return False
        if token is not None:
            job.sink(TokenOut(token))
        if stream.finish_reason is not None:  # finished: the job reports its end
            self._decoding.remove(job)
            job.decode = None
            self._finish(job)  # its work runs to its end (the KV tree's insert reads the cache)
            self._give_back(stream)
            return False
        job.next_token = token
        return True

    def _resume(self, job: _Job) -> Step | Decode | None:
        """Run the job's work to its next step, its outputs to its sink; None once it has
        ended (Finished sent)."""
        try:
            while True:
                match next(job.work):
                    case int() | WaitFor() | LayerWork() as step:
                        return step
                    case Decode(stream) as decode:
                        job.decode = stream
                        return decode
                    case ChunksReady() | ChunkComputed() | TokenOut() as out:
                        job.sink(out)
        except StopIteration as done:
            self._end(job, EndReason.DONE, answered=done.value)
        except Exception as exc:  # handed to the request's owner, which maps it to a status
            self._end(job, EndReason.ERROR, error=exc)
        return None

    def _learn_rate(self, job: _Job) -> None:
        """Cost units per second of prompt work, from every finished pass, and the rows it computed
        over its estimate; prompt tokens per second of the pass's mode, from those the KV tree
        did not serve (`EngineSpeed`)."""
        req = job.request
        self._speed.observe_pass(req.prompt_cost, req.prompt_s, req.mode)
        if req.prompt_rows and job.rows_done:
            self._speed.observe_rows(req.mode, req.prompt_rows, job.rows_done)
        if req.tree is None or req.tree.lease is None:
            self._speed.observe_prompt(req.mode, req.prompt_tokens, req.prompt_s - req.chunk_s)

    # ---- WAITING_KV: parked on futures, woken by their callbacks or a timeout

    def _park(self, job: _Job, wait: WaitFor) -> None:
        """PROMPT -> WAITING_KV until every future of `wait` is done, or its timeout."""
        job.request.status, job.wait = RequestStatus.WAITING_KV, wait
        job.wake_at = None if wait.timeout_s is None else time.monotonic() + wait.timeout_s
        self._parked.append(job)
        for fut in wait.futures:
            fut.add_done_callback(self._on_done)  # runs at once if already done

    def _on_done(self, _future: Future[_R]) -> None:
        """A parked job's future is done (any thread): the loop looks at the parked jobs."""
        with self._lock:
            self._wake = True
            self._lock.notify()

    def _park_timeout(self) -> float | None:
        """How long the idle loop may sleep: until the next parked timeout, and at most
        `_PARKED_CHECK_S` while any job is parked (its client may cancel meanwhile)."""
        if not self._parked:
            return None
        times = [j.wake_at for j in self._parked if j.wake_at is not None] + [time.monotonic() + _PARKED_CHECK_S]
        return max(0.0, min(times) - time.monotonic())

    def _due(self) -> bool:
        """A parked job must be looked at: its timeout passed, or it was cancelled or expired."""
        now = time.monotonic()
        return any((j.wake_at is not None and j.wake_at <= now) or self._dropped(j, now) is not None
                   for j in self._parked)

    def _unpark(self) -> None:
        """WAITING_KV -> PROMPT for the parked jobs whose futures are all done or whose timeout passed."""
        with self._lock:
            self._wake = False
        now = time.monotonic()
        for job in list(self._parked):
            wait = job.wait
            assert wait is not None, "a parked job has its wait"
            if all(f.done() for f in wait.futures) or (job.wake_at is not None and job.wake_at <= now):
                self._parked.remove(job)
                job.request.status = RequestStatus.PROMPT
                job.wait, job.wake_at = None, None
                self._prompting.append(job)

    # ---- FINISHED

    def _finish(self, job: _Job) -> None:
        """Resume a job whose stream ended, so its work returns its counts, then end it."""
        self._resume(job)  # a work that yields a step after its decode ends with it unfinished
        if job.request.status is not RequestStatus.FINISHED:
            self._end(job, EndReason.ERROR, error=RuntimeError("a request's work went on after its decode: a bug"))

    def _fail(self, job: _Job, exc: Exception) -> None:
        """A step of this job raised: the error goes to its owner and the job ends."""
        self._leave(job)
        self._end(job, EndReason.ERROR, error=exc)

    def _leave(self, job: _Job) -> None:
        """Take the job off whichever list holds it."""
        for jobs in (self._prompting, self._decoding, self._parked):
            if job in jobs:
                jobs.remove(job)

    def _end(self, job: _Job, reason: EndReason, answered: Answered | None = None,
             error: Exception | None = None) -> None:
        """Any status -> FINISHED: the work closes, the KV budget goes back, `Finished` goes out."""
        req = job.request
        if req.status is RequestStatus.FINISHED:
            return
        req.status, req.end_reason, job.wait = RequestStatus.FINISHED, reason, None
        _discard(req, job.work)
        if job.decode is not None:
            self._give_back(job.decode)
        job.decode = None  # the cache goes with the stream
        with self._lock:
            self._kv_bytes -= req.kv_bytes
        self.stats.kv_bytes = self._kv_bytes
        job.sink(Finished(reason, answered, error))

    def _give_back(self, stream: DecodeStream) -> None:
        """An ended request's run in the decode pool goes back (no-op when it decoded ragged)."""
        if self._decoder is not None:
            self._decoder.release(stream.cache)

    # ---- host memory

    def _trim_when_due(self) -> None:
        if self.config.heap_trim_s and time.monotonic() - self._trimmed >= self.config.heap_trim_s:
            self._trim()

    def _trim(self) -> None:
        trim_host_heap()  # the holes requests of different sizes leave (engine/kv/host_allocator.py)
        self._trimmed = time.monotonic()
