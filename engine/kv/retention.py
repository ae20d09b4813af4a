"""Retention that knows agents: the tool latencies a KV tree sees, and how long it pins an
answer's path ahead of LRU eviction until the agent's next call (Continuum's time-to-live).

An answer that may end in tool calls comes back as the
conversation's next call once the tool has run, and plain LRU evicts exactly those paths
first (the longest-waiting agent is the least recently used). So an insert may *pin* its
path for a time-to-live (`insert(..., pin_s=)`): an insert makes room from unpinned nodes
only (least recently used first) and stores less rather than spill a live pin; `shrink`
(admission making room for a running request) takes pinned nodes too, after every
unpinned one, soonest-expiring first. A pin ends when its time passes or when the next
call leases the path (`match`; that call's own insert pins again if it may end in tool
calls). A tenant's live pins hold at most `tenant_share` of the budget: past it, its path
is kept as any other. The time from such an answer to the next call on its path is a tool
latency the tree sees (`ToolLatency`): the pins' learned time-to-live is their p90.

Priorities between conversations are the client's to give (`retain_priority`, an integer in
-MAX_PRIORITY..MAX_PRIORITY, NVIDIA Dynamo's agent hint): each insert gives its path its
call's priority, and whenever a tier makes room, lower priorities leave first (then, within
one priority, unpinned by least recent use, then pins by their end: `KVTree._rank`). Giving
below 0 only lets one's own paths go sooner; above 0 holds within the tenant's share: while
the tenant's paths above 0 would hold more than `tenant_share` of the device budget, a new
path is kept at 0. A node's file keeps the priority it had when written, so a restarted tree
starts where the last one left off.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragkv.engine.kv.tree_node import LeasedPart, Node


MAX_PRIORITY = 100  # a conversation's priority is within -MAX_PRIORITY..MAX_PRIORITY (0 unless asked)


class ToolLatency:
    """The tool latencies a tree sees, and the time-to-live of its pins learned from them.

    A gap is the time from an answer that may end in tool calls to the next call that leases
    its path: the tool's run, the client's turn and the next call's retrieval. The learned
    time-to-live is the `quantile` of the last `window` gaps, within [1 s, `max_s`];
    `default_s` (within the same bounds) before any gap is seen. `max_s` 0 turns pins off.
    """

    def __init__(self, max_s: float = 60.0, default_s: float = 10.0, window: int = 256,
                 quantile: float = 0.9) -> None:
        if max_s < 0 or default_s < 0 or window < 1 or not 0.0 < quantile <= 1.0:
            raise ValueError(f"ToolLatency needs max_s and default_s >= 0, window >= 1 and quantile in (0, 1], "
                             f"got {max_s}, {default_s}, {window}, {quantile}")
        self.max_s, self.default_s, self.quantile = float(max_s), float(default_s), quantile
        self._gaps: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._gaps.append(max(0.0, float(seconds)))

    @property
    def observed(self) -> int:
        return len(self._gaps)

    def ttl(self) -> float:
        """Seconds a pin lasts when the client names none (0 = pins are off)."""
        if self.max_s <= 0:
            return 0.0
        with self._lock:
            gaps = sorted(self._gaps)
        guess = gaps[min(len(gaps) - 1, int(self.quantile * len(gaps)))] if gaps else self.default_s
        return min(max(guess, 1.0), self.max_s)


class Pins:
    """The KV tree's pinned nodes (the tree calls these under its lock), and the tool
    latencies that set how long a pin lasts."""

    def __init__(self, clock: Callable[[], float], latency: ToolLatency) -> None:
        self._now = clock
        self.latency = latency
        self._pins: dict[int, Node] = {}  # id -> node pinned (perhaps expired: pruned lazily)

    def add(self, node: Node) -> None:
        self._pins[id(node)] = node

    def discard(self, node: Node) -> None:
        self._pins.pop(id(node), None)

    def live(self, now: float | None = None) -> list[Node]:
        """The nodes whose pin has not ended (dropping the others from the index)."""
        now = self._now() if now is None else now
        for key in [k for k, n in self._pins.items() if n.pin <= now]:
            del self._pins[key]
        return list(self._pins.values())

    def pin(self, path: Sequence[Node], tenant: str, pin_s: float, parts_pos: int | None,
            tenant_bytes: float | None = None) -> None:
        """Pin `path` for `pin_s` seconds (not when the tenant's live pins would pass
        `tenant_bytes`: then it is kept as any path), and mark where the next call will part
        from it (`parts_pos`, a prompt position)."""
        now = self._now()
        if parts_pos is not None:
            for node in path:
                if node.start < parts_pos <= node.end:
                    node.answered, node.parts_at = now, parts_pos
                    break
        if tenant_bytes is not None:
            held = sum(n.nbytes for n in self.live(now) if n.key.owner == tenant)
            if held + sum(n.nbytes for n in path if n.pin <= now) > tenant_bytes:
                return
        for node in path:
            node.pin = max(node.pin, now + pin_s)
            self.add(node)

    def resumed(self, parts: Sequence[LeasedPart]) -> None:
        """A match leased `parts`: where it reached an answered prompt's end (`parts_at`), it
        is that conversation's next call, and the time since the answer is a tool latency.
        The pins of the nodes it covered (whole, or to that point) end: its own insert pins
        them again. A match that only passes through a node (another conversation parting
        from this one inside it) leaves its pin."""
        for part in parts:
            node, n = part.node, part.n
            answered, reached = node.answered, False
            if answered is not None and node.start + n >= node.parts_at:
                self.latency.observe(self._now() - answered)
                node.answered, reached = None, True
            if node.pin and (reached or n == len(node.ids)):
                node.pin = 0.0
                self.discard(node)
