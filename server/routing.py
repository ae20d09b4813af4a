"""Which replica answers a request: its expected time to first token on each replica, and where
its chunk set belongs.

Pure functions and small value types, no Ray: `server/cluster.py`'s `ChunkRouter` feeds them
the replicas' published summaries and the request's chunk keys, and hands Ray Serve the
ranking. Tested on their own (`tests/server/test_routing.py`).

**One cost, in seconds.** Each replica publishes what its tiers hold (Bloom filters), its
measured speeds (each tier's read latency and seconds per token, its prefill rate, its mean
prompt pass) and its scheduler's backlog of prompt work (`Speeds`). A request's expected time
to first token there (`expected_ttft`) is that backlog, plus a pass for each request routed
there since, plus each of its chunks' load from the fastest tier holding it (a GPU or CPU tier:
nearly nothing; a disk: a read; none: the shared S3 tier's read or a compute, whichever is
sooner), plus a pass where its KV tree lacks the conversation the request continues. Locality
and load are thus one number, as NVIDIA Dynamo's KV router weighs overlap against load.

**Placement.** The replicas expected within `slack` prompt passes of the soonest count as
equally soon; among them the request goes to the one holding most of it (chunks by tier, its
conversation's KV tree), and where none holds more, to its rendezvous home (`home_weight` of
its best-ranked chunk: every question whose best match is that chunk shares it). So a chunk's
set lives in one replica's tier, and the replicas' tiers together approach one tier their
size. A hot set whose home is too busy goes to its second home, which warms a second copy:
hot sets are replicated, and only onto the replicas their rendezvous order names. Each
decision is counted by its `Reason` (the ingress's `ragkv_route_decisions_total`).

Beyond what replicas publish, the ingress remembers which replica answered each
conversation last (`ConversationPins`): a conversation's next call (a chat's next turn, a
Responses request's `previous_response_id`, which continues its conversation) goes to that
replica first while it is alive and within the slack, whatever the Bloom filters say.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import random
import statistics
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from ragkv.kvstore.key_filter import EMPTY, KeyFilter
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


# Seconds per token to have a chunk's KV on the device, by where a replica holds it, until the
# replica has measured its own reads (`Speeds.read`); in the ratio of `TIER_WEIGHTS`.
# A chunk another replica holds in its host tier is a peer read when the peer tier is on
# (`kvstore.tiers.peer`): dearer than a copy of its own, cheaper than S3 or a compute.
DEFAULT_S_PER_TOKEN: Mapping[Tier, float] = {Tier.GPU: 0.0, Tier.CPU: 2e-5, Tier.PEER: 5e-5, Tier.DISK: 7e-5}
DEFAULT_MISS_S_PER_TOKEN = 1e-4  # held in no tier of the replica's own: the shared tier, or computed
DEFAULT_PASS_S = 0.5  # one prompt pass, until a replica has measured its own
DEFAULT_CHUNK_TOKENS = 256  # a chunk whose size the ingress did not say
ROUTE_SLACK = 1.0  # the router's default slack, in prompt passes (`rank`)


@dataclass(frozen=True, slots=True)
class Speeds:
    """A replica's measured speeds and its load now: what its expected time to first token
    (`expected_ttft`) is priced in. Measured on the replica (kvstore's read timing, the
    engine's prefill and pass rates, the scheduler's backlog); None or empty until measured."""

    read: Mapping[Tier, tuple[float, float]] = field(default_factory=dict)  # tier -> (latency s, s per token)
    compute_s_per_token: float | None = None  # prefill of a chunk that is read from nowhere
    pass_s: float | None = None  # seconds of one prompt pass (its moving average)
    backlog_s: float = 0.0  # seconds of prompt work its scheduler holds (queued, in a pass, waiting on KV)

    def chunk_s(self, tier: Tier | None, tokens: int) -> float:
        """Seconds until a `tokens`-token chunk's KV is ready on this replica when its fastest
        tier holding it is `tier` (None: none of its own: the shared S3 tier or a compute),
        whichever is sooner, as its loading controller chooses."""
        options = []
        if tier is not None:
            measured = self.read.get(tier)
            options.append(measured[0] + tokens * measured[1] if measured
                           else tokens * DEFAULT_S_PER_TOKEN.get(tier, DEFAULT_MISS_S_PER_TOKEN))
        elif (s3 := self.read.get(Tier.S3)) is not None:
            options.append(s3[0] + tokens * s3[1])
        if self.compute_s_per_token is not None:
            options.append(tokens * self.compute_s_per_token)
        return min(options) if options else tokens * DEFAULT_MISS_S_PER_TOKEN


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    """What one replica publishes for routing (`record_routing_stats`): compact, seconds old."""

    tiers: Mapping[Tier, KeyFilter] = field(default_factory=dict)  # the chunk keys each local tier holds
    conversations: KeyFilter = EMPTY  # the conversations its KV tree served lately
    queue: int = 0  # requests it holds now (queued, prompt, decoding)
    speeds: Speeds = field(default_factory=Speeds)  # its measured speeds and backlog
    gauges: Mapping[str, float] = field(default_factory=dict)  # its tiers', tree's and scheduler's gauges (metrics)

    def to_dict(self) -> dict[str, object]:
        """Plain types for Ray Serve's routing stats (a dict it passes to the router)."""
        sp = self.speeds
        return {"tiers": {t.value: (f.bits, f.k) for t, f in self.tiers.items()},
                "conversations": (self.conversations.bits, self.conversations.k), "queue": self.queue,
                "speeds": {"read": {t.value: r for t, r in sp.read.items()}, "compute": sp.compute_s_per_token,
                           "pass": sp.pass_s, "backlog": sp.backlog_s},
                "gauges": dict(self.gauges)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ReplicaSummary:
        """Read `to_dict`'s form back; a replica that has published nothing yet holds nothing."""
        if not d:
            return cls()
        tiers = {Tier(t): KeyFilter(bits, k) for t, (bits, k) in d.get("tiers", {}).items()}
        bits, k = d.get("conversations", (b"", 1))
        sp = d.get("speeds") or {}
        speeds = Speeds({Tier(t): (float(a), float(b)) for t, (a, b) in (sp.get("read") or {}).items()},
                        sp.get("compute"), sp.get("pass"), float(sp.get("backlog") or 0.0))
        return cls(tiers, KeyFilter(bits, k), int(d.get("queue", 0)), speeds,
                   {str(n): float(v) for n, v in (d.get("gauges") or {}).items()})


@dataclass(frozen=True, slots=True)
class RouteKeys:
    """What a request asks of a replica's caches: known after retrieval, before routing."""

    chunks: tuple[KeyHex, ...] = ()  # the retrieved chunks' KV keys, best first
    conversation: ConversationId | None = None  # the agent conversation it continues; None = none
    # the replica (Ray Serve's unique id) that answered its conversation last (`ConversationPins`):
    # ranked first while it is a candidate within the slack; None = none known
    pinned: str | None = None
    tokens: tuple[int, ...] = ()  # each chunk's tokens (as `chunks`); empty = DEFAULT_CHUNK_TOKENS each

    def tokens_of(self, i: int) -> int:
        return self.tokens[i] if i < len(self.tokens) else DEFAULT_CHUNK_TOKENS

    @property
    def placement(self) -> str | None:
        """The key the request is placed by (`home_weight`): its best-ranked chunk's, the one
        chunk every question it best matches shares (a question's other chunks vary more:
        on the cluster bench's topics 35-43% of them come from another document), else its
        conversation. Replayed on that bench's workload (`python -m bench.routing_replay`, 20
        held-out seeds), it keeps more in the fast tiers than placement by the document most
        chunks come from (2.20x pow2's hits against 2.07x), and as much as a min-hash of the
        chunk keys (2.25x)."""
        return self.chunks[0] if self.chunks else self.conversation


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

    @property
    def pass_s(self) -> float:
        return self.summary.speeds.pass_s or DEFAULT_PASS_S

    def backlog_s(self) -> float:
        """Seconds of prompt work ahead of a request sent here now: the backlog it published,
        plus a pass for each request queued there since (Ray's live count against the summary's)."""
        return self.summary.speeds.backlog_s + max(0, self.queue - self.summary.queue) * self.pass_s


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


def expected_ttft(view: ReplicaView, keys: RouteKeys, pooled: frozenset[str] = frozenset()) -> float:
    """Seconds until a request with `keys` would have its KV ready on `view` and its turn
    come: the replica's backlog, plus each chunk's load from where it holds it (a peer's copy
    when another replica holds it, `pooled`; else its shared-tier read or compute), by the
    replica's measured speeds, plus a pass where its KV tree lacks the conversation the request
    continues (its earlier turns are computed again)."""
    speeds = view.summary.speeds

    def tier_of(key: str) -> Tier | None:
        tier = view.tier_of(key)
        return Tier.PEER if tier is None and key in pooled else tier

    load_s = sum(speeds.chunk_s(tier_of(key), keys.tokens_of(i)) for i, key in enumerate(keys.chunks))
    conversation_s = 0.0  # a replica whose KV tree lacks the conversation computes its earlier turns again
    if keys.conversation is not None and not (keys.pinned == view.replica_id or view.holds_conversation(keys.conversation)):
        conversation_s = view.pass_s
    return view.backlog_s() + load_s + conversation_s


def home_weight(replica_id: str, placement: str) -> int:
    """Rendezvous (highest-random-weight) hashing: the replica with the highest weight for a
    placement key is its home, the next its second home, and so on; a replica joining or
    leaving moves only the keys it wins or held."""
    return int.from_bytes(hashlib.sha256(f"{replica_id}\0{placement}".encode()).digest()[:8], "big")


class Reason(str, enum.Enum):
    """Why the router chose the replica it ranked first (`ragkv_route_decisions_total`)."""

    PINNED = "pinned"  # the replica that answered the conversation last
    HELD = "held"  # it holds more of the request (chunks in faster tiers, or the conversation) than some other
    HOME = "home"  # nobody holds more: the request's rendezvous home, which warms its chunks
    OVERFLOW = "overflow"  # a replica holding more, or the home, was too busy: the next in the request's
    # rendezvous order serves it (and so warms a second copy of a hot chunk set)
    BALANCED = "balanced"  # nothing to place by (no chunks, no conversation): the soonest free
    POW2 = "pow2"  # the pow2 policy


@dataclass(frozen=True, slots=True)
class Ranking:
    """The replicas in the order to try them, best first, and why the first is first."""

    replicas: list[ReplicaView]
    reason: Reason


def pooled_keys(views: Sequence[ReplicaView], keys: RouteKeys) -> frozenset[str]:
    """The request's chunks some replica holds in its host tier (GPU or CPU): with the peer tier on,
    every other replica can read them from it."""
    return frozenset(k for k in keys.chunks if any(v.tier_of(k) in (Tier.GPU, Tier.CPU) for v in views))


def route(views: Sequence[ReplicaView], keys: RouteKeys, policy: Policy, *, slack: float = ROUTE_SLACK,
          rng: random.Random | None = None, peers: bool = False) -> Ranking:
    """Rank the replicas for a request (see the module docstring).

    CHUNK: each replica's expected time to first token (`expected_ttft`: its backlog plus its
    chunk loads) prices locality and load in one number of seconds. The replicas expected within
    `slack` prompt passes (the replicas' median `pass_s`) of the soonest are as soon as each
    other; among them the pinned replica (`keys.pinned`) goes first, then the one holding most of
    the request (`chunk_score`), then by the request's rendezvous order (`home_weight` of its
    `placement` key), so a chunk set nobody holds goes to its home, and a hot one whose home is
    busy to its second home. The replicas beyond the slack follow, soonest first.
    POW2: two replicas drawn at random, the shorter queue first, then the rest.
    `peers`: the replicas read each other's host tiers (`kvstore.tiers.peer`): a chunk another
    replica holds is priced as a peer read, not as a miss, so a busy holder's load spreads sooner.

    Raises:
        ValueError: No replica to rank, or `slack` negative.
    """
    if not views:
        raise ValueError("no replica to route to")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack!r}")
    rng = rng or random.Random()
    if policy is Policy.POW2:
        return Ranking(_pow2(views, rng), Reason.POW2)
    pooled = pooled_keys(views, keys) if peers else frozenset()
    est = {v.replica_id: expected_ttft(v, keys, pooled) for v in views}
    unit = statistics.median(v.pass_s for v in views)
    bound = min(est.values()) + slack * unit
    within = [v for v in views if est[v.replica_id] <= bound]
    beyond = sorted((v for v in views if est[v.replica_id] > bound), key=lambda v: est[v.replica_id])
    pinned = next((v for v in within if keys.pinned is not None and v.replica_id == keys.pinned), None)
    if pinned is not None:  # alive (a candidate) and not overloaded: its tree holds the conversation
        others = [v for v in views if v is not pinned]
        rest = route(others, dataclasses.replace(keys, pinned=None), policy, slack=slack, rng=rng, peers=peers).replicas \
            if others else []
        return Ranking([pinned, *rest], Reason.PINNED)
    placement = keys.placement
    if placement is None:  # nothing to place by: the soonest, power of two among equals
        return Ranking(_pow2(within, rng) + beyond, Reason.BALANCED)
    scores = {v.replica_id: chunk_score(v, keys) for v in views}
    homes = {v.replica_id: home_weight(v.replica_id, placement) for v in views}
    ranked = sorted(within, key=lambda v: (-scores[v.replica_id], -homes[v.replica_id], est[v.replica_id])) + beyond
    first = ranked[0]
    if scores[first.replica_id] > min(scores.values()):
        reason = Reason.HELD
    elif scores[first.replica_id] == max(scores.values()) and homes[first.replica_id] == max(homes.values()):
        reason = Reason.HOME
    else:
        reason = Reason.OVERFLOW
    return Ranking(ranked, reason)


