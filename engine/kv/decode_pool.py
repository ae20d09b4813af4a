"""Requests' KV in one pair of device tensors: what a shape-static decode step reads.

A request's prompt pass takes its cache from the pool (`new_cache`: one run of slots, the
`KVCache` holding views of it), so it decodes where its prompt left its KV, with no copy; a
cache made outside the pool (the pool was full) moves in once when it starts to decode
(`admit`). Every other part of the engine (the tree's insert after the answer, a follow-up's
reads) sees the cache's tensors as before. The pool's tensors never move while it lives, so a captured CUDA
graph can address every request's KV by offsets held in device buffers (`engine.decode_graphs`):
a request is `(start, length)` in one `[L, Hkv, S, D]` tensor, not a tensor of its own.

Runs are whole pages (`page_tokens`), each in the largest free range (`_take` says where in
it); a run that must grow takes the pages after it when they are free, else moves once to a
larger run. The last page is scratch: the padded
rows of a batch bucket write their K/V there and attend to it alone. `release` gives a run back
when the request ends.

The KV tree's device tier lives in the same tensors (`share`: a `SharedSlots` the tree holds
its nodes' slots in, within its own budget), so KV passes between a request and the tree with
no copy either way:

- an insert after the answer takes the request's slots for the new tokens (`hand`): the run
  gives them to the tree instead of back to the free list;
- a conversation's next call whose leased path lies in one run of slots, with the slots after
  it free, runs there (`borrow`): the path is the front of its run, leased until the run goes
  back, and its prompt pass computes only what is new, after it.

A path that does not lie so (a context shared by conversations whose turns lie elsewhere, a
match that ends inside a node) is copied into a new run, as before; `copied_tokens` counts it.

Requests come first. The tree's budget caps its share and reserves none of it: a run takes any
free slot, and one that finds no free range large enough has the tree move the unleased nodes
in its way down a tier (`reclaim`, `window`; host memory, else disk, as admission's shrink
moves them), so the requests admitted within `--kv-budget-bytes` decode inside the pool
whatever the tree holds. The tree keeps a new node on the device only in free slots
(`free_tokens`) or in the request's own (`hand`).
Thread-safe: the scheduler's thread takes and grows runs, the tree gives slots back from
whichever thread makes room (admission's `shrink` too).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.pool import KVPool

PAGE_TOKENS = 16  # slots per page: runs are whole pages


@dataclass(slots=True, eq=False)  # one run is one object: held in sets by identity
class Run:
    """One request's slots: [start, start + size)."""

    start: int
    size: int
    # the front `borrowed` slots are the KV tree's (a leased path the request runs after): never
    # given back by the run
    borrowed: int = 0
    handed: list[tuple[int, int]] = field(default_factory=list)  # [a, b) slots given to the tree (`hand`)
    # what the run holds in the tree while it may read it (the borrowed path's lease, the nodes it
    # handed on: the tree keeps them): let go when the run goes back or moves
    holds: list[Callable[[], None]] = field(default_factory=list)

    def own(self) -> list[tuple[int, int]]:
        """The slots [a, b) the run gives back when it goes: its own, less what it handed on."""
        out, at = [], self.start + self.borrowed
        for a, b in sorted(self.handed):
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < self.start + self.size:
            out.append((at, self.start + self.size))
        return out

    @property
    def held(self) -> int:
        """Slots the run counts as its own (not the tree's)."""
        return sum(b - a for a, b in self.own())


class DecodePoolFullError(RuntimeError):
    """The pool has no run of the size asked for (the caller decodes that request outside it)."""


