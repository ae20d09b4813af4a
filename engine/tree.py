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
sequence is inserted (`KVTree.insert`). The tree holds at most `budget_bytes`: an insert
evicts least-recently-used leaves that no lease holds, and inserts nothing when the
budget cannot hold it. A leased node is never split or evicted, so a lease's tensors stay
as they were matched.

Retention that knows agents: an answer that may end in tool calls comes back as the
conversation's next call once the tool has run, and plain LRU evicts exactly those paths
first (the longest-waiting agent is the least recently used). So an insert may *pin* its
path for a time-to-live (`insert(..., pin_s=)`): an insert makes room from unpinned leaves
only (least recently used first) and stores less rather than evict a live pin; `shrink`
(admission making room for a running request) takes pinned leaves too, after every
unpinned one, soonest-expiring first. A pin ends when its time passes or when the next
call leases the path (`match`; that call's own insert pins again if it may end in tool
calls). A tenant's live pins hold at most `tenant_share` of the budget: past it, its path
is kept as any other. The time from such an answer to the next call on its path is a tool
latency the tree sees (`ToolLatency`): the pins' learned time-to-live is their p90.

A hybrid's recurrent layers (`KVTree(recurrent=True)`) keep a state no K/V stands in for,
so the tree also keeps that state where a prompt ended (`RecurrentSnapshot`, on the node
that ends there, split to end there), as SGLang does for Mamba: a match then stops at the
deepest node holding one, and the resumed pass starts from a copy of it.

Thread-safe: leases are taken on the server's retrieval threads, inserts run on the
scheduler thread.
"""

from __future__ import annotations

import copy
import hashlib
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.engine.kv import KVCache


@dataclass(frozen=True, slots=True)
class TreeKey:
    """What made a context's KV: a digest over its parts (model, mode, prefix, chunk keys,
    options, the question the mode's choices were made by), within one tenant."""

    digest: str
    tenant: str = ""  # whose paths these are (Request.tenant); in the digest too

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


class _Node:
    """One edge of the tree: a run of tokens and their KV."""

    __slots__ = ("ids", "k", "v", "start", "children", "parent", "refs", "used", "key", "context", "state",
                 "state_bytes", "pin", "answered", "parts_at")

    def __init__(self, ids: tuple[int, ...], k: torch.Tensor, v: torch.Tensor, start: int,
                 parent: _Node | None, key: TreeKey, context: TreeContext | None = None) -> None:
        self.ids = ids  # the tokens of this edge (a root: the whole context)
        self.k = k  # [L, Hkv, T, D], after RoPE
        self.v = v  # [L, Hkv, T, D]
        self.start = start  # position of the first token
        self.children: dict[int, _Node] = {}  # first token -> child
        self.parent = parent
        self.refs = 0  # leases holding this node
        self.used = 0  # LRU clock of its last match or insert
        self.key = key  # the context it hangs under
        self.context = context  # roots only
        self.state: object | None = None  # hybrids: the recurrent state after this node's last token
        self.state_bytes = 0
        self.pin = 0.0  # clock time its pin ends (kept ahead of LRU until then); 0 = not pinned
        # an answer that may end in tool calls: the clock time it was inserted, and the position
        # where its conversation's next call parts from its prompt (start < parts_at <= end: the
        # prompt's end, before the answer's header): a match reaching it is that next call
        self.answered: float | None = None
        self.parts_at = 0

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size() + self.state_bytes


