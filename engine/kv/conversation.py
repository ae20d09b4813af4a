"""The KV tree's one door: where a prompt stands in the tree, and what its answer leaves there.

The tree itself (`engine.kv.tree.KVTree`) is a radix tree of token ids and KV under a byte
budget; this module is everything else about conversations, in one place:

- the **key** of a prompt's context (`Conversations.key`): the tenant, the model, the mode,
  the prefix, the chunks' KV keys and the options that shaped their KV, and the question
  that chose, for the modes that choose chunk tokens by it;
- the **path** after that context, which the tree matches;
- the **lease** on what the tree holds of it (`TreeSpot`, taken by `lease`, the one call
  the server makes), carrying its key and path so nothing downstream computes them again;
- a hybrid's recurrent **snapshot** where its prompt ends;
- where a conversation **lives**: on the engine's device, spilled to CPU memory and then to
  disk as it cools (`KVTree`'s tiers), and found on disk again after a restart;
- a **follow-up question** whose retrieval gives other chunks: its earlier turns' KV is
  carried from the conversation's last context as one more chunk (`follow`, `CarriedTurns`);
- **remembering** an answered prompt (`remember`) for the conversation's next call, its
  path pinned ahead of LRU eviction for `retention`'s seconds when the answer may end in
  tool calls (the agent comes back once its tool has run).

Resuming from a match is the prompt pass's (`Engine.run_steps(..., resume=spot)`).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from ragkv.engine.blend import BlendOptions, BlendResult, Selector, tree_context
from ragkv.engine.kv.cache import ChunkKV, KVCache
from ragkv.engine.kv.node_files import NodeFiles
from ragkv.engine.kv.pool import KVPool
from ragkv.engine.kv.retention import ToolLatency
from ragkv.engine.kv.tree import KVTree
from ragkv.engine.kv.tree_node import RecurrentSnapshot, TreeContext, TreeKey, TreeLease, TreeStats
from ragkv.engine.model_loading import LoadedModel
from ragkv.types import Mode

FOLLOW_MIN_TOKENS = 8  # earlier turns shorter than this are computed again, not carried
_RECENT = 65_536  # conversations whose last context is remembered (least recently used forgotten)


@dataclass(frozen=True, slots=True)
class CarriedTurns:
    """A follow-up question's earlier turns, carried from its conversation's last context into
    this prompt as one more chunk after the retrieved ones (CacheBlend over turns): their KV
    as that context left it, turned back to K before RoPE, then placed at their new positions
    and blended like any chunk's. The prompt is the one the turns would be computed in."""

    key: str  # names their KV in the tree key: the context they came from, and how many tokens
    ids: tuple[int, ...]  # the question segment's first tokens: the earlier turns
    kv: ChunkKV | None  # None when the tree holds this prompt's context already (a later call)


@dataclass(frozen=True, slots=True)
class _Recent:
    key: TreeKey  # the context the conversation's last call was kept under
    turns: CarriedTurns | None  # the turns that call carried (that context's last chunk), without KV
    mode: Mode = Mode.BLEND  # the mode it was served in (follow-ups carry turns in blend only)
    path: tuple[int, ...] = ()  # the tokens it left under the key: its prompt's path and answer


@dataclass(frozen=True, slots=True)
class TreeSpot:
    """Where one prompt stands in the KV tree."""

    key: TreeKey  # its context: what made the KV before the path
    path: tuple[int, ...]  # the tokens after the context, which the tree matched
    lease: TreeLease | None  # the tree's KV of the context and the path's first tokens; None = not held
    conversation: str | None = None  # the agent conversation it belongs to (the server names it); None = none
    turns: CarriedTurns | None = None  # the earlier turns this prompt carries as its last chunk

    @property
    def tokens(self) -> int:
        """Prompt tokens whose KV the tree's lease supplies (0 on a miss)."""
        return 0 if self.lease is None else self.lease.tokens

    @property
    def served(self) -> int:
        """Prompt tokens whose KV came from the tree: the lease's, and the earlier turns a
        follow-up carries from its conversation's last context (their KV read, not computed)."""
        carried = len(self.turns.ids) if self.turns is not None and self.turns.kv is not None else 0
        return self.tokens + carried

    @property
    def device_bytes(self) -> int:
        """Device bytes of the tree's nodes the lease holds (0 on a miss or once released)."""
        return 0 if self.lease is None else self.lease.device_bytes

    def release(self) -> None:
        """Let the leased path be evicted again (idempotent; nothing on a miss)."""
        if self.lease is not None:
            self.lease.release()


