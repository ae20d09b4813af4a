"""Which replica answers a request: chunk-aware scoring over what each replica's tiers hold.

Pure functions and small value types, no Ray: `server/cluster.py`'s `ChunkRouter` feeds them
the replicas' published summaries and the request's chunk keys, and hands Ray Serve the
ranking. Tested on their own (`tests/server/test_routing.py`).

A chunk's KV in a replica's GPU or CPU tier costs nothing to load; on its disk it costs a
read; in S3 it costs everyone the same read, so S3 scores nothing. A replica scores the
tier-weighted share of the request's chunks it holds, plus an affinity bonus when it
served the request's conversation last (its KV tree holds the conversation). Locality
must not pile every request onto one replica: when the best replica's queue is longer
than the shortest by more than `max_skew`, it is passed over; when nothing tells the
replicas within that skew apart, the choice falls back to power-of-two choices.

Beyond what replicas publish, the ingress remembers which replica answered each
conversation last (`ConversationPins`): a conversation's next call (a chat's next turn, a
Responses request's `previous_response_id`, which continues its conversation) goes to that
replica first while it is alive and within the skew, whatever the Bloom filters say.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import random
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType

from ragkv.types import Tier

KeyHex = NewType("KeyHex", str)  # a ChunkKey's hex digest (64 lowercase hex characters)
ConversationId = NewType("ConversationId", str)  # names one agent conversation (conversation_id)

# What holding a chunk is worth, by tier: free (GPU), a host-to-device copy (CPU), a read (disk).
# S3 is everyone's: holding a chunk there says nothing about a replica.
TIER_WEIGHTS: Mapping[Tier, float] = {Tier.GPU: 1.0, Tier.CPU: 0.8, Tier.DISK: 0.3}
AFFINITY_BONUS = 2.0  # above any chunk score (at most 1.0): a conversation goes back to its tree


class Policy(str, enum.Enum):
    """How the router picks a replica (`ragkv serve --routing`, `ragkv bench --routing`)."""

    CHUNK = "chunk"  # by the chunks and conversation each replica holds, guarded against load skew
    POW2 = "pow2"  # power of two choices: the shorter queue of two replicas drawn at random


@dataclass(frozen=True, slots=True)
class KeyFilter:
    """A Bloom filter of chunk keys (or conversation ids): a few bits per key, no key lists.

    The keys are sha256 digests already, so the k bit positions come from the digest itself
    (double hashing over two 64-bit words); other strings are hashed first.
    """

    bits: bytes  # m bits, little-endian within each byte
    k: int  # bits set per key

    @classmethod
    def of(cls, keys: Iterable[str], fp_rate: float = 0.01, min_bits: int = 64) -> KeyFilter:
        """A filter holding `keys`, sized for a false-positive rate of `fp_rate`.

        Raises:
            ValueError: `fp_rate` is not in (0, 1).
        """
        if not 0.0 < fp_rate < 1.0:
            raise ValueError(f"fp_rate must be in (0, 1), got {fp_rate!r}")
        keys = list(keys)
        n = max(len(keys), 1)
        m = max(min_bits, math.ceil(-n * math.log(fp_rate) / math.log(2) ** 2))
        m = (m + 7) // 8 * 8
        k = max(1, round(m / n * math.log(2)))
        bits = bytearray(m // 8)
        for key in keys:
            for pos in _positions(key, k, m):
                bits[pos >> 3] |= 1 << (pos & 7)
        return cls(bytes(bits), k)

    def __contains__(self, key: str) -> bool:
        m = len(self.bits) * 8
        return m > 0 and all(self.bits[p >> 3] >> (p & 7) & 1 for p in _positions(key, self.k, m))

    @property
    def nbytes(self) -> int:
        return len(self.bits)


EMPTY = KeyFilter(b"", 1)


def _positions(key: str, k: int, m: int) -> Iterable[int]:
    raw = bytes.fromhex(key) if len(key) == 64 and _is_hex(key) else hashlib.sha256(key.encode()).digest()
    h1 = int.from_bytes(raw[:8], "little")
    h2 = int.from_bytes(raw[8:16], "little") | 1
    return ((h1 + i * h2) % m for i in range(k))


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    """What one replica publishes for routing (`record_routing_stats`): compact, seconds old."""

    tiers: Mapping[Tier, KeyFilter] = field(default_factory=dict)  # the chunk keys each local tier holds
    conversations: KeyFilter = EMPTY  # the conversations its KV tree served lately
    queue: int = 0  # requests it holds now (queued, prompt, decoding)

    def to_dict(self) -> dict[str, object]:
        """Plain types for Ray Serve's routing stats (a dict it passes to the router)."""
        return {"tiers": {t.value: (f.bits, f.k) for t, f in self.tiers.items()},
                "conversations": (self.conversations.bits, self.conversations.k), "queue": self.queue}

    @classmethod
    def from_dict(cls, d: Mapping[str, object] | None) -> ReplicaSummary:
        """Read `to_dict`'s form back; a replica that has published nothing yet holds nothing."""
        if not d:
            return cls()
        tiers = {Tier(t): KeyFilter(bits, k) for t, (bits, k) in d.get("tiers", {}).items()}  # type: ignore[union-attr]
        bits, k = d.get("conversations", (b"", 1))  # type: ignore[misc]
        return cls(tiers, KeyFilter(bits, k), int(d.get("queue", 0)))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class RouteKeys:
    """What a request asks of a replica's caches: known after retrieval, before routing."""

    chunks: tuple[KeyHex, ...] = ()  # the retrieved chunks' KV keys, best first
    conversation: ConversationId | None = None  # the agent conversation it continues; None = none
    # the replica (Ray Serve's unique id) that answered its conversation last (`ConversationPins`):
    # ranked first while it is a candidate within the skew; None = none known
    pinned: str | None = None