@dataclass(slots=True)
class TreeLease:
    """A matched path, held until the prompt pass has copied it into its own cache."""

    tree: KVTree
    context_ids: tuple[int, ...]  # the context's tokens (the root's)
    context: TreeContext
    matched: int  # tokens matched past the context
    _parts: list[tuple[_Node, int]] = field(default_factory=list)  # (node, its tokens used)
    _held: bool = True
    _state: object | None = None  # hybrids: the recurrent state after the leased tokens

    def recurrent_state(self) -> object | None:
        """A copy of the recurrent state after the leased tokens (the pass updates it in place)."""
        return copy.deepcopy(self._state) if self._state is not None else None

    @property
    def tokens(self) -> int:
        """Prompt positions whose KV the lease supplies: the context and the matched tokens."""
        return len(self.context_ids) + self.matched

    def write_into(self, cache: KVCache) -> int:
        """Copy the leased KV into slots [0, tokens) of `cache`; returns the tokens written."""
        if not self._held:
            raise RuntimeError("TreeLease.write_into after release: a bug")
        for node, n in self._parts:
            cache.k[:, :, node.start:node.start + n] = node.k[:, :, :n]
            cache.v[:, :, node.start:node.start + n] = node.v[:, :, :n]
        return self.tokens

    def release(self) -> None:
        """Let the path be evicted again (idempotent)."""
        if self._held:
            self._held = False
            self.tree._release(self._parts)

    def __del__(self) -> None:  # a lease dropped unreleased (a request refused after prepare)
        try:
            self.release()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


@dataclass(frozen=True, slots=True)
class TreeStats:
    """What the tree holds and has done since it was made."""

    nbytes: int  # KV bytes held
    budget_bytes: int
    nodes: int
    contexts: int  # roots
    hits: int  # matches that supplied at least the context
    hit_tokens: int  # prompt tokens supplied by matches
    misses: int
    evictions: int  # nodes evicted
    evicted_bytes: int
    pinned_bytes: int = 0  # KV bytes held by live pins
    retain_s: float = 0.0  # the time-to-live a pin gets now when the client names none (ToolLatency.ttl)
    tool_gaps: int = 0  # tool latencies observed (answer that may end in tool calls -> next call on its path)


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


