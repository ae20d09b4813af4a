"""The KV tree's disk tier, as the engine sees it: what a spilled node's file must carry so a
restarted server finds its conversations again, and the store that keeps the files.

The store is kvstore's (`kvstore.tree_files.TreeFiles`: one checksummed chunk-KV file per
node, written atomically on a writer thread); the engine names only this protocol, so it
does no I/O of its own. A file holds one edge of the tree as it was when spilled: its tokens
and KV, where they start, the tokens between its context and them, and its context's key
(and, for a root, its `TreeContext`). A node that a later split cut in two keeps reading its
part of the file (`Node.offset`); the file goes when no node reads it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from ragkv.engine.kv.cache import LayerReady
from ragkv.engine.kv.retention import MAX_PRIORITY
from ragkv.engine.kv.tree_node import TreeContext, TreeKey

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the chunk-KV header's dtype names


class NodeFiles(Protocol):
    """Files of spilled tree nodes, one per name. Reads verify what they return."""

    def write(self, name: str, meta: Mapping[str, str], ids: Sequence[int], start: int,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a node's KV (K [L, Hkv, T, D] after RoPE at positions start.., V) under `name`;
        may return before the bytes are on disk (a read of `name` meanwhile still finds them)."""
        ...

    def read(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V written under `name`, verified; raises when missing or damaged."""
        ...

    def open(self, name: str) -> tuple[torch.Tensor, torch.Tensor, LayerReady | None]:
        """Start reading `name` layer by layer: its K and V, whose layers fill in as the gate
        says (None: all there now). Raises when missing or its header is bad; damage found
        later fails the gate (and the file is not read again)."""
        ...

    def delete(self, name: str) -> None:
        ...

    def listing(self) -> Iterable[tuple[str, Mapping[str, str]]]:
        """Every readable file's name and metadata (headers only; the data is verified on read)."""
        ...

    def flush(self) -> None:
        """Wait until every write and delete so far is done."""
        ...


@dataclass(frozen=True, slots=True)
class SpilledSpan:
    """What a node's file says of it."""

    name: str
    key: TreeKey
    start: int  # position of its first token
    before: tuple[int, ...]  # the tokens between the context's end and `start` (() for a root)
    ids: tuple[int, ...]  # its tokens
    context: TreeContext | None  # roots only
    token_bytes: int  # KV bytes per token (K and V, every layer)
    priority: int = 0  # its conversation's priority when it was written (engine.kv.retention)

    @property
    def root(self) -> bool:
        return self.context is not None


def file_name(key: TreeKey, before: Sequence[int], ids: Sequence[int]) -> str:
    """A node's file name: sha256 over its tenant, context key and every token up to its end."""
    h = hashlib.sha256(b"ragkv-tree-node\0")
    for part in (key.tenant, key.digest, list(before), list(ids)):
        data = json.dumps(part).encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def span_meta(key: TreeKey, start: int, before: Sequence[int], ids: Sequence[int],
              context: TreeContext | None, priority: int = 0) -> dict[str, str]:
    """The metadata a node's file carries (strings, as the chunk-KV file's header holds them)."""
    meta = {"tree_tenant": key.tenant, "tree_key": key.digest, "tree_start": str(start),
            "tree_before": json.dumps(list(before)), "tree_ids": json.dumps(list(ids)),
            "tree_priority": str(priority)}
    if context is not None:
        meta["tree_context"] = json.dumps(asdict(context))
    return meta


def read_span(name: str, meta: Mapping[str, str]) -> SpilledSpan:
    """A file's metadata back as a span; ValueError when it is not a tree node's or does not add up."""
    try:
        key = TreeKey(meta["tree_key"], meta["tree_tenant"])
        start = int(meta["tree_start"])
        before = tuple(int(i) for i in json.loads(meta["tree_before"]))
        ids = tuple(int(i) for i in json.loads(meta["tree_ids"]))
        context = None
        if "tree_context" in meta:
            fields = json.loads(meta["tree_context"])
            for name_ in ("used_chunks", "chunk_scores"):
                if fields.get(name_) is not None:
                    fields[name_] = tuple(fields[name_])
            context = TreeContext(**fields)
        L, H, _, D = (int(x) for x in meta["shape"].split(","))
        token_bytes = 2 * L * H * D * _DTYPE_BYTES[meta["dtype"]]
        priority = int(meta.get("tree_priority", "0"))  # files written before priorities: 0
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"tree node file {name} has malformed metadata: {e}") from None
    if not ids or file_name(key, before, ids) != name or (context is not None and (before or start)):
        raise ValueError(f"tree node file {name}: its metadata does not match its name")
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"tree node file {name}: priority {priority} outside -{MAX_PRIORITY}..{MAX_PRIORITY}")
    return SpilledSpan(name, key, start, before, ids, context, token_bytes, priority)