def chooses_by_question(mode: Mode, options: BlendOptions | None = None) -> bool:
    """Whether `mode` picks chunk tokens or chunks by the question's attention (so the chunks'
    KV after the pass depends on the tokens that chose)."""
    opts = options or BlendOptions()
    return Mode(mode) is Mode.FOCUS or (Mode(mode) is Mode.BLEND and opts.selector is Selector.QUERY)


def tree_path(mode: Mode, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]],
              question_ids: Sequence[int]) -> tuple[int, ...]:
    """The tokens after a prompt's context in `mode`, which the tree matches (see `Conversations.key`)."""
    mode = Mode(mode)
    chunks = [t for ids in chunk_ids for t in ids]
    if mode is Mode.FULL:
        return (*prefix_ids, *chunks, *question_ids)
    if mode is Mode.PREFIX:
        return (*chunks, *question_ids)
    return tuple(question_ids)


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """The KV tree's budgets and policies (`ragkv serve --kv-tree-*`), given to the engine as it is
    built (`Engine(lm, tree=...)`)."""

    budget_bytes: int = 0  # on the engine's device; 0 = no tree
    tenant_share: float = 1.0  # the largest share of the budget one tenant takes from the others (`KVTree`)
    host_bytes: int = 0  # KV bytes spilled from the device kept in CPU memory; 0 = none
    files: NodeFiles | None = None  # the disk tier below that (kvstore.tree_files.TreeFiles); None = none
    disk_bytes: int = 0  # KV bytes the disk tier may hold
    retain_max_s: float | None = None  # pins last at most this (0 = plain LRU); None = `ToolLatency`'s default
    retain_default_s: float = 10.0  # a pin's time-to-live before any tool latency is seen
    follow_ups: bool = True  # carry a follow-up's earlier turns (`Conversations.follow`)


NO_TREE = TreeConfig()  # an engine without a KV tree


