"""Eviction policies: which key a budgeted tier drops next.

A tracker knows keys and their use, nothing of sizes or tensors; the tier asks it
for a victim until its bytes fit the budget. Orders are exact and deterministic:

- LRU: the least recently used (put or hit) key.
- LFU: the key with the fewest uses (a put counts one, each hit one more); ties go
  to the least recently used.
- HYBRID: among the least recently used half of the keys (rounded up), the one with
  the fewest uses; ties go to the least recently used. New keys are safe from a
  burst of one-off keys that LFU would keep, and hot old keys survive a scan that
  LRU would let flush them.

Not thread-safe: the owning tier holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from enum import Enum
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Policy(str, Enum):
    """Eviction policy of a budgeted tier."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # least frequently used, LRU among equals
    HYBRID = "hybrid"  # least frequently used among the older half (LRU/LFU hybrid)


class EvictionTracker(Generic[K]):
    """Recency order and use counts of a tier's keys; picks victims by `policy`."""

    __slots__ = ("policy", "_uses")

    def __init__(self, policy: Policy = Policy.LRU) -> None:
        self.policy = Policy(policy)
        # Oldest first; value = number of uses (put counts one).
        self._uses: OrderedDict[K, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._uses)

    def __contains__(self, key: object) -> bool:
        return key in self._uses

    def add(self, key: K, uses: int = 1) -> None:
        """Record a newly stored key as the most recent (or touch it if present)."""
        if key in self._uses:
            self.touch(key)
            return
        self._uses[key] = uses

    def touch(self, key: K) -> None:
        """Record a use (a hit): most recent, one more use. Unknown keys are ignored."""
        if key in self._uses:
            self._uses[key] += 1
            self._uses.move_to_end(key)

    def remove(self, key: K) -> None:
        """Forget a key (deleted or evicted). Unknown keys are ignored."""
        self._uses.pop(key, None)

    def victim(self) -> K | None:
        """The key to evict next under `policy`, or None when empty. Does not remove it."""
        if not self._uses:
            return None
        if self.policy is Policy.LRU:
            return next(iter(self._uses))
        if self.policy is Policy.LFU:
            return self._least_used(len(self._uses))
        return self._least_used((len(self._uses) + 1) // 2)

    def _least_used(self, among_oldest: int) -> K:
        """Fewest uses among the `among_oldest` least recent keys; first (oldest) wins ties. O(n)."""
        best: K | None = None
        best_uses = 0
        for i, (key, uses) in enumerate(self._uses.items()):
            if i >= among_oldest:
                break
            if best is None or uses < best_uses:
                best, best_uses = key, uses
        if best is None:
            raise RuntimeError(f"bug: no victim among {among_oldest} of {len(self._uses)} keys")
        return best

    def keys_oldest_first(self) -> list[K]:
        """All keys, least recent first (for tests and listings)."""
        return list(self._uses)
