"""The KV tree's parts (`engine.kv.tree.KVTree`): its keys, its nodes and where each keeps its
KV, a lease on a matched path, and what the tree reports."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from ragkv.engine.kv.cache import KVCache, LayerReady, arriving
from ragkv.types import SALT_SEP


@dataclass(frozen=True, slots=True)
class TreeKey:
    """What made a context's KV: a digest over its parts (model, mode, prefix, chunk keys,
    options, the question the mode's choices were made by), within one tenant."""

    digest: str
    tenant: str = ""  # whose paths these are (Request.tenant); in the digest too

    @property
    def owner(self) -> str:
        """Who the tenant's paths count against: the tenant up to `SALT_SEP` (the server's API key,
        without the request's `cache_salt`). Salts only keep conversations apart within a key:
        shares, pins and priorities count per owner, so a key that sends a new salt on every
        request is still held to its one share."""
        return self.tenant.partition(SALT_SEP)[0]

    @classmethod
    def of(cls, *parts: object, tenant: str = "") -> TreeKey:
        h = hashlib.sha256()
        for part in (tenant, *parts):
            data = repr(part).encode()
            h.update(len(data).to_bytes(8, "little") + data)
        return cls(h.hexdigest(), tenant)

    def __str__(self) -> str:
        return self.digest[:12]


@dataclass(frozen=True, slots=True)
class TreeContext:
    """What a context's prompt pass decided, replayed by every request that reuses it."""

    prefix_tokens: int  # P: tokens of the shared prefix at the start of the prompt
    chunk_end: int  # C: the chunks lie at prompt positions [P, C), the question from C on
    chunk_tokens: int  # chunk tokens the mode's pass counted (every retrieved chunk's, in focus)
    used_chunks: tuple[int, ...] | None = None  # focus: the chunks kept; None = all
    chunk_scores: tuple[float, ...] | None = None  # focus: each chunk's relevance
    handed_over: bool = False  # focus handed over to blend
    fell_back: bool = False  # the quality guard ran the pass as full prefill


@dataclass(frozen=True, slots=True)
class RecurrentSnapshot:
    """A hybrid's recurrent layers' state after the first `tokens` tokens past the context."""

    tokens: int
    state: object  # the layers' conv and recurrent states (Adapter.new_recurrent_state's kind), a copy
    nbytes: int


class TreeTier(IntEnum):
    """Where a node keeps its KV (SGLang HiCache's three levels)."""

    DEVICE = 0  # the engine's device: the tree's budget, counted in the scheduler's
    HOST = 1  # CPU memory: the host budget
    DISK = 2  # a file of the tree's `NodeFiles`: the disk budget; found again after a restart


class Node:
    """One edge of the tree: a run of tokens and their KV, on one tier."""

    __slots__ = ("ids", "slots", "start", "children", "parent", "refs", "used", "key", "context", "state",
                 "state_bytes", "pin", "answered", "parts_at", "tier", "kv_bytes", "file", "offset", "priority")

    def __init__(self, ids: tuple[int, ...], start: int, parent: Node | None, key: TreeKey,
                 context: TreeContext | None = None) -> None:
        self.ids = ids  # the tokens of this edge (a root: the whole context)
        # DEVICE and HOST: where its tokens' K (after RoPE) and V lie in its tier's pool
        # (`engine.kv.pool.KVPool`), [T] int64; None on DISK
        self.slots: torch.Tensor | None = None
        self.start = start  # position of the first token
        self.children: dict[int, Node] = {}  # first token -> child
        self.parent = parent
        self.refs = 0  # leases holding this node
        self.used = 0  # LRU clock of its last match or insert
        self.key = key  # the context it hangs under
        self.context = context  # roots only
        self.state: object | None = None  # hybrids: the recurrent state after this node's last token
        self.state_bytes = 0
        self.pin = 0.0  # clock time its pin ends (kept ahead of LRU until then); 0 = not pinned
        self.priority = 0  # the client's word for its conversation (engine.kv.retention): lower leaves a tier first
        # an answer that may end in tool calls: the clock time it was inserted, and the position
        # where its conversation's next call parts from its prompt (start < parts_at <= end: the
        # prompt's end, before the answer's header): a match reaching it is that next call
        self.answered: float | None = None
        self.parts_at = 0
        self.tier = TreeTier.DEVICE
        self.kv_bytes = 0  # its tokens' K and V bytes, on whichever tier it is
        self.file: str | None = None  # DISK: the file holding it (perhaps with other tokens before and after)
        self.offset = 0  # DISK: its first token's place among the file's

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    def walk(self) -> list[Node]:
        """This node and every node below it, parents before children."""
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def path_ids(self) -> tuple[int, ...]:
        """The tokens between its context's end and this node's first token."""
        runs, node = [], self.parent
        while node is not None and node.parent is not None:
            runs.append(node.ids)
            node = node.parent
        return tuple(t for run in reversed(runs) for t in run)


