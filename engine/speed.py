"""How fast this engine works: measured where the work runs, kept in one place, read by
whoever plans around it.

The rates, each learned once, as moving averages:
- **chunk prefill**, tokens per second: every chunk the engine computes (`engine.answer`,
  and the server's warm-up at start). The loading controller (`server/loading_controller.py`) reads
  it to decide whether a chunk's KV is read or computed.
- **prompt work**, `Engine.prompt_cost` units per second of a whole prompt pass, over every
  pass the scheduler finishes and over each mode's own: the cost model's ratios between modes
  are a guess (a blend pass ran about 1.3x its share, a reuse pass 0.9x, under 4 clients), so
  a pass's seconds are estimated at its own mode's rate once one of its mode has finished.
  The scheduler reads it to order prompt work by the seconds each pass has left
  (`engine/scheduler.py`), and with the mean seconds of a pass it tells the cluster's router
  how much prompt work it holds (`SchedulerStats.backlog_s`).
- **rows per expected row of each mode's pass**: the rows (token-layers) a finished pass's steps
  computed over its `Engine.prompt_rows` estimate. The scheduler reads a pass's progress in its
  rows; focus's own depend on what it keeps (a lookup over one chunk computes the question
  alone, a handover blends every chunk), so the estimate is scaled by what its mode's passes did.
- **prompt tokens per second of each mode's pass**: every pass the scheduler finishes that the
  KV tree did not serve, less the seconds spent computing its chunks. The loading controller
  reads it to serve a request by full prefill when reading and blending its chunks would take
  longer (a GPU reading KV from disk).

They differ on purpose: a pass's cost model is about the order of passes (reuse, blend,
focus, full), a chunk's prefill rate about one kind of work.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ragkv.types import Mode

_PREFILL_ALPHA = 0.3  # weight of the newest chunk in the prefill rate's moving average
_PASS_ALPHA = 0.2  # weight of the newest pass in the prompt-work rate's moving average


@dataclass(slots=True)
class _Rate:
    """A moving average: of `amount / seconds` (`observe`), or of values as they come (`add`)."""

    alpha: float
    value: float | None = None

    def observe(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self.add(amount / seconds)

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class EngineSpeed:
    """The engine's measured rates (see the module docstring). Written from the engine's
    thread, read from any (the loading controller runs on the retrieval pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prefill = _Rate(_PREFILL_ALPHA)
        self._passes = _Rate(_PASS_ALPHA)
        self._mode_passes: dict[Mode, _Rate] = {}  # the same, each mode's passes alone
        self._pass_s = _Rate(_PASS_ALPHA)  # seconds of one pass (`add`)
        self._modes: dict[Mode, _Rate] = {}
        self._rows: dict[Mode, _Rate] = {}  # rows a pass computed over its estimate, per mode

    def observe(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` tokens took `seconds` of engine time to prefill."""
        with self._lock:
            self._prefill.observe(tokens, seconds)

    @property
    def tokens_per_s(self) -> float | None:
        """Chunk prefill tokens per second; None until a chunk was measured."""
        with self._lock:
            return self._prefill.value

    def observe_pass(self, cost: float, seconds: float, mode: Mode | None = None) -> None:
        """A prompt pass of `cost` (`Engine.prompt_cost` units) in `mode` took `seconds` of prompt work."""
        with self._lock:
            self._passes.observe(cost, seconds)
            if mode is not None:
                self._mode_passes.setdefault(Mode(mode), _Rate(_PASS_ALPHA)).observe(cost, seconds)
            if seconds > 0:
                self._pass_s.add(seconds)

    @property
    def pass_s(self) -> float | None:
        """Seconds of prompt work of one pass, on average; None until a pass was measured."""
        with self._lock:
            return self._pass_s.value

    def cost_per_s(self, mode: Mode | None = None) -> float | None:
        """Prompt-work cost units per second of `mode`'s passes, of every pass until one of
        `mode` (or with mode None) was measured; None until a pass was measured."""
        with self._lock:
            rate = None if mode is None else self._mode_passes.get(Mode(mode))
            return self._passes.value if rate is None or rate.value is None else rate.value

    def observe_rows(self, mode: Mode, expected: int, done: int) -> None:
        """A `mode` pass estimated at `expected` rows (`Engine.prompt_rows`) computed `done`."""
        with self._lock:
            self._rows.setdefault(Mode(mode), _Rate(_PASS_ALPHA)).observe(done, expected)

    def rows_scale(self, mode: Mode) -> float:
        """Rows a `mode` pass computes per row of its estimate; 1.0 until one was measured."""
        with self._lock:
            rate = self._rows.get(Mode(mode))
            return 1.0 if rate is None or rate.value is None else rate.value

    def observe_prompt(self, mode: Mode, tokens: int, seconds: float) -> None:
        """A `mode` pass over a prompt of `tokens` tokens took `seconds` of prompt work (its chunks'
        compute not counted)."""
        with self._lock:
            self._modes.setdefault(Mode(mode), _Rate(_PASS_ALPHA)).observe(tokens, seconds)

    def prompt_tokens_per_s(self, mode: Mode) -> float | None:
        """Prompt tokens per second of a `mode` pass; None until one was measured."""
        with self._lock:
            rate = self._modes.get(Mode(mode))
            return None if rate is None else rate.value