class KVTree:
    """Radix tree of served prompts' KV under a byte budget; see the module docstring.

    Args:
        budget_bytes: KV bytes the tree may hold; 0 turns it off (nothing matches or is kept).
        recurrent: the model is a hybrid: a match must end where a recurrent state is held.
        tenant_share: while other tenants hold KV here, a tenant past this share of the budget
            makes room by evicting its own paths only, so one tenant's flood cannot evict every
            other tenant's conversations (1.0 = one LRU for all); a tenant's live pins hold at
            most this share of the budget.
        clock: seconds, for pins and tool latencies (time.monotonic; tests inject their own).
        latency: the tool latencies seen and the pins' learned time-to-live (default `ToolLatency()`).
    """

    def __init__(self, budget_bytes: int, recurrent: bool = False, tenant_share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, latency: ToolLatency | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the KV tree's budget must be >= 0 bytes, got {budget_bytes}")
        if not 0.0 < tenant_share <= 1.0:
            raise ValueError(f"the KV tree's tenant share must be in (0, 1], got {tenant_share}")
        self.budget_bytes = budget_bytes
        self.recurrent = recurrent
        self.tenant_share = tenant_share
        self._tenant_bytes: dict[str, int] = {}  # KV bytes held per tenant
        self._roots: dict[TreeKey, _Node] = {}
        self._lock = threading.Lock()
        self._clock = itertools.count(1)
        self._now = clock
        self.latency = latency or ToolLatency()
        self._pins: dict[int, _Node] = {}  # id -> node pinned (perhaps expired: pruned lazily)
        self._bytes = self._nodes = 0
        self._hits = self._hit_tokens = self._misses = self._evictions = self._evicted_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def stats(self) -> TreeStats:
        with self._lock:
            pinned = sum(n.nbytes for n in self._live_pins())
            return TreeStats(self._bytes, self.budget_bytes, self._nodes, len(self._roots), self._hits,
                             self._hit_tokens, self._misses, self._evictions, self._evicted_bytes, pinned,
                             self.latency.ttl(), self.latency.observed)

    def match(self, key: TreeKey, ids: Sequence[int]) -> TreeLease | None:
        """The longest path under `key` that `ids` (the tokens after the context) starts with,
        leased; None when the context itself is not held.

        At least the last token of `ids` is left to compute: a prompt pass needs its logits.
        """
        ids = tuple(int(i) for i in ids)
        with self._lock:
            root = self._roots.get(key)
            if root is None or not ids:
                self._misses += root is None
                return None
            now = next(self._clock)
            parts: list[tuple[_Node, int]] = [(root, len(root.ids))]
            node, pos, limit = root, 0, len(ids) - 1
            while pos < limit:
                child = node.children.get(ids[pos])
                if child is None:
                    break
                n = _common(child.ids, ids[pos:limit])
                parts.append((child, n))
                pos += n
                if n < len(child.ids):
                    break
                node = child
            state = None
            if self.recurrent:  # stop at the deepest node whose recurrent state is held
                last = max((j for j, (nd, n) in enumerate(parts) if n == len(nd.ids) and nd.state is not None),
                           default=None)
                parts = parts[:last + 1] if last is not None else [(root, len(root.ids))]
                pos = sum(n for _, n in parts[1:])
                state = parts[-1][0].state if last is not None else None
                if state is None and (root.ids or pos):  # KV without the state the layers need: useless
                    pos, parts = 0, [(root, len(root.ids))]
            if not root.ids and pos == 0:  # an empty context and no token matched: nothing to supply
                self._misses += 1
                return None
            if root.context is None:  # every root is made with its context
                raise RuntimeError(f"KV tree context {key} has no TreeContext: a bug")
            for node, _ in parts:
                node.refs += 1
                node.used = now
            self._resumed(parts)
            self._hits += 1
            self._hit_tokens += len(root.ids) + pos
            return TreeLease(self, root.ids, root.context, pos, parts, _state=state)

    def _resumed(self, parts: Sequence[tuple[_Node, int]]) -> None:
        """A match leased `parts`: where it reached an answered prompt's end (`parts_at`), it
        is that conversation's next call, and the time since the answer is a tool latency.
        The pins of the nodes it covered (whole, or to that point) end: its own insert pins
        them again. A match that only passes through a node (another conversation parting
        from this one inside it) leaves its pin."""
        for node, n in parts:
            answered, reached = node.answered, False
            if answered is not None and node.start + n >= node.parts_at:
                self.latency.observe(self._now() - answered)
                node.answered, reached = None, True
            if node.pin and (reached or n == len(node.ids)):
                node.pin = 0.0
                self._pins.pop(id(node), None)

    def _release(self, parts: Iterable[tuple[_Node, int]]) -> None:
        with self._lock:
            for node, _ in parts:
                node.refs -= 1

    def insert(self, key: TreeKey, context_ids: Sequence[int], context: TreeContext, ids: Sequence[int],
               cache: KVCache, snapshot: RecurrentSnapshot | None = None, pin_s: float = 0.0,
               parts_at: int | None = None) -> int:
        """Keep the KV of a served sequence: `cache` slots [0, C) hold the context
        (`context_ids`), slots [C, C + len(ids)) the tokens after it. A hybrid's `snapshot`
        (its recurrent state after `snapshot.tokens` of `ids`) goes on the node ending there.
        `pin_s` > 0: the answer may end in tool calls: pin the stored path that long (see the
        module docstring); `parts_at`: where in `ids` the conversation's next call parts from
        this one (the prompt's end, before the answer's header), so that call's match is known
        and its delay learned.

        Returns:
            The tokens newly stored (0 when all were held, or the budget cannot hold them).
        """
        added = self._insert(key, context_ids, context, ids, cache, pin_s, parts_at)
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
            n = _common(child.ids, ids[pos:])
            if pos + n == len(ids):
                if n < len(child.ids):
                    if child.refs:
                        return
                    self._split(child, n)
                if child.state is None and self._make_room(snapshot.nbytes, keep=child, tenant=key.tenant):
                    child.state, child.state_bytes = snapshot.state, snapshot.nbytes
                    self._count(key.tenant, snapshot.nbytes)
                return
            if n < len(child.ids):
                return
            node, pos = child, pos + n

    def _insert(self, key: TreeKey, context_ids: Sequence[int], context: TreeContext, ids: Sequence[int],
                cache: KVCache, pin_s: float = 0.0, parts_at: int | None = None) -> int:
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
                if not self._make_room(_bytes_of(cache, c), tenant=key.tenant):
                    return 0
                root = _Node(context_ids, *_slice(cache, 0, c), 0, None, key, context)
                self._add(root)
                self._roots[key] = root
            elif root.ids != context_ids:  # the key names another context: a digest collision or a bug
                raise ValueError(f"KV tree context {key} holds other tokens than the ones inserted under it")
            root.used = now
            node, pos, added, path = root, 0, 0, [root]
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:  # a new leaf for the rest
                    if not self._make_room(_bytes_of(cache, len(ids) - pos), keep=node, tenant=key.tenant):
                        break
                    leaf = _Node(ids[pos:], *_slice(cache, c + pos, c + len(ids)), c + pos, node, key)
                    leaf.used = now
                    node.children[ids[pos]] = leaf
                    self._add(leaf)
                    path.append(leaf)
                    added += len(ids) - pos
                    break
                n = _common(child.ids, ids[pos:])
                child.used = now
                if n < len(child.ids):
                    if n == len(ids) - pos:  # nothing new: the sequence ends inside this edge
                        path.append(child)
                    if child.refs or n == len(ids) - pos:  # leased (its tensors must stay), or nothing new
                        break
                    self._split(child, n)
                path.append(child)
                node, pos = child, pos + n
            if pin_s > 0:
                self._pin(path, key.tenant, pin_s, None if parts_at is None else c + parts_at)
            return added

    def _pin(self, path: list[_Node], tenant: str, pin_s: float, parts_pos: int | None) -> None:
        """Pin `path` for `pin_s` seconds (not past the tenant's share of the budget in live
        pins: then it is kept as any path), and mark where the next call will part from it."""
        now = self._now()
        if parts_pos is not None:
            for node in path:
                if node.start < parts_pos <= node.end:
                    node.answered, node.parts_at = now, parts_pos
                    break
        until = now + pin_s
        if self.tenant_share < 1.0:
            held = sum(n.nbytes for n in self._live_pins(now) if n.key.tenant == tenant)
            more = sum(n.nbytes for n in path if n.pin <= now)
            if held + more > self.tenant_share * self.budget_bytes:
                return
        for node in path:
            node.pin = max(node.pin, until)
            self._pins[id(node)] = node

    def _live_pins(self, now: float | None = None) -> list[_Node]:
        """The nodes whose pin has not ended (dropping the others from the index)."""
        now = self._now() if now is None else now
        for key in [k for k, n in self._pins.items() if n.pin <= now]:
            del self._pins[key]
        return list(self._pins.values())

    @property
    def nbytes(self) -> int:
        """KV bytes held now."""
        return self._bytes

    def shrink(self, limit_bytes: int) -> int:
        """Evict least-recently-used leaves no lease holds until at most `limit_bytes` are held
        (admission makes room for a request this way): pinned ones too, after every other,
        soonest-expiring first; returns the bytes held after."""
        with self._lock:
            self._make_room(0, budget=max(limit_bytes, 0), pinned=True)
            return self._bytes

    def clear(self) -> None:
        """Drop every node no lease holds."""
        with self._lock:
            while leaves := [n for n in self._leaves() if n.refs == 0]:
                for node in leaves:
                    self._evict(node)

    def tenant_bytes(self, tenant: str) -> int:
        """KV bytes `tenant`'s paths hold now."""
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    def _count(self, tenant: str, nbytes: int) -> None:
        self._bytes += nbytes
        held = self._tenant_bytes.get(tenant, 0) + nbytes
        if held:
            self._tenant_bytes[tenant] = held
        else:
            self._tenant_bytes.pop(tenant, None)

    def _add(self, node: _Node) -> None:
        self._count(node.key.tenant, node.nbytes)
        self._nodes += 1

    def _split(self, node: _Node, n: int) -> None:
        """Cut `node` after its first n tokens: it keeps those, a new child takes the rest (and
        the recurrent state after the rest, if held)."""
        self._count(node.key.tenant, -node.nbytes)
        lower = _Node(node.ids[n:], node.k[:, :, n:].clone(), node.v[:, :, n:].clone(), node.start + n, node,
                      node.key)
        lower.children, lower.used, lower.pin = node.children, node.used, node.pin
        if node.answered is not None and node.parts_at > node.start + n:  # the parting point is below
            lower.answered, lower.parts_at, node.answered = node.answered, node.parts_at, None
        if lower.pin:
            self._pins[id(lower)] = lower
        lower.state, lower.state_bytes, node.state, node.state_bytes = node.state, node.state_bytes, None, 0
        for ch in lower.children.values():
            ch.parent = lower
        node.ids, node.k, node.v = node.ids[:n], node.k[:, :, :n].clone(), node.v[:, :, :n].clone()
        node.children = {lower.ids[0]: lower}
        self._count(node.key.tenant, node.nbytes + lower.nbytes)
        self._nodes += 1

    def _make_room(self, need: int, keep: _Node | None = None, budget: int | None = None,
                   tenant: str | None = None, pinned: bool = False) -> bool:
        """Evict least-recently-used unleased leaves until `need` more bytes fit in `budget`
        (default the tree's; never `keep` or its ancestors, where the new node hangs); False
        when they cannot. Room for `tenant` past its share (`tenant_share`) while others hold
        KV comes from its own leaves only. A live pin is evicted only when `pinned` (shrink),
        after every unpinned leaf, soonest-expiring first."""
        budget = self.budget_bytes if budget is None else budget
        if self._bytes + need <= budget:
            return True
        if need > budget:
            return False
        kept = set()
        while keep is not None:
            kept.add(id(keep))
            keep = keep.parent
        own_only = (tenant is not None and self.tenant_share < 1.0
                    and self._tenant_bytes.get(tenant, 0) + need > self.tenant_share * budget
                    and any(t != tenant for t in self._tenant_bytes))
        now = self._now()

        def rank(n: _Node) -> tuple[int, float, int]:  # unpinned by LRU, then live pins by their end
            return (1, n.pin, id(n)) if n.pin > now else (0, float(n.used), id(n))

        def candidate(n: _Node) -> bool:
            return (n.refs == 0 and id(n) not in kept and (not own_only or n.key.tenant == tenant)
                    and (pinned or n.pin <= now))

        heap = [(*rank(n), n) for n in self._leaves() if candidate(n)]
        heapq.heapify(heap)
        while heap and self._bytes + need > budget:
            node = heapq.heappop(heap)[-1]
            self._evict(node)
            parent = node.parent
            if parent is not None and not parent.children and candidate(parent):
                heapq.heappush(heap, (*rank(parent), parent))
        return self._bytes + need <= budget

    def _leaves(self) -> Iterable[_Node]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    def _evict(self, node: _Node) -> None:
        if node.parent is None:
            del self._roots[node.key]
        else:
            del node.parent.children[node.ids[0]]
        self._pins.pop(id(node), None)
        self._count(node.key.tenant, -node.nbytes)
        self._nodes -= 1
        self._evictions += 1
        self._evicted_bytes += node.nbytes


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of a and b."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _slice(cache: KVCache, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of slots [start, stop) of the cache: K [L, Hkv, T, D] after RoPE, V."""
    return cache.k[:, :, start:stop].clone(), cache.v[:, :, start:stop].clone()


def _bytes_of(cache: KVCache, tokens: int) -> int:
    L, H, _, D = cache.k.shape
    return 2 * L * H * tokens * D * cache.k.element_size()