# A summary published this long after a request was routed holds what that request brought
# (its conversation is recorded as its answer starts, its chunks land in the CPU tier as their
# reads do); what was routed later stays the router's own belief until a later summary.
SETTLE_S = 2.0  # seconds


@dataclass(slots=True)
class ReplicaView:
    """The router's view of one replica: its last summary, plus what the router sent it since."""

    replica_id: str
    summary: ReplicaSummary = field(default_factory=ReplicaSummary)
    queue: int = 0  # the router's count (Ray's queue-length probe, or the summary's)
    published_at: float = 0.0  # time.time() the replica published `summary` at
    # chunk -> time.time() it was routed here (so now in its CPU tier)
    routed_keys: dict[str, float] = field(default_factory=dict)
    routed_conversations: dict[str, float] = field(default_factory=dict)  # conversation -> time.time() routed here

    def absorb(self, summary: ReplicaSummary, published_at: float) -> None:
        """A newer summary: it replaces what the router believed of requests routed before it
        had settled (`SETTLE_S`); later ones stay believed (stats arrive seconds old)."""
        if published_at <= self.published_at:
            return
        self.summary, self.published_at = summary, published_at
        settled = published_at - SETTLE_S
        self.routed_keys = {k: t for k, t in self.routed_keys.items() if t > settled}
        self.routed_conversations = {c: t for c, t in self.routed_conversations.items() if t > settled}

    def tier_of(self, key: str) -> Tier | None:
        """The fastest tier this replica is believed to hold `key` in (None: none of its own)."""
        for tier in (Tier.GPU, Tier.CPU, Tier.DISK):
            f = self.summary.tiers.get(tier)
            if f is not None and key in f:
                return tier
        return Tier.CPU if key in self.routed_keys else None

    def holds_conversation(self, conversation: str) -> bool:
        return conversation in self.routed_conversations or conversation in self.summary.conversations


def chunk_score(view: ReplicaView, keys: RouteKeys) -> float:
    """The tier-weighted share of the request's chunks `view` holds, plus the affinity bonus.

    In [0, 1] without affinity: 1.0 when every chunk is in its GPU tier.
    """
    score = 0.0
    if keys.chunks:
        score = sum(TIER_WEIGHTS.get(t, 0.0) for t in map(view.tier_of, keys.chunks) if t is not None)
        score /= len(keys.chunks)
    if keys.conversation is not None and view.holds_conversation(keys.conversation):
        score += AFFINITY_BONUS
    return score