@dataclass(slots=True)
class LeasedPart:
    """A node of a leased path, matched in its first `n` tokens; a DISK node's KV as read."""

    node: Node
    n: int
    # a DISK node's K and V as its file's read fills them in, [L, Hkv, >= n, D]; None for a
    # node held in a tier's pool (copied out of it when the lease is written)
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    # a DISK node's read in flight: its layers of k and v fill in as this says (None: all there)
    ready: LayerReady | None = None

    def wait(self) -> None:
        """Block until every layer of a read in flight is there (raises when the read failed)."""
        if self.ready is not None and self.k is not None:
            self.ready.wait(self.k.shape[0] - 1)

    @property
    def spilled(self) -> bool:
        return self.node.tier is not TreeTier.DEVICE


@dataclass(slots=True)
class TreeLease:
    """A matched path, held until the prompt pass has copied it into its own cache (or, lent in
    place, `lend`, until the request's run goes back)."""

    _let_go: Callable[[list[Node]], None]  # the tree's: drops the lease's reference counts
    # the tree's: copies of a pool-held node's first n tokens' K and V, [L, Hkv, n, D]
    _gather: Callable[[Node, int], tuple[torch.Tensor, torch.Tensor]]
    # the tree's: a pool-held node's first n tokens' K and V written into the two [L, Hkv, n, D] views given
    _copy_into: Callable[[Node, int, torch.Tensor, torch.Tensor], None]
    context_ids: tuple[int, ...]  # the context's tokens (the root's)
    context: TreeContext
    matched: int  # tokens matched past the context
    _parts: list[LeasedPart] = field(default_factory=list)
    _held: bool = True
    _state: object | None = None  # hybrids: the recurrent state after the leased tokens
    spilled: int = 0  # of `tokens`, those read back from the host or disk tier
    # the tree's: a request cache running on from the path where the device tier holds it (`lend`)
    _lend: Callable[[list[LeasedPart], int, int, Callable[[], None]], KVCache | None] | None = None
    # the tree's: `_let_go` for a finalizer, which takes no lock (`KVTree._release_late`)
    _let_go_late: Callable[[list[Node]], None] | None = None

    def recurrent_state(self) -> object | None:
        """A copy of the recurrent state after the leased tokens (the pass updates it in place)."""
        return copy.deepcopy(self._state) if self._state is not None else None

    @property
    def tokens(self) -> int:
        """Prompt positions whose KV the lease supplies: the context and the matched tokens."""
        return len(self.context_ids) + self.matched

    @property
    def device_bytes(self) -> int:
        """Device bytes of the nodes it holds there (0 once released): what the tree cannot give
        up while it is held, and KV of the request's own prompt (admission counts it once)."""
        if not self._held:
            return 0
        nodes = {id(p.node): p.node for p in self._parts if p.node.tier is TreeTier.DEVICE}
        return sum(n.nbytes for n in nodes.values())

    @property
    def arriving(self) -> bool:
        """Whether a disk read of the lease still has layers to come."""
        return any(p.k is not None and arriving(p.ready, p.k.shape[0]) for p in self._parts)

    @property
    def failed(self) -> bool:
        """Whether a disk read of the lease failed (damage found layer by layer, after the match)."""
        return any(p.ready is not None and p.ready.error is not None for p in self._parts)

    def lend(self, capacity: int, least: int = 0) -> KVCache | None:
        """A request cache of `capacity` tokens whose first `tokens` are the leased KV read where
        the tree holds it (a decode pool the tree shares: `engine.kv.decode_pool`), with no copy;
        the lease is then the cache's, let go when its run goes back. `least` (default
        `capacity`): the fewest tokens the cache may hold, when fewer than `capacity` are free
        after the path (its prompt; its decode grows it). None: the caller copies the path
        (`write_into`) into a cache of its own."""
        if not self._held:
            raise RuntimeError("TreeLease.lend after release: a bug")
        return None if self._lend is None else self._lend(self._parts, capacity, least or capacity, self.release)

    def write_into(self, cache: KVCache, layered: bool = False) -> int:
        """Copy the leased KV into slots [0, tokens) of `cache`; returns the tokens written.

        `layered`: a disk read still in flight is staged (`KVCache.place`): the prompt pass
        takes each of its layers as it reaches it, so the read overlaps the compute. Otherwise
        it is waited for here (raises KVFormatError or StoreError when it failed).
        """
        if not self._held:
            raise RuntimeError("TreeLease.write_into after release: a bug")
        for part in self._parts:
            s, n = part.node.start, part.n
            if part.k is None or part.v is None:  # held in a pool: one copy into the cache
                self._copy_into(part.node, n, cache.k[:, :, s:s + n], cache.v[:, :, s:s + n])
                continue
            if part.ready is not None and layered:
                cache.place(s, part.k[:, :, :n], part.v[:, :, :n], part.ready)
                continue
            part.wait()
            cache.k[:, :, s:s + n] = part.k[:, :, :n]  # host and disk parts move to the device here
            cache.v[:, :, s:s + n] = part.v[:, :, :n]
        return self.tokens

    def slots(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the leased KV at prompt positions [start, stop): K [L, Hkv, T, D] after RoPE, V."""
        if not self._held or not start < stop <= self.tokens:
            raise ValueError(f"TreeLease.slots({start}, {stop}) outside the {self.tokens} leased tokens, or released")
        ks, vs = [], []
        for part in self._parts:
            first, last = max(start, part.node.start), min(stop, part.node.start + part.n)
            if first >= last:
                continue
            if part.k is None or part.v is None:
                k, v = self._gather(part.node, last - part.node.start)
            else:
                part.wait()
                k, v = part.k, part.v
            ks.append(k[:, :, first - part.node.start:last - part.node.start])
            vs.append(v[:, :, first - part.node.start:last - part.node.start])
        return torch.cat(ks, 2), torch.cat(vs, 2)  # new tensors: the pool's and the files' stay as they are

    def release(self) -> None:
        """Let the path be evicted again (idempotent)."""
        if self._held:
            self._held = False
            self._let_go([p.node for p in self._parts])

    def __del__(self) -> None:  # a lease dropped unreleased (a prepared request its caller dropped)
        # The collector runs this in whatever thread allocates, perhaps one holding the tree's lock
        # (or the decode pool's): the references go back when the tree's lock is next taken
        try:
            if self._held:
                self._held = False
                (self._let_go_late or self._let_go)([p.node for p in self._parts])
        except Exception:  # interpreter shutdown: nothing left to release
            pass


@dataclass(frozen=True, slots=True)
class TreeStats:
    """What the tree holds and has done since it was made."""

    nbytes: int  # KV bytes held on the device
    budget_bytes: int
    nodes: int
    contexts: int  # roots
    hits: int  # matches that supplied at least the context
    hit_tokens: int  # prompt tokens supplied by matches
    misses: int
    evictions: int  # nodes dropped from the tree (from its last tier)
    evicted_bytes: int
    pinned_bytes: int = 0  # KV bytes held by live pins
    retain_s: float = 0.0  # the time-to-live a pin gets now when the client names none (ToolLatency.ttl)
    tool_gaps: int = 0  # tool latencies observed (answer that may end in tool calls -> next call on its path)
    host_bytes: int = 0  # KV bytes spilled to CPU memory
    host_budget_bytes: int = 0
    disk_bytes: int = 0  # KV bytes spilled to disk
    disk_budget_bytes: int = 0
    spills: int = 0  # nodes moved down a tier
    spilled_hit_tokens: int = 0  # of hit_tokens, those read back from the host or disk tier
    restored: int = 0  # nodes found on disk when the tree was made (a restart's conversations)
    read_errors: int = 0  # spilled nodes unreadable (damaged or missing files): dropped, their tokens computed
    warmed_tokens: int = 0  # tokens brought from disk to the host tier ahead of their call (`KVTree.warm`)
    reads_skipped: int = 0  # disk nodes not read at a match: computing their tokens was sooner
    pool_bytes: int = 0  # device memory the tree's KV pool takes (held slots and free ones; `KVTree.nbytes`)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of a and b."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def cache_bytes(cache: KVCache, tokens: int) -> int:
    L, H, _, D = cache.k.shape
    return 2 * L * H * tokens * D * cache.k.element_size()


def lineage(node: Node | None) -> set[int]:
    """The ids of `node` and its ancestors."""
    out = set()
    while node is not None:
        out.add(id(node))
        node = node.parent
    return out


Rank = tuple[int, int, float, int]  # the order nodes leave a tier in, smallest first (KVTree._rank)
