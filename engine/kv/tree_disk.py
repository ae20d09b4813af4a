"""The KV tree's disk tier, an object its tree owns (`KVTree.disk`): the tree's files, their
budget and what they hold; what moves a node to disk and reads it back, and what finds a
restarted server's conversations again.

A spilled node is one file of the tree's `NodeFiles` (kvstore's checksummed chunk-KV files).
A match reads a disk node only when that is sooner than computing its tokens (the disk's rate,
measured on the tree's own reads, against the engine's full-prefill rate), and reads it layer
by layer (`NodeFiles.open`): the prompt pass takes each layer as it arrives. Damage found after
the match fails that read, and the node leaves the tree once no lease holds it. `warm` reads a
conversation's path into CPU memory ahead of its call; `persist` writes the device and host
tiers to disk at a stop; a tree made over the same files hangs every file back on the tree.

It works on the tree's nodes with the tree's own operations (drop, split, count, hold), as a
part of it: under the tree's lock, but the file reads, which run off it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from ragkv.engine.kv.cache import LayerReady
from ragkv.engine.kv.node_files import NodeFiles, SpilledSpan, file_name, read_span, span_meta
from ragkv.engine.kv.tree_node import LeasedPart, Node, Rank, TreeKey, TreeTier, common_prefix, lineage


class _Lock(Protocol):
    """The tree's lock, as `with` takes it."""

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...