class Conversations:
    """The KV tree of one engine, behind the calls a served request makes.

    Args:
        lm: the engine's model (its fingerprint and dtype are in every key).
        config: the tree's budgets (device, host, disk and their files, whose conversations are
            found again here), its tenant share, retention and follow-ups.
        recurrent: the model is a hybrid: the tree keeps recurrent states too.
        compute_rate: the engine's prompt tokens per second (None until measured): a disk node
            is read at a match only when that is sooner than computing its tokens.
        device_pool: where the tree keeps its device tier: the engine's decode pool's share
            (`DecodePool.share`), so requests and the tree pass KV with no copy; None = a pool
            of its own.
    """

    def __init__(self, lm: LoadedModel, config: TreeConfig = NO_TREE, recurrent: bool = False,
                 compute_rate: Callable[[], float | None] | None = None, device_pool: KVPool | None = None) -> None:
        self.lm = lm
        self._recent: OrderedDict[str, _Recent] = OrderedDict()  # conversation -> its last context
        self.follow_ups = config.follow_ups  # carry a follow-up's earlier turns (`follow`); False = compute them again
        self._recent_lock = threading.Lock()
        latency = None if config.retain_max_s is None else ToolLatency(config.retain_max_s, config.retain_default_s)
        self.tree = KVTree(config.budget_bytes, recurrent=recurrent, tenant_share=config.tenant_share,
                           host_bytes=config.host_bytes, files=config.files, disk_bytes=config.disk_bytes,
                           compute_rate=compute_rate, latency=latency, device_pool=device_pool)

    @property
    def enabled(self) -> bool:
        return self.tree.enabled

    def stats(self) -> TreeStats:
        return self.tree.stats()

    def persist(self) -> int:
        """Write the conversations held in memory to the disk tier, for the next server over
        the same folder (at shutdown); returns the nodes written (0 without a disk tier)."""
        return self.tree.persist()

    def use_retention(self, max_s: float, default_s: float = 10.0) -> None:
        """Pins last at most `max_s` seconds (0 = no pins: plain LRU), `default_s` before any
        tool latency is seen (`ToolLatency`); the latencies seen so far are forgotten."""
        self.tree.latency = ToolLatency(max_s, default_s)

    @property
    def retain_max_s(self) -> float:
        """The longest a path may be pinned (0: retention is off)."""
        return self.tree.latency.max_s

    def retention(self, asked: float | None = None) -> float:
        """Seconds an answer that may end in tool calls keeps its path pinned: `asked` (the
        client's, at most `retain_max_s`), else the tool latency the tree has learned; 0 when
        the tree or retention is off."""
        if not self.enabled or self.retain_max_s <= 0:
            return 0.0
        return min(max(asked, 0.0), self.retain_max_s) if asked is not None else self.tree.latency.ttl()

    def key(self, mode: Mode, prefix_ids: Sequence[int], chunk_keys: Sequence[Hashable],
            options: BlendOptions | None = None, select_ids: Sequence[int] = (), tenant: str = "") -> TreeKey:
        """The context a prompt's KV hangs under.

        FULL: the model alone (every token is on the path: automatic prefix caching).
        PREFIX: the model and the prefix. The chunk modes: the model, the mode, the prefix, the
        chunks' KV keys in order (model, tokenizer, prefix and neighbour context are in each),
        the options, and for the modes that choose by the question, the tokens that chose.
        Every key is within its `tenant`: one tenant's paths never match another's prompts.
        """
        mode, lm = Mode(mode), self.lm
        if mode is Mode.FULL:
            return TreeKey.of(lm.fingerprint, lm.dtype, mode.value, tenant=tenant)
        prefix = tuple(int(i) for i in prefix_ids)
        if mode is Mode.PREFIX:
            return TreeKey.of(lm.fingerprint, lm.dtype, mode.value, prefix, tenant=tenant)
        opts = options or BlendOptions()
        chose = tuple(int(i) for i in select_ids) if chooses_by_question(mode, opts) else ()
        return TreeKey.of(lm.fingerprint, lm.dtype, mode.value, prefix, tuple(repr(k) for k in chunk_keys), opts,
                          chose, tenant=tenant)

    def lease(self, mode: Mode, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]],
              chunk_keys: Sequence[Hashable], question_ids: Sequence[int], *, options: BlendOptions | None = None,
              select_ids: Sequence[int] | None = None, tenant: str = "", conversation: str | None = None,
              turns: CarriedTurns | None = None) -> TreeSpot | None:
        """Where this prompt stands in the tree, with a lease on what the tree holds of it;
        None when the tree is off. `select_ids`: the tokens that choose (None = the question's).
        `conversation` names the agent conversation (remembered with the answer, for its
        follow-ups); `turns`: the earlier turns the prompt carries as its last chunk (already in
        `chunk_ids` and `chunk_keys`)."""
        if not self.enabled:
            return None
        chose = question_ids if select_ids is None else select_ids
        key = self.key(mode, prefix_ids, chunk_keys, options, chose, tenant)
        path = tree_path(mode, prefix_ids, chunk_ids, question_ids)
        return TreeSpot(key, path, self.tree.match(key, path), conversation, turns)

    def carried(self, conversation: str | None, mode: Mode, question_ids: Sequence[int]) -> CarriedTurns | None:
        """The turns this conversation's last call carried, when this prompt's question segment
        starts with them (a tool loop's next call after a follow-up): the same last chunk, so
        the same key and the context the tree holds (no KV: the tree supplies it)."""
        recent = self._recall(conversation, mode)
        if recent is None or recent.turns is None:
            return None
        ids = recent.turns.ids
        return recent.turns if len(question_ids) > len(ids) and tuple(question_ids[:len(ids)]) == ids else None

    def follow(self, conversation: str | None, mode: Mode, question_ids: Sequence[int]) -> CarriedTurns | None:
        """A follow-up question's earlier turns, read from the conversation's last context (this
        prompt retrieved other chunks, so its own context is new): the tokens its question
        segment shares with what that context holds (the turns that context carried, then its
        path), with their KV. None when the tree no longer holds them, or fewer than
        `FOLLOW_MIN_TOKENS` are shared."""
        recent = self._recall(conversation, mode)
        if recent is None:
            return None
        before = recent.turns.ids if recent.turns is not None else ()
        if tuple(question_ids[:len(before)]) != before:
            return None
        lease = self.tree.match(recent.key, question_ids[len(before):])
        if lease is None:
            return None
        try:
            n, c = len(before) + lease.matched, len(lease.context_ids)
            if lease.matched == 0 or n < FOLLOW_MIN_TOKENS:
                return None
            k, v = lease.slots(c - len(before), c + lease.matched)  # [L, Hkv, n, D], K after RoPE
        finally:
            lease.release()
        ids = tuple(int(i) for i in question_ids[:n])
        kv = self._unrotated(ids, c - len(before), k, v, after_context=True)
        return CarriedTurns(f"turns:{recent.key.digest}:{n}", ids, kv)

    def _unrotated(self, ids: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor,
                   after_context: bool = False) -> ChunkKV:
        """Tree KV of `ids` at positions [start, start + T) (K after RoPE, [L, Hkv, T, D]) as a
        segment's KV is kept: K turned back to before RoPE, on the engine's device."""
        dev, n = self.lm.device, len(ids)
        positions = torch.arange(start, start + n, device=dev)  # [T]
        k = k.to(dev)
        inverse = self.lm.adapter.rotary(positions, k).inverse()
        for layer in range(k.shape[0]):
            k[layer] = inverse.apply(k[layer], layer)
        return ChunkKV(torch.tensor(list(ids), device=dev), k, v.to(dev), positions, after_context=after_context)

    def instructions(self, prefix_ids: Sequence[int], tenant: str = "") -> TreeSpot | None:
        """Where a request's own instructions stand in the tree: its prefix (the chat template's
        system turn with a system prompt other than its index's, then the context's opening),
        under its tenant's full-prefill context. So an agent's second call with the same
        instructions reads them from the tree, a full prefill of them finds them too, and another
        tenant's never does. The lease covers the whole prefix or is None (computed: then
        `keep_instructions` stores it); None when the tree is off."""
        if not self.enabled:
            return None
        key = self.key(Mode.FULL, (), (), tenant=tenant)
        path = tuple(int(i) for i in prefix_ids)
        lease = self.tree.match(key, path, leave_last=False)
        if lease is not None and lease.tokens < len(path):  # a part: the whole prefix is computed
            lease.release()
            lease = None
        return TreeSpot(key, path, lease)

    def instructions_kv(self, spot: TreeSpot) -> ChunkKV:
        """The instructions' KV out of their lease (positions 0..P-1, K before RoPE, as the
        engine's prefix KV is kept); the lease is released."""
        if spot.lease is None:
            raise ValueError("instructions_kv needs a held lease: a bug")
        try:
            k, v = spot.lease.slots(0, len(spot.path))  # [L, Hkv, P, D], K after RoPE
        finally:
            spot.release()
        return self._unrotated(spot.path, 0, k, v)

    def keep_instructions(self, spot: TreeSpot, kv: ChunkKV) -> int:
        """Store instructions' KV computed for a request (`kv`: positions 0..P-1, K before RoPE)
        under `spot`'s key, for the tenant's next call. Returns the tokens newly stored."""
        n, lm = kv.num_tokens, self.lm
        if not self.enabled or n != len(spot.path) or n == 0:
            return 0
        cache = KVCache(lm.kv_layers, lm.num_kv_heads, lm.head_dim, n, lm.dtype, lm.device)
        cache.length = cache.write_segments([kv], lm.adapter.rotary(torch.arange(n, device=lm.device),
                                                                        torch.empty(0, dtype=lm.dtype, device=lm.device)))
        return self.tree.insert(spot.key, (), TreeContext(0, 0, 0), spot.path, cache)

    def prefetch(self, conversation: str | None) -> int:
        """Bring what the conversation's last call left in the tree from disk up to CPU memory,
        ahead of its next call's match (called as that call's retrieval starts, off its
        thread). Returns the tokens brought up."""
        if conversation is None or not self.enabled or self.tree.files is None:
            return 0
        with self._recent_lock:
            recent = self._recent.get(conversation)
        return 0 if recent is None else self.tree.warm(recent.key, recent.path)

    def _recall(self, conversation: str | None, mode: Mode) -> _Recent | None:
        if conversation is None or Mode(mode) is not Mode.BLEND or not self.enabled or not self.follow_ups:
            return None
        with self._recent_lock:
            recent = self._recent.get(conversation)
        return recent if recent is not None and recent.mode is Mode.BLEND else None

    def _note(self, spot: TreeSpot, mode: Mode, path: tuple[int, ...]) -> None:
        """Remember the context a conversation's call was kept under, and what it left there:
        for its follow-ups (blend) and the prefetch of its next call."""
        if spot.conversation is None:
            return
        turns = None if spot.turns is None else replace(spot.turns, kv=None)
        with self._recent_lock:
            self._recent[spot.conversation] = _Recent(spot.key, turns, mode, path)
            self._recent.move_to_end(spot.conversation)
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)

    def snapshot(self, res: BlendResult) -> RecurrentSnapshot | None:
        """A hybrid's recurrent state after its prompt pass (taken before decode moves it on),
        for `remember`; None for other models."""
        cache = res.cache
        if not self.enabled or cache.recurrent is None:
            return None
        if cache.marked is not None and cache.mark is not None:  # where the answer's header starts (Prompt.snapshot_at)
            state, tokens = cache.marked, cache.mark
            cache.marked = None
        else:
            state, tokens = copy.deepcopy(cache.recurrent), res.n_prompt_tokens
        return RecurrentSnapshot(tokens, state, self.lm.adapter.recurrent_state_bytes(state))

    def remember(self, spot: TreeSpot, mode: Mode, res: BlendResult, question_tokens: int, prefix_tokens: int,
                 answer_ids: Sequence[int] = (), snapshot: RecurrentSnapshot | None = None,
                 retain_s: float = 0.0, header_tokens: int = 0, priority: int = 0) -> int:
        """Keep a prompt's KV served in `mode` (and its answer's, as far as the cache holds it)
        under `spot`'s key, after its decode; a hybrid's `snapshot` (FULL mode: its state after
        the prompt) with it. `retain_s` > 0 (the answer may end in tool calls): its path is
        pinned that long (`KVTree.insert`), and the conversation's next call is the match that
        reaches the prompt's end but its last `header_tokens` (the answer's header, which the
        next call's prompt replaces by the answer's turn). `priority`: how much the path
        matters against the tenant's others (`KVTree.insert`). Returns the tokens newly stored."""
        if not self.enabled:
            return 0
        prompt = res.token_ids.tolist()
        ids = [*prompt, *answer_ids][:res.cache.length]
        start = {Mode.FULL: 0, Mode.PREFIX: prefix_tokens}.get(Mode(mode), res.n_prompt_tokens - question_tokens)
        self._note(spot, Mode(mode), tuple(ids[start:]))
        return self.tree.insert(spot.key, ids[:start], tree_context(res, question_tokens, prefix_tokens),
                                ids[start:], res.cache, snapshot, pin_s=retain_s,
                                parts_at=len(prompt) - start - header_tokens, priority=priority)