class DecodePool:
    """K and V slots `[L, Hkv, S, D]` on one device; each decoding request holds one run of them."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_tokens: int,
                 dtype: torch.dtype, device: torch.device | str, page_tokens: int = PAGE_TOKENS) -> None:
        if capacity_tokens < 2 * page_tokens:
            raise ValueError(f"a decode pool needs at least 2 pages of {page_tokens} tokens, got {capacity_tokens} tokens")
        self.page_tokens = page_tokens
        pages = capacity_tokens // page_tokens
        slots = pages * page_tokens
        try:
            self.k = torch.zeros(num_layers, num_kv_heads, slots, head_dim, dtype=dtype, device=device)  # [L, Hkv, S, D]
            self.v = torch.zeros_like(self.k)  # [L, Hkv, S, D]
        except torch.OutOfMemoryError as exc:
            need = 2 * num_layers * num_kv_heads * slots * head_dim * dtype.itemsize
            raise MemoryError(f"the decode pool's {need / 2**30:.1f} GiB of KV ({slots} tokens) do not fit on {device}: "
                              "it holds --kv-budget-bytes (the KV tree's device tier within it); lower it, "
                              "or --decode-pool off") from exc
        self.scratch = slots - page_tokens  # the last page: padded rows write and read here
        self._free: list[Run] = [Run(0, self.scratch)]  # by start, adjacent runs merged
        self._held: dict[Run, weakref.finalize[[Run], KVCache]] = {}  # each run held -> what frees it if its cache is dropped
        self._dropped: list[Run] = []  # runs of caches dropped unreleased (any thread): back at the next take
        self._lock = threading.RLock()
        self._to_let_go: list[Callable[[], None]] = []  # what runs that went back held in the tree: let go outside the lock
        self.tree_tokens = 0  # slots the KV tree holds (`SharedSlots`)
        self.tree_room = 0  # slots the tree may hold at most (its budget): a cap, runs take any free slot
        # the tree's `reclaim(tokens)`: give up unleased nodes so a run of `tokens` fits (None: no tree)
        self.reclaim: Callable[[int], bool] | None = None
        self.reclaimed_tokens = 0  # the tree's tokens that left the pool to make room for a run
        self.copied_tokens = 0  # tokens' KV copied in by admit and moves (a lease or insert would add none)
        self.moves = 0  # runs that had to move to grow
        self.borrowed_tokens = 0  # tokens of leased paths that requests ran after in place (no copy)
        self.handed_tokens = 0  # tokens' KV given to the KV tree in place (no copy)
        self.relocated_tokens = 0  # the tree's tokens moved out of a lent path's way (`relocate`)
        self.rehomed_tokens = 0  # the tree's tokens kept in a request's copy of them instead (`rehome`)

    @property
    def capacity(self) -> int:
        """Token slots for requests and the tree (the scratch page not counted)."""
        return self.scratch

    @property
    def used(self) -> int:
        """Token slots held by runs (a dropped cache's until the next take) and by the tree."""
        return self._run_tokens() + self.tree_tokens

    def _run_tokens(self) -> int:
        return sum(r.held for r in self._held)

    @property
    def free_tokens(self) -> int:
        """Token slots neither a run nor the tree holds."""
        with self._lock:
            self._take_dropped()
            return sum(f.size for f in self._free)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V."""
        L, H, _, D = self.k.shape
        return 2 * L * H * D * self.k.element_size()

    def share(self, budget_bytes: int) -> SharedSlots:
        """The KV tree's device tier in this pool: at most `budget_bytes` of its slots (and at most
        the pool), handed out as the tree's `KVPool` is. It reserves none of them: the tree sets
        `reclaim`, so a run takes back the room of nodes no lease holds."""
        with self._lock:
            self.tree_room = min(budget_bytes // self.token_bytes, self.capacity)
            return SharedSlots(self, budget_bytes)

    def run_of(self, cache: KVCache) -> Run | None:
        """The run `cache` holds, or None when it is not in the pool."""
        run = cache.run
        return run if cache.pool is self and isinstance(run, Run) else None

    def new_cache(self, capacity: int) -> KVCache | None:
        """An empty cache of `capacity` tokens in a run of the pool, or None when no run is that
        large (the caller makes one of its own). A cache dropped without `release` (a pass that
        failed or was cancelled before it decoded) gives its run back when it is collected."""
        try:
            run = self._run_for(capacity)
        except DecodePoolFullError:
            return None
        with self._lock:
            return self._cache(run)

    def _run_for(self, tokens: int) -> Run:
        """A new run of `tokens` (`_take`); when no free range holds it and the tree shares the pool,
        once more after the tree gave up the nodes in the way (`reclaim`, outside the pool's lock:
        the tree takes its own lock, then this one)."""
        try:
            with self._lock:
                return self._take(tokens)
        except DecodePoolFullError:
            if self.reclaim is None:
                raise
        finally:
            self._let_go()
        before = self.tree_tokens
        if not self.reclaim(self._pages(max(tokens, 1))):
            raise DecodePoolFullError(f"the decode pool has no run of {self._pages(max(tokens, 1))} tokens, "
                                      "even with the KV tree's unleased nodes moved out")
        with self._lock:
            self.reclaimed_tokens += max(before - self.tree_tokens, 0)
            return self._take(tokens)

    def window(self, tokens: int, evictable: torch.Tensor) -> tuple[int, int] | None:
        """Where a run of `tokens` could go once the tree gives up some of `evictable` (the slots
        it may let go, [T] on the host): the slots [a, a + tokens), each free or evictable, with the
        fewest evictable; None when no such slots lie together."""
        with self._lock:
            self._take_dropped()
            if tokens > self.scratch:
                return None
            state = torch.full((self.scratch,), 2, dtype=torch.int8)  # [S]: 0 free, 1 evictable, 2 held
            for f in self._free:
                state[f.start:f.start + f.size] = 0
            state[evictable] = 1
            zero = torch.zeros(1, dtype=torch.int64)
            held = torch.cat([zero, torch.cumsum(state == 2, 0)])  # [S + 1]
            taken = torch.cat([zero, torch.cumsum(state == 1, 0)])  # [S + 1]
            cost = (taken[tokens:] - taken[:-tokens]).float()  # [S - tokens + 1] evictable slots in each window
            cost[(held[tokens:] - held[:-tokens]) > 0] = float("inf")
            a = int(torch.argmin(cost))
            return None if cost[a] == float("inf") else (a, a + tokens)

    def borrow(self, start: int, held: int, capacity: int, let_go: Callable[[], None],
               least: int = 0) -> KVCache | None:
        """A cache of `capacity` tokens whose first `held` are the KV tree's slots [start, start +
        held) (a leased path, K after RoPE where the request's prompt puts them), running on into
        the free slots after them: the lease's KV is read where it lies, not copied. Fewer free
        there than `capacity`, but at least `least` (its prompt: its decode grows the run, in
        place or by a move): the cache holds what is free, in whole pages. None when fewer are
        free (the caller copies the path into a new run). `let_go` (the lease's release) is
        called once the run no longer reads the tree's slots: when it goes back, or moves to grow."""
        try:
            with self._lock:
                self._take_dropped()
                a = start + held
                f = next((f for f in self._free if f.start <= a < f.start + f.size), None)
                if f is None:
                    return None
                room = (f.start + f.size - a) // self.page_tokens * self.page_tokens  # whole pages free after the path
                size = held + min(self._pages(max(capacity - held, 1)), room)
                if size < max(least or capacity, held + 1):
                    return None
                b = start + size
                self._carve(f, a, b)
                run = Run(start, size, borrowed=held, holds=[let_go])
                self.borrowed_tokens += held
                return self._cache(run)
        finally:
            self._let_go()

    def _cache(self, run: Run) -> KVCache:
        cache = KVCache.over(self.k[:, :, run.start:run.start + run.size], self.v[:, :, run.start:run.start + run.size])
        self._own(cache, run)
        return cache

    def hand(self, cache: KVCache, start: int, stop: int, let_go: Callable[[], None]) -> torch.Tensor | None:
        """Give the KV tree positions [start, stop) of `cache` (slots of its run) with no copy:
        their slot indices ([stop - start] int64, on the host), now the tree's, which the run
        no longer gives back. The request may still read them (an insert of its instructions
        before it decodes), so the tree holds them until `let_go`, called when the run goes
        back or moves. None when `cache` is not in this pool, or the positions are not its own
        (the tree copies them)."""
        with self._lock:
            slots = self._from_run(cache, start, stop, let_go)
            if slots is not None:
                self.tree_tokens += len(slots)
                self.handed_tokens += len(slots)
            return slots

    def _from_run(self, cache: KVCache, start: int, stop: int, let_go: Callable[[], None]) -> torch.Tensor | None:
        """The slots of `cache`'s positions [start, stop), taken from its run for the tree (held
        until `let_go`), or None when they are not the run's own (under the lock)."""
        run = self.run_of(cache)
        if run is None or start < run.borrowed or stop > cache.length or start >= stop:
            return None
        a, b = run.start + start, run.start + stop
        if any(x < b and a < y for x, y in run.handed):
            return None
        run.handed.append((a, b))
        run.holds.append(let_go)
        return torch.arange(a, b)

    def rehome(self, cache: KVCache, start: int, stop: int, old: torch.Tensor,
               let_go: Callable[[], None]) -> torch.Tensor | None:
        """The KV tree's node of positions [start, stop), of which `cache` holds a copy in its own
        slots (its lease's path, copied in), is kept there from now on: those slots become the
        tree's, held as `hand` holds them, and the node's `old` slots ([stop - start] on the host)
        go back free. No KV moves; the conversation's path lies in the request's run again, so
        its next call can run on from it in place. None when they are not the run's own."""
        with self._lock:
            slots = self._from_run(cache, start, stop, let_go)
            if slots is not None:  # as many as it gives back: the tree holds as many slots as before
                self._give_slots(old)
                self.rehomed_tokens += len(slots)
            return slots

    def take_slots(self, n: int) -> torch.Tensor:
        """`n` free slots for the tree: their indices, [n] int64 ascending, on the host. Raises
        MemoryError past the tree's room (the tree makes room first, so that is a bug)."""
        with self._lock:
            self._take_dropped()
            if self.tree_tokens + n > self.tree_room:
                raise MemoryError(f"the KV tree's share of the decode pool cannot hold {self.tree_tokens + n} "
                                  f"tokens in its {self.tree_room}: a bug")
            slots = self._slots(n)
            self.tree_tokens += n
            return slots

    def relocate(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Move the tree's KV at `slots` ([T] on the host) to other free slots, so the slots it
        leaves are free (a path's tail that a conversation's next call runs over): the new
        indices, or None when the pool has no T other free slots now."""
        with self._lock:
            try:
                new = self._slots(len(slots))
            except MemoryError:
                return None
            src, dst = slots.to(self.k.device), new.to(self.k.device)
            self.k.index_copy_(2, dst, self.k.index_select(2, src))
            self.v.index_copy_(2, dst, self.v.index_select(2, src))
            self.relocated_tokens += len(slots)
            self._give_slots(slots)
            return new

    def _slots(self, n: int) -> torch.Tensor:
        """Take `n` free slots: the end of the smallest free range that holds them, else the ends
        of the largest ranges, in pieces (a range's start stays free: it may be the room after a
        run or a path). Raises MemoryError when fewer are free."""
        if n == 0:
            return torch.empty(0, dtype=torch.long)
        fits = [f for f in self._free if f.size >= n]
        ranges = [min(fits, key=lambda f: f.size)] if fits else sorted(self._free, key=lambda f: -f.size)
        pieces, left = [], n
        for f in ranges:
            take = min(left, f.size)
            pieces.append(torch.arange(f.start + f.size - take, f.start + f.size))
            f.size, left = f.size - take, left - take
            if f.size == 0:
                self._free.remove(f)
            if not left:
                break
        pieces.sort(key=lambda p: int(p[0]))
        if left:  # the runs hold more than their share: a bug
            for p in pieces:
                self._give(Run(int(p[0]), len(p)))
            raise MemoryError(f"the decode pool has no {n} free slots for the KV tree: a bug")
        return torch.cat(pieces)

    def give_slots(self, slots: torch.Tensor) -> None:
        """The tree gives `slots` ([T] on the host) back."""
        with self._lock:
            self._give_slots(slots)
            self.tree_tokens -= len(slots)

    def _give_slots(self, slots: torch.Tensor) -> None:
        if not len(slots):
            return
        s = torch.sort(slots).values
        cut = (torch.nonzero(s[1:] != s[:-1] + 1).flatten() + 1).tolist()  # where a new range starts
        for a, b in zip([0, *cut], [*cut, len(s)]):
            self._give(Run(int(s[a]), b - a))

    def admit(self, cache: KVCache, room: int) -> None:
        """Move `cache` into a run with room for `room` tokens (at least its length), copying its
        valid KV once; its k and v become views of the pool. A cache already here is grown to `room`.

        Raises:
            DecodePoolFullError: no free run is that large.
            ValueError: the cache's shape or dtype is not the pool's.
        """
        if self.run_of(cache) is not None:
            self.grow(cache, room)
            return
        L, H, _, D = cache.k.shape
        if (L, H, D) != (self.k.shape[0], self.k.shape[1], self.k.shape[3]) or cache.k.dtype != self.k.dtype:
            raise ValueError(f"a cache of [L={L}, Hkv={H}, D={D}] {cache.k.dtype} cannot enter a decode pool of "
                             f"{tuple(self.k.shape)} {self.k.dtype}")
        run = self._run_for(max(room, cache.length))
        n = cache.length
        self.k[:, :, run.start:run.start + n] = cache.k[:, :, :n]
        self.v[:, :, run.start:run.start + n] = cache.v[:, :, :n]
        self.copied_tokens += n
        self._own(cache, run)
        self._point(cache, run)

    def _own(self, cache: KVCache, run: Run) -> None:
        self._held[run] = weakref.finalize(cache, self._dropped.append, run)
        cache.pool, cache.run = self, run

    def grow(self, cache: KVCache, tokens: int) -> None:
        """Give `cache`'s run room for `tokens` tokens: the free pages right after it, else a move
        (which lets go of a borrowed path: the run then holds a copy of it)."""
        run = self.run_of(cache)
        if run is None:
            raise RuntimeError("DecodePool.grow of a cache not in the pool: a bug")
        if tokens <= run.size:
            return
        with self._lock:
            need = run.borrowed + self._pages(tokens - run.borrowed)
            after = next((f for f in self._free if f.start == run.start + run.size), None)
            if after is not None and run.size + after.size >= need:
                extra = need - run.size
                after.start, after.size = after.start + extra, after.size - extra
                if after.size == 0:
                    self._free.remove(after)
                run.size = need
                self._point(cache, run)
                return
        try:
            with self._lock:
                new = self._take(max(tokens, cache.doubled()))  # doubling as a cache of its own would, to its most
        except DecodePoolFullError:
            new = self._run_for(tokens)  # what it needs: the tree gives up room for that much only
        with self._lock:
            n = cache.length
            self.k[:, :, new.start:new.start + n] = self.k[:, :, run.start:run.start + n]
            self.v[:, :, new.start:new.start + n] = self.v[:, :, run.start:run.start + n]
            self.copied_tokens += n
            self.moves += 1
            if run.borrowed:  # its copy of the leased path: the tree may keep the path there (`rehome`)
                cache.from_tree = max(cache.from_tree, run.borrowed)
            self._held.pop(run).detach()
            self._give_back(run)
            self._own(cache, new)
            self._point(cache, new)
        self._let_go()

    def release(self, cache: KVCache, keep: bool = True) -> None:
        """`cache`'s run goes back (what it handed the tree stays the tree's, a borrowed path's
        lease is let go), and the cache is no longer the pool's. `keep`: it keeps a copy of its
        KV (it decodes on outside the pool); else it is left empty (its request ended: the tree
        took what it keeps before, so nothing is copied)."""
        run = self.run_of(cache)
        if run is None:
            return
        with self._lock:
            self._held.pop(run).detach()
            n = cache.length if keep else 0
            cache.k, cache.v = cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone()  # [L, Hkv, n, D]
            cache.length = n
            cache.pool, cache.run = None, None
            self._give_back(run)
        self._let_go()

    def _point(self, cache: KVCache, run: Run) -> None:
        cache.k = self.k[:, :, run.start:run.start + run.size]  # [L, Hkv, size, D], a view
        cache.v = self.v[:, :, run.start:run.start + run.size]

    def _pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole pages."""
        p = self.page_tokens
        return -(-tokens // p) * p

    def _take_dropped(self) -> None:
        while self._dropped:  # caches collected unreleased: their runs come back first
            run = self._dropped.pop()
            if self._held.pop(run, None) is not None:
                self._give_back(run)

    def _take(self, tokens: int) -> Run:
        """A new run of `tokens` (whole pages) in the largest free range. A range that follows
        held slots (a run that may grow, a conversation's path whose next call may run on from it:
        `borrow`) keeps half its slack before the new run, when the slack is at least the run's
        size; else the run starts the range (so a full pool packs as first fit would)."""
        self._take_dropped()
        size = self._pages(max(tokens, 1))
        f = max(self._free, key=lambda f: f.size, default=None)
        if f is None or f.size < size:
            raise DecodePoolFullError(f"the decode pool has no run of {size} free tokens "
                                      f"({self.used} of {self.capacity} held)")
        slack = f.size - size
        start = f.start + (slack // 2 // self.page_tokens * self.page_tokens if f.start > 0 and slack >= size else 0)
        self._carve(f, start, start + size)
        return Run(start, size)

    def _carve(self, f: Run, a: int, b: int) -> None:
        """Take slots [a, b) out of the free range `f` that holds them."""
        self._free.remove(f)
        for piece in (Run(f.start, a - f.start), Run(b, f.start + f.size - b)):
            if piece.size:
                self._free.append(piece)
        self._free.sort(key=lambda r: r.start)

    def _give_back(self, run: Run) -> None:
        """A run that ended or moved: its own slots back to the free list; a borrowed path's lease let go."""
        for a, b in run.own():
            self._give(Run(a, b - a))
        self._to_let_go.extend(run.holds)  # called by `_let_go`, outside the lock: they take the tree's
        run.holds, run.borrowed = [], 0

    def _let_go(self) -> None:
        """Let go of what runs that went back held in the tree. Never under the pool's lock
        (a lease's release takes the tree's lock, under which the tree gives the pool slots), and
        never from the tree's calls (`take_slots`, `give_slots`: they come under the tree's lock)."""
        while True:
            try:
                done = self._to_let_go.pop()
            except IndexError:  # none left (or another thread took the last)
                return
            done()

    def _give(self, run: Run) -> None:
        """Slots back into the free list, merged with their free neighbours."""
        self._free.append(Run(run.start, run.size))
        self._free.sort(key=lambda f: f.start)
        merged: list[Run] = []
        for f in self._free:
            if merged and merged[-1].start + merged[-1].size == f.start:
                merged[-1].size += f.size
            else:
                merged.append(f)
        self._free = merged


class SharedSlots(KVPool):
    """The KV tree's device tier inside a `DecodePool` (`DecodePool.share`): the tree's `KVPool`
    calls, over the decode pool's tensors, within the tree's budget. It never grows or
    compacts (the tensors are the decode pool's, fixed), and takes a request's KV in place when
    the request's cache is in the pool (`adopt`)."""

    def __init__(self, pool: DecodePool, budget_bytes: int) -> None:
        super().__init__(budget_bytes, pool.k.device)
        self.decode_pool = pool
        self.k, self.v = pool.k, pool.v

    @property
    def capacity(self) -> int:
        """Token slots the tree holds: its spare room is the decode pool's, not the tree's memory."""
        return self.decode_pool.tree_tokens

    @property
    def used(self) -> int:
        return self.decode_pool.tree_tokens

    def put(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._shape_check(k, v)
        slots = self.decode_pool.take_slots(k.shape[2])  # [T] (CPU)
        self.written_tokens += len(slots)
        pk, pv = self.decode_pool.k, self.decode_pool.v  # [L, Hkv, S, D]
        at = slots.to(pk.device, non_blocking=True)
        pk.index_copy_(2, at, k.to(pk.device, pk.dtype))
        pv.index_copy_(2, at, v.to(pv.device, pv.dtype))
        return slots

    def adopt(self, cache: KVCache, start: int, stop: int, let_go: Callable[[], None]) -> torch.Tensor | None:
        return self.decode_pool.hand(cache, start, stop, let_go)

    def release(self, slots: torch.Tensor) -> None:
        self.decode_pool.give_slots(slots)

    def relocate(self, slots: torch.Tensor) -> torch.Tensor | None:
        return self.decode_pool.relocate(slots)

    def rehome(self, cache: KVCache, start: int, stop: int, old: torch.Tensor,
               let_go: Callable[[], None]) -> torch.Tensor | None:
        return self.decode_pool.rehome(cache, start, stop, old, let_go)

    def compact(self, capacity_bytes: int) -> torch.Tensor | None:
        return None

    def lend(self, slots: torch.Tensor, capacity: int, least: int, let_go: Callable[[], None]) -> KVCache | None:
        """A request cache of `capacity` tokens (at least `least`) running on from the tree's
        `slots` (a leased path, one ascending run), or None when they are not one run or the slots
        after them are not free (`DecodePool.borrow`)."""
        n = len(slots)
        if n == 0 or not torch.equal(slots, torch.arange(int(slots[0]), int(slots[0]) + n)):  # one ascending run
            return None
        return self.decode_pool.borrow(int(slots[0]), n, capacity, let_go, least)

    def _shape_check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        pk, pv = self.decode_pool.k, self.decode_pool.v
        if (k.shape[:2], k.shape[3]) != (pk.shape[:2], pk.shape[3]) or v.shape[1] != pv.shape[1]:
            raise ValueError(f"the KV tree holds KV of shape {tuple(pk.shape)}, not {tuple(k.shape)}: "
                             "one tree serves one model")
