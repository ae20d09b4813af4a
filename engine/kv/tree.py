"""The KV tree: a radix tree of served prompts' KV, so a conversation's next call computes
only what is new (SGLang's RadixAttention, arXiv 2312.07104, over blended chunk KV).

Each root is one *context*: what made the KV before the tokens the tree matches. Its key
(`TreeKey`) names the model, the mode, the prefix, the chunk keys in order and the options
that changed the chunks' KV (and, where the mode chooses chunk tokens by the question, the
question those choices were made by: `Engine.select_ids`). The root holds the context's KV
as the prompt pass left it (prefix and chunks, blended); below it, edges of token ids hold
the KV of the question, the conversation and the answers, K after RoPE at their final
positions. FULL mode's context is empty (automatic prefix caching over every token);
PREFIX's is the prefix.

Lifetime: a request leases the path it matched (`KVTree.match`, reference counts on every
node of it) and releases it when its prompt pass has copied it (`TreeLease.release`, also
on garbage collection of a lease never released). After the answer, the request's whole
sequence is inserted (`KVTree.insert`). The tree holds at most `budget_bytes` on the
device: an insert makes room from least-recently-used nodes that no lease holds and that
hold no device node below them, and inserts nothing when the budget cannot hold it. A
leased node is never split or evicted, so a lease's tokens stay as they were matched.

Storage: the device and CPU tiers each keep their nodes' KV in one pool of token slots
(`engine.kv.pool.KVPool`); a node holds indices into it (`Node.slots`), so a split moves no
KV and a lease copies its path out once, under the lock, when its pass writes it. Admission's
`shrink` compacts the device pool and renumbers the nodes' slots. Where the engine decodes
over one pool, the device tier is a share of it (`engine.kv.decode_pool.SharedSlots`): an
insert takes the request's slots where its KV lies, and a lease whose path lies in one run
lends it to the next request in place (`TreeLease.lend`), held until that request ends; that
pool never compacts.

Tiers (SGLang HiCache's, over conversations): a node that makes room on the device moves
down to CPU memory (`host_bytes`), and from there to disk (`files`, `disk_bytes`: kvstore's
checksummed chunk-KV files); only a node past the last tier leaves the tree. A match reads a
spilled path back (host copies, disk reads off the tree's lock, on the retrieval thread that
leases), and the insert after its answer puts it back on the device from the request's own
cache. `persist` (at shutdown) writes what the device and host hold to disk, and a tree made
over the same files finds every spilled conversation again, under the same keys. A file
that cannot be read is a miss for that node and below (its tokens are computed), never an
error. Hybrids keep no tiers (a recurrent state is not spilled). The disk tier is an object
the tree owns (`KVTree.disk`, `engine.kv.tree_disk.TreeDisk`).

Retention that knows agents (`engine.kv.retention`): an insert may *pin* its path ahead of LRU
for a time-to-live (`insert(..., pin_s=)`), until the agent's next call leases it.

A hybrid's recurrent layers (`KVTree(recurrent=True)`) keep a state no K/V stands in for,
so the tree also keeps that state where a prompt ended (`RecurrentSnapshot`, on the node
that ends there, split to end there), as SGLang does for Mamba: a match then stops at the
deepest node holding one, and the resumed pass starts from a copy of it.

Thread-safe: leases are taken on the server's retrieval threads, inserts run on the
scheduler thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.decode_pool import SharedSlots
from ragkv.engine.kv.node_files import NodeFiles
from ragkv.engine.kv.pool import KVPool
from ragkv.engine.kv.retention import Pins, ToolLatency
from ragkv.engine.kv.tree_disk import TreeDisk
from ragkv.engine.kv.tree_node import (
    LeasedPart,
    Node,
    Rank,
    RecurrentSnapshot,
    TreeContext,
    TreeKey,
    TreeLease,
    TreeStats,
    TreeTier,
    cache_bytes,
    common_prefix,
    lineage,
)

__all__ = ["KVTree", "RecurrentSnapshot", "TreeTier", "ToolLatency", "TreeContext", "TreeKey", "TreeLease", "TreeStats"]

log = logging.getLogger(__name__)


class _TreeLock:
    """The tree's lock. Taking it first lets go of the leases dropped unreleased since it was last
    taken (`KVTree._release_late`): a lease's finalizer may run in a thread that holds it already
    (the collector runs where memory is allocated), where taking it again would wait forever."""

    def __init__(self, let_late_go: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._let_late_go = let_late_go

    def __enter__(self) -> _TreeLock:
        self._lock.acquire()
        try:
            self._let_late_go()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class KVTree:
    """Radix tree of served prompts' KV under a byte budget per tier; see the module docstring.

    Args:
        budget_bytes: KV bytes the tree may hold on the device; 0 turns it off (nothing matches or is kept).
        recurrent: the model is a hybrid: a match must end where a recurrent state is held (no tiers).
        tenant_share: while other tenants hold KV here, a tenant past this share of the budget
            makes room by evicting its own paths only, so one tenant's flood cannot evict every
            other tenant's conversations (1.0 = one LRU for all); a tenant's live pins hold at
            most this share of the budget.
        clock: seconds, for pins and tool latencies (time.monotonic; tests inject their own).
        latency: the tool latencies seen and the pins' learned time-to-live (default `ToolLatency()`).
        host_bytes: KV bytes the tree may keep in CPU memory below the device; 0 = no host tier.
        files: the disk tier's files (`NodeFiles`); what they hold is found again here. None = no disk tier.
        disk_bytes: KV bytes the tree may keep in `files`.
        compute_rate: the engine's prompt tokens per second (None until measured).
        device_pool: the device tier's pool: a share of the engine's decode pool
            (`engine.kv.decode_pool.SharedSlots`: an insert takes a request's KV where it lies, a
            lease lends its path in place), or None for a pool of its own (`budget_bytes`).
    """

    def __init__(self, budget_bytes: int, recurrent: bool = False, tenant_share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, latency: ToolLatency | None = None,
                 host_bytes: int = 0, files: NodeFiles | None = None, disk_bytes: int = 0,
                 compute_rate: Callable[[], float | None] | None = None, device_pool: KVPool | None = None) -> None:
        if budget_bytes < 0 or host_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"the KV tree's budgets must be >= 0 bytes, got device {budget_bytes}, host "
                             f"{host_bytes}, disk {disk_bytes}")
        if not 0.0 < tenant_share <= 1.0:
            raise ValueError(f"the KV tree's tenant share must be in (0, 1], got {tenant_share}")
        self.budget_bytes = budget_bytes
        self.recurrent = recurrent
        self.tenant_share = tenant_share
        self.host_budget = 0 if recurrent or not budget_bytes else host_bytes
        self._tenant_bytes: dict[str, int] = {}  # device KV bytes held per tenant
        # each memory tier's KV, in one pool of token slots that its nodes index (`Node.slots`)
        # (the device tier's may be a share of the engine's decode pool: `device_pool`, engine.kv.decode_pool)
        self._pools = {TreeTier.DEVICE: device_pool if device_pool is not None else KVPool(budget_bytes),
                       TreeTier.HOST: KVPool(self.host_budget, "cpu")}
        self._roots: dict[TreeKey, Node] = {}
        self._late: list[list[Node]] = []  # leases dropped unreleased: let go as the lock is next taken
        self._lock = _TreeLock(self._let_late_go)
        self._clock = itertools.count(1)
        self._now = clock
        self.pins = Pins(clock, latency or ToolLatency())  # retention: paths kept ahead of LRU
        self._bytes = self._host_bytes = self._nodes = 0
        self._hits = self._hit_tokens = self._misses = self._evictions = self._evicted_bytes = 0
        self._spills = self._spilled_hit_tokens = 0  # spills: device to host (the disk counts its own)
        # the disk tier (its files, budget, reads and counts); None = no disk tier
        self.disk = TreeDisk(self, files, disk_bytes, compute_rate) if (
            files is not None and disk_bytes and budget_bytes and not recurrent) else None
        if isinstance(device_pool, SharedSlots):  # requests come first in the pool the tree shares
            device_pool.decode_pool.reclaim = self._reclaim
        if self.disk is not None:
            self.disk.restore()  # a restarted server's conversations, back on the tree

    @property
    def files(self) -> NodeFiles | None:
        """The disk tier's files; None = no disk tier."""
        return None if self.disk is None else self.disk.files

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def latency(self) -> ToolLatency:
        """The tool latencies seen, and the pins' learned time-to-live."""
        return self.pins.latency

    @latency.setter
    def latency(self, latency: ToolLatency) -> None:
        self.pins.latency = latency

    def stats(self) -> TreeStats:
        with self._lock:
            pinned = sum(n.nbytes for n in self.pins.live())
            d = self.disk
            return TreeStats(self._bytes, self.budget_bytes, self._nodes, len(self._roots), self._hits,
                             self._hit_tokens, self._misses, self._evictions, self._evicted_bytes, pinned,
                             self.latency.ttl(), self.latency.observed, self._host_bytes, self.host_budget,
                             d.bytes if d else 0, d.budget if d else 0, self._spills + (d.spills if d else 0),
                             self._spilled_hit_tokens, d.restored if d else 0, d.read_errors if d else 0,
                             d.warmed if d else 0, d.reads_skipped if d else 0, self._pools[TreeTier.DEVICE].nbytes)

    def warm(self, key: TreeKey, ids: Sequence[int]) -> int:
        """Bring the disk nodes of the path under `key` that `ids` starts with up to CPU memory,
        ahead of the call that will match it (`TreeDisk.warm`); the tokens brought up."""
        return 0 if self.disk is None else self.disk.warm(key, ids)

    def persist(self) -> int:
        """Write what the device and host tiers hold to disk, for the next server over the same
        files (`TreeDisk.persist`); the nodes written (0 without a disk tier)."""
        return 0 if self.disk is None else self.disk.persist()

    def match(self, key: TreeKey, ids: Sequence[int], leave_last: bool = True) -> TreeLease | None:
        """The longest path under `key` that `ids` (the tokens after the context) starts with,
        leased; None when the context itself is not held.

        At least the last token of `ids` is left to compute (a prompt pass needs its logits),
        unless `leave_last` is False (a prefix that a pass goes on from: a request's own
        instructions). A spilled part is read back here: a disk file outside the tree's lock.
        """
        want = tuple(int(i) for i in ids)
        with self._lock:
            found = self._find(key, want, leave_last)
            if found is None:
                return None
            state, parts = found
            for part in parts:
                part.node.refs += 1
            self.pins.resumed(parts)
        parts = self.disk.read(parts) if self.disk is not None else parts
        if not parts:
            with self._lock:
                self._misses += 1
            return None
        root, pos = parts[0].node, sum(p.n for p in parts[1:])
        if root.context is None:  # every root is made with its context
            raise RuntimeError(f"KV tree context {key} has no TreeContext: a bug")
        spilled = sum(p.n for p in parts if p.spilled)
        with self._lock:
            self._hits += 1
            self._hit_tokens += len(root.ids) + pos
            self._spilled_hit_tokens += spilled
        return TreeLease(self._release, self._gather, self._copy_into, root.ids, root.context, pos, parts, _state=state,
                         _let_go_late=self._release_late,
                         spilled=spilled, _lend=self._lend)

    def _find(self, key: TreeKey, ids: tuple[int, ...], leave_last: bool = True
              ) -> tuple[object | None, list[LeasedPart]] | None:
        """The path `ids` matches under `key` (its last token left out when `leave_last`), and a
        hybrid's recurrent state at its end; None (a miss, counted) when nothing is supplied."""
        root = self._roots.get(key)
        if root is None or not ids:
            self._misses += root is None
            return None
        now = next(self._clock)
        parts = [LeasedPart(root, len(root.ids))]
        node, pos, limit = root, 0, len(ids) - leave_last
        while pos < limit:
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = common_prefix(child.ids, ids[pos:limit])
            parts.append(LeasedPart(child, n))
            pos += n
            if n < len(child.ids):
                break
            node = child
        state = None
        if self.recurrent:  # stop at the deepest node whose recurrent state is held
            last = max((j for j, p in enumerate(parts) if p.n == len(p.node.ids) and p.node.state is not None),
                       default=None)
            parts = parts[:last + 1] if last is not None else parts[:1]
            pos = sum(p.n for p in parts[1:])
            state = parts[-1].node.state if last is not None else None
            if state is None and (root.ids or pos):  # KV without the state the layers need: useless
                pos, parts = 0, parts[:1]
        if not root.ids and pos == 0:  # an empty context and no token matched: nothing to supply
            self._misses += 1
            return None
        for part in parts:
            part.node.used = now
        return state, parts

    def _path(self, key: TreeKey, ids: tuple[int, ...]) -> list[Node]:
        """The nodes under `key` that `ids` runs through (the context first), touching nothing."""
        node = self._roots.get(key)
        if node is None:
            return []
        out, pos = [node], 0
        while pos < len(ids) and (child := node.children.get(ids[pos])) is not None:
            out.append(child)
            n = common_prefix(child.ids, ids[pos:])
            if n < len(child.ids):
                break
            node, pos = child, pos + n
        return out

    def _release(self, nodes: Iterable[Node]) -> None:
        with self._lock:
            for node in nodes:
                node.refs -= 1

    def _release_late(self, nodes: list[Node]) -> None:
        """`_release` for a lease's finalizer: no lock (the thread the collector runs in may hold
        this tree's, or take locks in another order); done as the lock is next taken."""
        self._late.append(nodes)  # atomic

    def _let_late_go(self) -> None:
        while self._late:
            for node in self._late.pop():
                node.refs -= 1

    def _lend(self, parts: list[LeasedPart], capacity: int, least: int,
              let_go: Callable[[], None]) -> KVCache | None:
        """A request cache over a leased path where the device tier holds it (`SharedSlots.lend`),
        or None (a part spilled, a pool of its own, no free slots after the path). Leased nodes
        are never moved or evicted, and split only here, by the one lease that holds them, so
        the path's slots stay as read here once the lock is let go."""
        pool = self._pools[TreeTier.DEVICE]
        if not isinstance(pool, SharedSlots):
            return None
        with self._lock:
            if any(p.k is not None or p.node.tier is not TreeTier.DEVICE for p in parts):
                return None
            last = parts[-1]
            if last.n < len(last.node.ids) and not self._clear_after(last, pool):
                return None
            slots = torch.cat([self._slots(p.node)[:p.n] for p in parts])  # [tokens] (CPU)
        return pool.lend(slots, capacity, least, let_go)

    def _clear_after(self, part: LeasedPart, pool: SharedSlots) -> bool:
        """The match ends inside `part.node`: cut it there and move the rest's KV to other slots,
        so the request can run on after the path (the rest, an earlier answer this call did not
        repeat, stays in the tree). False when another lease holds the node or no slots are free."""
        node = part.node
        if node.refs > 1:
            return False
        self._split(node, part.n)
        lower = next(iter(node.children.values()))  # the split's new child: the rest
        new = pool.relocate(self._slots(lower))
        if new is None:
            return False
        lower.slots = new
        return True

    def _gather(self, node: Node, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A lease's copy of a pool-held node's first `n` tokens' K and V, [L, Hkv, n, D]."""
        with self._lock:
            return self._kv(node, n)

    def _copy_into(self, node: Node, n: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """A lease's pool-held node's first `n` tokens' K and V written into `k_out`, `v_out`
        ([L, Hkv, n, D]: the request's cache there), in one copy (`KVPool.copy_into`)."""
        with self._lock:
            self._pools[node.tier].copy_into(self._slots(node)[:n], k_out, v_out)

    def _kv(self, node: Node, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the KV a DEVICE or HOST node holds in its tier's pool (its first `n` tokens)."""
        return self._pools[node.tier].get(self._slots(node)[:n])

    @staticmethod
    def _slots(node: Node) -> torch.Tensor:
        """The slot indices ([T], on the host) a DEVICE or HOST node holds in its tier's pool."""
        if node.slots is None:
            raise RuntimeError(f"KV tree node of context {node.key} on tier {node.tier.name} holds no slots: a bug")
        return node.slots

    def _hold(self, node: Node, tier: TreeTier, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put `node`'s K and V ([L, Hkv, T, D]) in `tier`'s pool (the node counted off every tier)."""
        node.slots, node.tier = self._pools[tier].put(k, v), tier

    def _hold_from(self, node: Node, tier: TreeTier, cache: KVCache) -> None:
        """`_hold` of `node`'s tokens as a request's `cache` holds them (slots [start, end)): taken
        where they lie when the cache is in the pool the tier shares with requests, else copied."""
        slots = self._pools[tier].adopt(cache, node.start, node.end, lambda: self._release([node]))
        if slots is not None:  # held (never evicted) while the request may still read it there
            node.slots, node.tier, node.refs = slots, tier, node.refs + 1
        else:
            self._hold(node, tier, cache.k[:, :, node.start:node.end], cache.v[:, :, node.start:node.end])
        node.kv_bytes = cache_bytes(cache, len(node.ids))

    def _let_slots_go(self, node: Node) -> None:
        """Give a DEVICE or HOST node's slots back to its tier's pool."""
        if node.slots is not None:
            self._pools[node.tier].release(node.slots)
            node.slots = None

    def insert(self, key: TreeKey, context_ids: Sequence[int], context: TreeContext, ids: Sequence[int],
               cache: KVCache, snapshot: RecurrentSnapshot | None = None, pin_s: float = 0.0,
               parts_at: int | None = None, priority: int = 0) -> int:
        """Keep the KV of a served sequence: `cache` slots [0, C) hold the context
        (`context_ids`), slots [C, C + len(ids)) the tokens after it. A hybrid's `snapshot`
        (its recurrent state after `snapshot.tokens` of `ids`) goes on the node ending there.
        `pin_s` > 0: the answer may end in tool calls: pin the stored path that long (see the
        module docstring); `parts_at`: where in `ids` the conversation's next call parts from
        this one (the prompt's end, before the answer's header), so that call's match is known
        and its delay learned. Spilled nodes on the path come back to the device from `cache`.
        `priority`: the client's word on how much the path matters against its tenant's others
        (`engine.kv.retention`); every node on it takes it.

        Returns:
            The tokens newly stored (0 when all were held, or the budget cannot hold them).
        """
        added = self._insert(key, context_ids, context, ids, cache, pin_s, parts_at, priority)
        if snapshot is not None and 0 < snapshot.tokens <= len(ids):
            with self._lock:
                self._keep_state(key, tuple(int(i) for i in ids[:snapshot.tokens]), snapshot)
        return added

    def _keep_state(self, key: TreeKey, ids: tuple[int, ...], snapshot: RecurrentSnapshot) -> None:
        """Put `snapshot` on the node ending after `ids` past `key`'s context, splitting the node
        that spans that point (not when leased: then the state is not kept)."""
        node, pos = self._roots.get(key), 0
        while node is not None and pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                return  # the insert stopped short (budget): nothing ends there
            n = common_prefix(child.ids, ids[pos:])
            if pos + n == len(ids):
                if n < len(child.ids):
                    if child.refs:
                        return
                    self._split(child, n)
                if child.state is None and self._make_room(snapshot.nbytes, keep=child, tenant=key.owner):
                    child.state, child.state_bytes = snapshot.state, snapshot.nbytes
                    self._count(key.owner, snapshot.nbytes)
                return
            if n < len(child.ids):
                return
            node, pos = child, pos + n

    def _insert(self, key: TreeKey, context_ids: Sequence[int], context: TreeContext, ids: Sequence[int],
                cache: KVCache, pin_s: float = 0.0, parts_at: int | None = None, priority: int = 0) -> int:
        if not self.enabled:
            return 0
        context_ids = tuple(int(i) for i in context_ids)
        ids = tuple(int(i) for i in ids)
        c = len(context_ids)
        if cache.length < c + len(ids):
            raise ValueError(f"the cache holds {cache.length} tokens, fewer than the {c + len(ids)} to insert")
        with self._lock:
            now = next(self._clock)
            root = self._roots.get(key)
            if root is None:
                tier = self._place(cache_bytes(cache, c), None, key.owner, cache)
                if tier is None:
                    return 0
                root = self._new(tier, Node(context_ids, 0, None, key, context), cache)
                self._roots[key] = root
            elif root.ids != context_ids:  # the key names another context: a digest collision or a bug
                raise ValueError(f"KV tree context {key} holds other tokens than the ones inserted under it")
            root.used = now
            self._refill(root, cache)
            self._rehome(root, cache)
            node, pos, added, path = root, 0, 0, [root]
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:  # a new leaf for the rest
                    tier = self._place(cache_bytes(cache, len(ids) - pos), node, key.owner, cache)
                    if tier is None:
                        break
                    leaf = self._new(tier, Node(ids[pos:], c + pos, node, key), cache)
                    leaf.used = now
                    node.children[ids[pos]] = leaf
                    path.append(leaf)
                    added += len(ids) - pos
                    break
                n = common_prefix(child.ids, ids[pos:])
                child.used = now
                if n < len(child.ids):
                    if n == len(ids) - pos:  # nothing new: the sequence ends inside this edge
                        path.append(child)
                    if child.refs or n == len(ids) - pos:  # leased (its tensors must stay), or nothing new
                        break
                    self._split(child, n)
                self._refill(child, cache)
                self._rehome(child, cache)
                path.append(child)
                node, pos = child, pos + n
            if pin_s > 0:
                self.pins.pin(path, key.owner, pin_s, None if parts_at is None else c + parts_at,
                              self.tenant_share * self.budget_bytes if self.tenant_share < 1.0 else None)
            self._prioritize(path, key.owner, priority)
            return added

    def _prioritize(self, path: list[Node], tenant: str, priority: int) -> None:
        """Give `path` its conversation's latest `priority`. Above 0 only within the tenant's
        share: while its other nodes above 0 and this path would hold more than `tenant_share`
        of the device budget, the path is kept at 0."""
        if priority > 0 and self.tenant_share < 1.0:
            on_path = {id(n) for n in path}
            held = sum(n.nbytes for n in self._all() if n.priority > 0 and n.key.owner == tenant
                       and id(n) not in on_path)
            if held + sum(n.nbytes for n in path) > self.tenant_share * self.budget_bytes:
                priority = 0
        for node in path:
            node.priority = priority

    def _place(self, need: int, keep: Node | None, tenant: str, cache: KVCache) -> TreeTier | None:
        """The tier a new node of `need` bytes from `cache` goes to: the device when room can be
        made there, else CPU memory (the device full of leased paths, or of requests: many
        agents' calls in flight), else none (it is not stored)."""
        if self._make_room(need, keep=keep, tenant=tenant, budget=self._device_budget(cache)):
            return TreeTier.DEVICE
        if self.host_budget and not self.recurrent and self._host_room(need, keep):
            return TreeTier.HOST
        return None

    def _new(self, tier: TreeTier, node: Node, cache: KVCache) -> Node:
        """`node` held on `tier`, its KV copied from the request's `cache`, and counted there."""
        self._hold_from(node, tier, cache)
        self._add(node)
        return node

    def _refill(self, node: Node, cache: KVCache) -> None:
        """Put a spilled node back on the device from `cache` (which holds its tokens' KV, as
        the request's pass copied or computed it), when the device budget has room."""
        if node.tier is TreeTier.DEVICE or not self._make_room(node.kv_bytes, keep=node, tenant=node.key.owner,
                                                                budget=self._device_budget(cache)):
            return
        self._leave_tier(node)
        self._hold_from(node, TreeTier.DEVICE, cache)
        self._count(node.key.owner, node.kv_bytes)

    def _rehome(self, node: Node, cache: KVCache) -> None:
        """Keep a device node in the request's slots that hold a copy of it (`cache.from_tree`:
        the request's lease copied its path in, the path not lying where it could be lent) and
        give its own back (`DecodePool.rehome`): no KV moves, and the conversation's path lies
        in one run again, so its next call is lent in place rather than copied once more. Only
        a node no lease holds (another call may read its slots)."""
        pool = self._pools[TreeTier.DEVICE]
        if (not isinstance(pool, SharedSlots) or node.tier is not TreeTier.DEVICE or node.refs
                or node.slots is None or not node.ids or node.end > cache.from_tree):
            return
        slots = pool.rehome(cache, node.start, node.end, node.slots, lambda: self._release([node]))
        if slots is not None:  # held (never evicted) while the request may still read it there, as an insert's
            node.slots, node.refs = slots, node.refs + 1

    def _device_budget(self, cache: KVCache) -> int:
        """What the device tier may hold for KV from `cache`: its budget; in a pool shared with
        requests, whose runs may take any free slot, at most what it holds and the free slots
        besides, unless it takes the KV where `cache` holds it in the pool (`adopt`: no slot more)."""
        pool = self._pools[TreeTier.DEVICE]
        if not isinstance(pool, SharedSlots) or pool.decode_pool.run_of(cache) is not None:
            return self.budget_bytes
        return min(self.budget_bytes, self._bytes + pool.decode_pool.free_tokens * pool.token_bytes)

    def _reclaim(self, tokens: int) -> bool:
        """Room in the decode pool the device tier shares for a request's run of `tokens` slots
        (`DecodePool.reclaim`): the nodes no lease holds (nor any below them) that lie where the
        run could go (`DecodePool.window`) move down a tier, with their device nodes below, as
        admission's `shrink` moves them (host memory, else disk, else out; pins too). False when
        leased paths and runs leave no such room."""
        pool = self._pools[TreeTier.DEVICE]
        assert isinstance(pool, SharedSlots), "only a tree in the decode pool gives room to its runs"
        with self._lock:
            held: set[int] = set()  # nodes at or above a held one
            free: list[tuple[Node, torch.Tensor]] = []  # (a device node nothing holds, its slots)
            for root in list(self._roots.values()):
                for n in reversed(root.walk()):  # children before their parents
                    if n.refs or any(id(c) in held for c in n.children.values()):
                        held.add(id(n))
                    elif n.tier is TreeTier.DEVICE and n.slots is not None and len(n.slots):
                        free.append((n, n.slots))
            evictable = torch.cat([s for _, s in free]) if free else torch.empty(0, dtype=torch.long)  # [T]
            where = pool.decode_pool.window(tokens, evictable)
            if where is None:
                return False
            a, b = where
            for victim in [n for n, s in free if bool(torch.any((s >= a) & (s < b)))]:
                for n in reversed(victim.walk()):
                    if n.tier is TreeTier.DEVICE and n.slots is not None:
                        self._spill(n)
            return True

    @property
    def nbytes(self) -> int:
        """Device memory the tree takes now: the KV and recurrent states it holds, and its pool's
        free slots (at most its budget)."""
        pool = self._pools[TreeTier.DEVICE]
        return self._bytes + (pool.capacity - pool.used) * pool.token_bytes

    def shrink(self, limit_bytes: int) -> int:
        """Make room on the device until it takes at most `limit_bytes` (admission makes room
        for a request this way): nodes leave, pinned ones too, after every other,
        soonest-expiring first, and the pool gives back its free memory; returns `nbytes` after."""
        with self._lock:
            limit = max(limit_bytes, 0)
            self._make_room(0, budget=limit, pinned=True)
            self._compact(TreeTier.DEVICE, limit - self._bytes)
            return self.nbytes

    def _compact(self, tier: TreeTier, spare_bytes: int) -> None:
        """Shrink `tier`'s pool to its held slots and at most `spare_bytes` more, renumbering
        its nodes' slots (a lease reads them at its copy, under the lock, so it follows)."""
        pool = self._pools[tier]
        remap = pool.compact(pool.used * pool.token_bytes + max(spare_bytes, 0))
        if remap is not None:
            for node in self._all():
                if node.tier is tier and node.slots is not None:
                    node.slots = remap[node.slots]

    def clear(self) -> None:
        """Drop every node no lease holds, on every tier (their files too)."""
        with self._lock:
            for root in list(self._roots.values()):
                for node in reversed(root.walk()):
                    if node.refs == 0 and not node.children and (node.parent or self._roots.get(node.key) is node):
                        self._drop(node)
            self._compact(TreeTier.DEVICE, 0)
            self._compact(TreeTier.HOST, 0)

    def tenant_bytes(self, tenant: str) -> int:
        """Device KV bytes `tenant`'s paths hold now."""
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    def _count(self, tenant: str, nbytes: int) -> None:
        self._bytes += nbytes
        held = self._tenant_bytes.get(tenant, 0) + nbytes
        if held:
            self._tenant_bytes[tenant] = held
        else:
            self._tenant_bytes.pop(tenant, None)

    def _tier_bytes(self, node: Node, sign: int) -> None:
        """Count (sign 1) or uncount (-1) `node`'s bytes on its tier."""
        if node.tier is TreeTier.DEVICE:
            self._count(node.key.owner, sign * node.nbytes)
        elif node.tier is TreeTier.HOST:
            self._host_bytes += sign * node.kv_bytes
        else:
            assert self.disk is not None, "a node on disk with no disk tier: a bug"
            self.disk.bytes += sign * node.kv_bytes

    def _add(self, node: Node) -> None:
        self._tier_bytes(node, 1)
        self._nodes += 1

    def _split(self, node: Node, n: int) -> None:
        """Cut `node` after its first n tokens: it keeps those, a new child takes the rest (and
        the recurrent state after the rest, if held). A disk node's parts both read its file."""
        self._tier_bytes(node, -1)
        lower = Node(node.ids[n:], node.start + n, node, node.key)
        lower.tier, lower.file, lower.offset = node.tier, node.file, node.offset + n
        if node.slots is not None:  # both keep their slots in the pool: no KV moves
            lower.slots, node.slots = node.slots[n:], node.slots[:n]
        per_token = node.kv_bytes // len(node.ids)
        lower.kv_bytes, node.kv_bytes = per_token * len(lower.ids), per_token * n
        if node.file is not None and self.disk is not None:
            self.disk.share(node.file)
        lower.children, lower.used, lower.pin, lower.priority = node.children, node.used, node.pin, node.priority
        if node.answered is not None and node.parts_at > node.start + n:  # the parting point is below
            lower.answered, lower.parts_at, node.answered = node.answered, node.parts_at, None
        if lower.pin:
            self.pins.add(lower)
        lower.state, lower.state_bytes, node.state, node.state_bytes = node.state, node.state_bytes, None, 0
        for ch in lower.children.values():
            ch.parent = lower
        node.ids = node.ids[:n]
        node.children = {lower.ids[0]: lower}
        self._tier_bytes(node, 1)
        self._tier_bytes(lower, 1)
        self._nodes += 1

    def _make_room(self, need: int, keep: Node | None = None, budget: int | None = None,
                   tenant: str | None = None, pinned: bool = False) -> bool:
        """Move least-recently-used unleased device nodes down a tier (`_spill`) until `need`
        more bytes fit in `budget` (default the tree's; never `keep` or its ancestors, where
        the new node hangs); False when they cannot. A candidate holds no device node below
        it. Room for `tenant` past its share (`tenant_share`) while others hold KV comes from
        its own nodes only. A live pin moves after every unpinned node, soonest-expiring
        first: down to a lower tier, never out of the tree, unless `pinned` (shrink) says
        it may leave. Without a lower tier it moves only when `pinned`."""
        budget = self.budget_bytes if budget is None else budget
        if self._bytes + need <= budget:
            return True
        if need > budget:
            return False
        kept = lineage(keep)
        own_only = (tenant is not None and self.tenant_share < 1.0
                    and self._tenant_bytes.get(tenant, 0) + need > self.tenant_share * budget
                    and any(t != tenant for t in self._tenant_bytes))
        now = self._now()
        lower = bool(self.host_budget) or self.disk is not None  # a pin can move without leaving

        def candidate(n: Node) -> bool:
            return (n.tier is TreeTier.DEVICE and n.refs == 0 and n.nbytes > 0 and id(n) not in kept
                    and not any(c.tier is TreeTier.DEVICE for c in n.children.values())
                    and (not own_only or n.key.owner == tenant) and (pinned or lower or n.pin <= now))

        def spill(n: Node) -> None:
            self._spill(n, leave=pinned or n.pin <= now, keep=keep)

        self._free(lambda: self._bytes + need > budget, candidate, spill, self._rank(now))
        return self._bytes + need <= budget

    @staticmethod
    def _rank(now: float) -> Callable[[Node], Rank]:
        """The order nodes leave a tier: lowest priority first (`Node.priority`, the client's);
        within one, unpinned by least recent use, then live pins by their end."""
        def rank(n: Node) -> Rank:
            return (n.priority, 1, n.pin, id(n)) if n.pin > now else (n.priority, 0, float(n.used), id(n))
        return rank

    def _spill(self, node: Node, leave: bool = True, keep: Node | None = None) -> None:
        """Move a device node down: to the host tier, else to disk, else out of the tree (when
        it may `leave`: a live pin stays on the device rather than leave). Room on the host is
        never made from `keep` or its ancestors (`_host_room`)."""
        if node.state is None and self.host_budget and self._host_room(node.kv_bytes, keep):
            slots = self._pools[TreeTier.HOST].put(*self._kv(node))  # first: should it raise, the node is as it was
            self._tier_bytes(node, -1)
            self._let_slots_go(node)
            node.slots, node.tier = slots, TreeTier.HOST
            self._tier_bytes(node, 1)
            self._spills += 1
        elif (node.state is not None or not self._to_disk(node)) and leave:
            self._drop(node)

    def _host_room(self, need: int, keep: Node | None = None) -> bool:
        """Make room for `need` bytes on the host tier: its least-recently-used unleased nodes
        holding nothing above the disk below them go to disk, else out of the tree; never
        `keep` or its ancestors (an insert's path, whose node it is refilling or hanging a new
        one under: out of the tree, it would take the insert's KV with it)."""
        if self._host_bytes + need <= self.host_budget:
            return True
        if need > self.host_budget:
            return False
        kept = lineage(keep)

        def candidate(n: Node) -> bool:
            return (n.tier is TreeTier.HOST and n.refs == 0 and id(n) not in kept
                    and all(c.tier is TreeTier.DISK for c in n.children.values()))

        self._free(lambda: self._host_bytes + need > self.host_budget, candidate,
                   lambda n: None if self._to_disk(n) else self._drop(n), self._rank(self._now()))
        return self._host_bytes + need <= self.host_budget

    def _to_disk(self, node: Node) -> bool:
        """Move a device or host node to the disk tier; False without one, or without room."""
        return self.disk is not None and self.disk.write(node)

    def _free(self, over: Callable[[], bool], candidate: Callable[[Node], bool], act: Callable[[Node], object],
              rank: Callable[[Node], Rank] | None = None) -> None:
        """While `over()`, `act` on the first `candidate` by `rank` (default lowest priority,
        then least recently used), and on its parent in its turn once that has become a candidate too."""
        order = rank or (lambda n: (n.priority, 0, float(n.used), id(n)))
        heap = [(*order(n), n) for n in self._all() if candidate(n)]
        heapq.heapify(heap)
        while heap and over():
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            act(node)
            if parent is not None and candidate(parent):
                heapq.heappush(heap, (*order(parent), parent))

    def _all(self) -> Iterable[Node]:
        for root in list(self._roots.values()):
            yield from root.walk()

    def _leave_tier(self, node: Node) -> None:
        """Uncount a node from its tier, and let go of its slots or its file."""
        self._tier_bytes(node, -1)
        self._let_slots_go(node)
        if node.file is not None:
            if self.disk is not None:
                self.disk.let_go(node.file)
            node.file, node.offset = None, 0

    def _drop(self, node: Node) -> None:
        """Take `node` and everything below it out of the tree (no lease holds any of them)."""
        parent = node.parent
        if parent is None:
            del self._roots[node.key]
        else:
            del parent.children[node.ids[0]]
        for gone in node.walk():
            self.pins.discard(gone)
            self._evicted_bytes += gone.nbytes
            self._leave_tier(gone)
            self._nodes -= 1
            self._evictions += 1
        if parent is not None and parent.parent is None and not parent.ids and not parent.children and not parent.refs:
            del self._roots[parent.key]  # an empty context left with nothing below it
            self._leave_tier(parent)
            self._nodes -= 1