def rank(views: Sequence[ReplicaView], keys: RouteKeys, policy: Policy, *, slack: float = ROUTE_SLACK,
         rng: random.Random | None = None) -> list[ReplicaView]:
    """`route`'s replicas, best first."""
    return route(views, keys, policy, slack=slack, rng=rng).replicas


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


class RouterViews:
    """What this process's routers decided and believe, for the ingress's metrics: decisions by
    `Reason` (counted where made: per choice, so a request retried elsewhere counts again) and
    each replica's last published gauges. Ray Serve builds the routers inside the process that
    holds the engines' handle (the ingress), with no way to hand them an object: they find
    this one (`ROUTER_VIEWS`), through this module (a module travels to Ray's processes by
    name; an object with a lock would not)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.decisions: dict[Reason, int] = {}
        self.routers: weakref.WeakSet[Any] = weakref.WeakSet()  # server/cluster.py's ChunkRouters (a redeploy's go)

    def decided(self, reason: Reason) -> None:
        with self._lock:
            self.decisions[reason] = self.decisions.get(reason, 0) + 1

    def read(self) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
        """(decisions by reason, each replica's gauges by name, as its router's view holds them)."""
        with self._lock:
            decisions = {r.value: n for r, n in self.decisions.items()}
        replicas = {v.replica_id: {**v.summary.gauges, "queue": float(v.queue), "expected_backlog_seconds": v.backlog_s()}
                    for router in list(self.routers) for v in router.views()}
        return decisions, replicas


ROUTER_VIEWS = RouterViews()


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