def rank(views: Sequence[ReplicaView], keys: RouteKeys, policy: Policy, *, max_skew: int = 4,
         rng: random.Random | None = None) -> list[ReplicaView]:
    """The replicas in the order to try them, best first.

    CHUNK: the replica `keys.pinned` names first, when it is among `views` (alive) and within
    `max_skew`; the others (all of them, otherwise) by `chunk_score`, ties to the shorter
    queue; a replica whose queue is more than `max_skew` longer than the shortest is ranked
    after every one within it. When the replicas within the skew all score the same (none
    holds anything of the request, or all hold it alike), power-of-two choices decide.
    POW2: two replicas drawn at random, the shorter queue first, then the rest.

    Raises:
        ValueError: No replica to rank, or `max_skew` negative.
    """
    if not views:
        raise ValueError("no replica to route to")
    if max_skew < 0:
        raise ValueError(f"max_skew must be >= 0, got {max_skew!r}")
    rng = rng or random.Random()
    if policy is Policy.POW2:
        return _pow2(views, rng)
    shortest = min(v.queue for v in views)
    within = [v for v in views if v.queue <= shortest + max_skew]
    pinned = next((v for v in within if keys.pinned is not None and v.replica_id == keys.pinned), None)
    if pinned is not None:  # alive (a candidate) and not overloaded: its tree holds the conversation
        others = [v for v in views if v is not pinned]
        unpinned = dataclasses.replace(keys, pinned=None)
        return [pinned] + (rank(others, unpinned, policy, max_skew=max_skew, rng=rng) if others else [])
    beyond = [v for v in views if v.queue > shortest + max_skew]
    scores = {v.replica_id: chunk_score(v, keys) for v in views}
    if len({scores[v.replica_id] for v in within}) == 1:  # nothing tells them apart (say, a cold start)
        return _pow2(within, rng) + sorted(beyond, key=lambda v: v.queue)
    tie = {v.replica_id: rng.random() for v in views}  # equal scores and queues: no replica is everyone's first
    by_score = sorted(within, key=lambda v: (-scores[v.replica_id], v.queue, tie[v.replica_id]))
    return by_score + sorted(beyond, key=lambda v: (-scores[v.replica_id], v.queue, tie[v.replica_id]))


def _pow2(views: Sequence[ReplicaView], rng: random.Random) -> list[ReplicaView]:
    if len(views) <= 1:
        return list(views)
    a, b = rng.sample(range(len(views)), 2)
    pair = sorted((views[a], views[b]), key=lambda v: v.queue)
    rest = [v for i, v in enumerate(views) if i not in (a, b)]
    return pair + sorted(rest, key=lambda v: v.queue)


def note_routed(view: ReplicaView, keys: RouteKeys, now: float | None = None) -> None:
    """The router sent `keys` to `view`: until a summary published after they settled, believe
    its CPU tier and KV tree hold them (stats are seconds old; the next request of the same
    topic or conversation must not scatter meanwhile)."""
    now = time.time() if now is None else now
    view.routed_keys.update(dict.fromkeys(keys.chunks, now))
    if keys.conversation is not None:
        view.routed_conversations[keys.conversation] = now
    view.queue += 1


class ConversationPins:
    """Which replica answered each conversation last, as the ingress saw the answers begin.

    Exact where the replicas' published conversation filters are a window (their last few
    thousand conversations), seconds old and approximate. Bounded: the conversations answered
    least recently are forgotten first. The ingress's own, on its event loop (one thread).
    """

    def __init__(self, max_conversations: int = 65536) -> None:
        if max_conversations < 1:
            raise ValueError(f"max_conversations must be >= 1, got {max_conversations!r}")
        self.max_conversations = max_conversations
        self._replicas: OrderedDict[ConversationId, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas)

    def note(self, conversation: ConversationId | None, replica: str) -> None:
        """`replica` began answering `conversation` (its tree now holds the conversation's path)."""
        if conversation is None:
            return
        self._replicas[conversation] = replica
        self._replicas.move_to_end(conversation)
        while len(self._replicas) > self.max_conversations:
            self._replicas.popitem(last=False)

    def pin(self, keys: RouteKeys) -> RouteKeys:
        """`keys` naming the replica that answered their conversation last (as they are when none did)."""
        replica = None if keys.conversation is None else self._replicas.get(keys.conversation)
        return keys if replica is None else dataclasses.replace(keys, pinned=replica)


def conversation_id(collection: str, first_user_message: str, system_prompt: str | None = None,
                    tenant: str = "") -> ConversationId:
    """Name an agent conversation by what every one of its calls repeats: the collection, the
    system message and the first user message, within its tenant (two API keys asking the same
    never share one). A client may send its own id instead."""
    h = hashlib.sha256()
    for part in (collection, system_prompt or "", first_user_message, *((tenant,) if tenant else ())):
        h.update(part.encode())
        h.update(b"\0")
    return ConversationId(h.hexdigest()[:32])