class TreeParts(Protocol):
    """What the disk tier works on of the tree that owns it (`engine.kv.tree.KVTree`): its lock,
    roots and host budget, and the operations that keep its counts (named here so this module
    need not import the tree, which imports it)."""

    @property
    def _lock(self) -> _Lock: ...
    _roots: dict[TreeKey, Node]
    host_budget: int

    def _release(self, nodes: Iterable[Node]) -> None: ...
    def _drop(self, node: Node) -> None: ...
    def _path(self, key: TreeKey, ids: tuple[int, ...]) -> list[Node]: ...
    def _host_room(self, need: int) -> bool: ...
    def _leave_tier(self, node: Node) -> None: ...
    def _tier_bytes(self, node: Node, sign: int) -> None: ...
    def _add(self, node: Node) -> None: ...
    def _split(self, node: Node, n: int) -> None: ...
    def _free(self, over: Callable[[], bool], candidate: Callable[[Node], bool], act: Callable[[Node], object],
              rank: Callable[[Node], Rank] | None = None) -> None: ...
    def _kv(self, node: Node, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def _hold(self, node: Node, tier: TreeTier, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def _let_slots_go(self, node: Node) -> None: ...


log = logging.getLogger(__name__)


class TreeDisk:
    """`KVTree`'s disk tier (see the module docstring): made and owned by one tree."""

    def __init__(self, tree: TreeParts, files: NodeFiles, budget: int,
                 compute_rate: Callable[[], float | None] | None = None) -> None:
        self.tree = tree
        self.files = files
        self.budget = budget  # KV bytes the tier may keep
        # a disk node is read only when that is sooner than computing its tokens: the engine's
        # prompt tokens per second (None: not measured, read) against the disk's measured bytes per second
        self.compute_rate = compute_rate
        self.rate: float | None = None  # bytes per second of the tier's reads, a moving average
        self.bytes = 0  # KV bytes its nodes hold (a split node's parts each count their share)
        self._refs: dict[str, int] = {}  # file -> nodes reading it
        self.spills = self.read_errors = self.reads_skipped = self.warmed = self.restored = 0

    def share(self, name: str) -> None:
        """One more node reads file `name` (a split node's two parts)."""
        self._refs[name] += 1

    def let_go(self, name: str) -> None:
        """A node no longer reads file `name`: the file goes with its last reader."""
        refs = self._refs[name] - 1
        if refs:
            self._refs[name] = refs
        else:
            del self._refs[name]
            self.files.delete(name)

    def read(self, parts: list[LeasedPart]) -> list[LeasedPart]:
        """Read the disk parts of a leased path (off the lock); the path ends before the first
        that cannot be read, which leaves the tree with what is below it."""
        for j, part in enumerate(parts):
            node = part.node
            with self.tree._lock:  # held in a pool (perhaps brought up to CPU memory since the match: warm)
                pooled = node.slots is not None
            if pooled:
                continue
            if j and not self._worth_reading(node, part.n):  # computing the rest is sooner
                self.tree._release([p.node for p in parts[j:]])
                with self.tree._lock:
                    self.reads_skipped += 1
                return parts[:j]
            try:
                part.k, part.v, part.ready = self._open_node(node)
            except Exception as e:  # a damaged or missing file is a miss for this node and below
                log.warning("KV tree: spilled node %s of context %s unreadable (%s); its tokens will be computed",
                            node.file, node.key, e)
                self.tree._release([p.node for p in parts[j:]])
                self._read_failed(node)
                return parts[:j]
        return parts

    def _worth_reading(self, node: Node, tokens: int) -> bool:
        """Whether reading a disk node's file is sooner than computing its `tokens`, by the
        disk's measured rate and the engine's (either unmeasured: read it)."""
        rate = None if self.compute_rate is None else self.compute_rate()
        disk = self.rate
        return not rate or not disk or node.kv_bytes / disk <= tokens / rate

    def _read_node(self, node: Node) -> tuple[torch.Tensor, torch.Tensor]:
        """A disk node's K and V ([L, Hkv, T, D], views of its file), read whole and verified;
        the read's bytes per second go into the disk's rate. Raises when missing or damaged."""
        if node.file is None:
            raise LookupError("no file")
        t0 = time.perf_counter()
        k, v = self.files.read(node.file)  # [L, Hkv, T_file, D]
        self._observe_read(k.nbytes + v.nbytes, time.perf_counter() - t0)
        return self._own_tokens(node, k, v)

    def _open_node(self, node: Node) -> tuple[torch.Tensor, torch.Tensor, LayerReady | None]:
        """A disk node's K and V ([L, Hkv, T, D], views of its file) as a layered read fills
        them in (`NodeFiles.open`), and the gate that says how far; the whole read's bytes per
        second go into the disk's rate when it ends. A read that fails later drops the node
        once no lease holds it. Raises when the file is missing or its header is bad."""
        if node.file is None:
            raise LookupError("no file")
        t0 = time.perf_counter()
        k, v, ready = self.files.open(node.file)  # [L, Hkv, T_file, D]
        nbytes = k.nbytes + v.nbytes
        done = None if ready is None else getattr(ready, "when_ready", lambda layer: None)(k.shape[0] - 1)

        def ended(_: object = None) -> None:
            if ready is None or ready.error is None:
                self._observe_read(nbytes, time.perf_counter() - t0)
            else:
                self._read_failed(node)

        if done is None:
            ended()
        else:
            done.add_done_callback(ended)
        return (*self._own_tokens(node, k, v), ready)

    @staticmethod
    def _own_tokens(node: Node, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The node's tokens of its file's K and V (a split node reads part of a file)."""
        end = node.offset + len(node.ids)
        if k.shape[2] < end:
            raise ValueError(f"holds {k.shape[2]} tokens, fewer than the node reads")
        return k[:, :, node.offset:end], v[:, :, node.offset:end]

    def _observe_read(self, nbytes: int, seconds: float) -> None:
        """A disk read's bytes per second, into the disk's moving-average rate."""
        if seconds > 0:
            r = nbytes / seconds
            with self.tree._lock:
                self.rate = r if self.rate is None else 0.7 * self.rate + 0.3 * r

    def _read_failed(self, node: Node) -> None:
        """A read of `node`'s file failed (at its open, or layer by layer after its match):
        counted, and the node (with what hangs below it) leaves the tree when it is still the
        tree's, on disk, and no lease holds it (a lease below holds it too); otherwise a
        damaged file is gone (`NodeFiles.open`), so its next match is a miss."""
        with self.tree._lock:
            self.read_errors += 1
            attached = (node.parent.children.get(node.ids[0]) is node if node.parent is not None
                        else self.tree._roots.get(node.key) is node)
            if attached and node.tier is TreeTier.DISK and node.refs == 0:
                self.tree._drop(node)

    def warm(self, key: TreeKey, ids: Sequence[int]) -> int:
        """Bring the disk nodes of the path under `key` that `ids` starts with up to the host
        tier, ahead of the call that will match it: a conversation's next request has its
        files read while its retrieval runs, so its match reads memory. Files are read off the
        lock, top down, until one fails (a miss later, as `match` finds it). Returns the
        tokens brought up."""
        if not self.tree.host_budget:
            return 0
        with self.tree._lock:
            nodes = [n for n in self.tree._path(key, tuple(int(i) for i in ids)) if n.tier is TreeTier.DISK and n.file]
            for node in nodes:
                node.refs += 1  # held: no budget moves or drops them while their files are read
        read: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for node in nodes:
                read.append(self._read_node(node))  # views of its file, copied into the host pool below
        except Exception as e:  # the call's own match finds it unreadable, and counts it
            log.warning("KV tree: warming %s of context %s failed (%s)", nodes[len(read)].file, key, e)
        brought = 0
        with self.tree._lock:
            for node, (k, v) in zip(nodes, read):
                if node.tier is not TreeTier.DISK or not self.tree._host_room(node.kv_bytes):
                    break
                self.tree._leave_tier(node)
                self.tree._hold(node, TreeTier.HOST, k, v)
                self.tree._tier_bytes(node, 1)
                brought += len(node.ids)
            for node in nodes:
                node.refs -= 1
            self.warmed += brought
        return brought

    def persist(self) -> int:
        """Write what the device and host tiers hold to the disk tier (a server stopping: the
        next one over the same files finds these conversations), the most recently used
        contexts first, parents before children, while the disk budget holds; returns the
        nodes written."""
        written = 0
        with self.tree._lock:
            for root in sorted(self.tree._roots.values(), key=lambda r: -r.used):
                stack = [root]
                while stack:
                    node = stack.pop()
                    if node.tier is not TreeTier.DISK and node.state is None:
                        if node.refs or not self.write(node):  # a lease copies it from its pool still
                            continue  # nor what hangs below it: never matched without it
                        written += 1
                    stack.extend(node.children.values())
        self.files.flush()
        return written

    def write(self, node: Node) -> bool:
        """Write a device or host node to the disk tier (when its budget has room)."""
        if node.slots is None or not self.room(node.kv_bytes, node):
            return False
        before = node.path_ids()
        name = file_name(node.key, before, node.ids)
        self.files.write(name, span_meta(node.key, node.start, before, node.ids, node.context, node.priority), node.ids,
                         node.start, *self.tree._kv(node))
        self.tree._tier_bytes(node, -1)
        self.tree._let_slots_go(node)
        node.tier, node.file, node.offset = TreeTier.DISK, name, 0
        self._refs[name] = self._refs.get(name, 0) + 1
        self.tree._tier_bytes(node, 1)
        self.spills += 1
        return True

    def room(self, need: int, keep: Node | None = None) -> bool:
        """Make room for `need` bytes on disk: drop least-recently-used unleased disk leaves
        (never `keep`'s ancestors)."""
        if self.bytes + need <= self.budget:
            return True
        if need > self.budget:
            return False
        kept = lineage(keep)

        def candidate(n: Node) -> bool:
            return n.tier is TreeTier.DISK and n.refs == 0 and not n.children and id(n) not in kept

        self.tree._free(lambda: self.bytes + need > self.budget, candidate, self.tree._drop)
        return self.bytes + need <= self.budget

    def restore(self) -> None:
        """Hang every span the disk tier holds back in the tree (a restarted server's
        conversations): contexts first, then by position, longer spans first; a span whose
        context or path before it is gone, or that adds nothing, is deleted."""
        spans: list[SpilledSpan] = []
        files = self.files
        for name, meta in files.listing():
            try:
                spans.append(read_span(name, meta))
            except ValueError as e:
                log.warning("KV tree: %s; deleted", e)
                files.delete(name)
        spans.sort(key=lambda s: (not s.root, s.start, -len(s.ids)))
        for span in spans:
            if not self._attach(span):
                files.delete(span.name)
        self.room(0)

    def _attach(self, span: SpilledSpan) -> bool:
        """Hang a spilled span on the tree (all on disk); False when it adds nothing."""
        if span.root:
            if span.key in self.tree._roots:
                return False
            made = Node(span.ids, 0, None, span.key, span.context)
            self._disk_node(made, span, 0)
            self.tree._roots[span.key] = made
            return True
        root = self.tree._roots.get(span.key)
        if root is None or span.start != len(root.ids) + len(span.before):
            return False
        path = span.before + span.ids
        node, pos = root, 0
        while pos < len(path):
            child = node.children.get(path[pos])
            if child is None:
                if pos < len(span.before):
                    return False  # the path before it is gone
                break
            n = common_prefix(child.ids, path[pos:])
            if n < len(child.ids):
                if pos + n == len(path) or pos + n < len(span.before) or child.refs:
                    return False  # nothing new, or the path before it parts from the tree's
                self.tree._split(child, n)
            node, pos = child, pos + n
        if pos == len(path):
            return False
        leaf = Node(path[pos:], len(root.ids) + pos, node, span.key)
        self._disk_node(leaf, span, pos - len(span.before))
        node.children[path[pos]] = leaf
        return True

    def _disk_node(self, node: Node, span: SpilledSpan, offset: int) -> None:
        """Count a node found on disk: it reads `span`'s file from its `offset`-th token, at the
        priority its conversation had when the file was written."""
        node.tier, node.file, node.offset, node.priority = TreeTier.DISK, span.name, offset, span.priority
        node.kv_bytes = span.token_bytes * len(node.ids)
        self._refs[span.name] = self._refs.get(span.name, 0) + 1
        self.tree._add(node)
        self.restored += 1
