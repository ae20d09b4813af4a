"""The cluster bench's workload replayed through the router, offline: no Ray, no engine.

    python -m bench.routing_replay --seeds 1-8 --placement best,least,document

`ragkv bench --replicas` measures routing on a live cluster: 20 minutes a run on 2 cores, and a
run's hit rate moves by a tenth with timing alone. This replays its workload (the same topics,
Zipf, agent loops and seeds: `cli/cluster_bench.py`) in a second per seed, to compare where
requests are placed on many seeds:

- each question is retrieved from the bench's index as the ingress retrieves it (its top-k
  chunks, best first, by the server's default search);
- it is routed by `route` (the chunk policy) over `--replicas` views whose CPU tiers are LRUs
  of the bench's size (`--cpu-share` of the corpus), published after every request, or by
  power of two choices (a replica drawn at random: the replicas are equally free here);
- the replica reads its chunks (`LRUTier`), which counts a hit where its tier held them; an
  agent loop's later calls go where its first did and read their chunks from the KV tree.

Per seed it prints power-of-two choices' fast-tier hit rate, the pooled bound (one tier the size
of all replicas', on the chunk policy's loads), and for each placement key the hit rate, its
ratio to pow2's, its share of the gain the pooled bound allows, and its share of the bound itself;
then the same with the peer tier (`kvstore.tiers.peer`): a chunk another replica's tier holds is a
hit too (a peer read), for the chunk policy routing with peers and for pow2. Then the means over the first
half of the seeds and the second: choose on one half, report the other.

What it leaves out, and the live bench has: load (no replica is ever busy, so nothing
overflows to a second home), stats a second old, and requests in flight at once. On seed 1
the live bench measured 0.374 with placement by document and 0.195 for pow2; this replay gives
0.384 and 0.209.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ragkv.cli.cluster_bench import LRUTier, _build_index, _topics, _workload, load_key, lru_hit_rate, plain_reads
from ragkv.kvstore.key_filter import EMPTY, KeyFilter
from ragkv.server.routing import Policy, ReplicaSummary, ReplicaView, RouteKeys, route
from ragkv.types import Tier

PLACEMENTS = ("best", "least", "document")


@dataclass(frozen=True, slots=True)
class _Hit:
    key: str  # the tier entry its load reads (`load_key`)
    doc: str  # its document
    tokens: int


@dataclass(frozen=True, slots=True)
class _Placed(RouteKeys):
    """RouteKeys placed by another key: `least` (a min-hash of its chunk keys) or `document`
    (the document most of its chunks come from), to compare with the router's own (`best`)."""

    by: str = "best"
    documents: tuple[str, ...] = ()

    @property
    def placement(self) -> str | None:
        if self.by == "least" and self.chunks:
            return min(self.chunks)
        if self.by == "document" and self.documents:
            counts = Counter(self.documents)
            return "doc\0" + max(self.documents, key=lambda d: counts[d])
        return RouteKeys.placement.fget(self)  # type: ignore[attr-defined]


def _requests(retriever, topics: list[list[str]], plain: tuple[bool, bool], seed: int, n: int,  # a Retriever
              agent_every: int, zipf: float, top_k: int) -> list[tuple[str, list[_Hit]]]:
    """The bench's work items for `seed`, each with its retrieved chunks (best first)."""
    from ragkv.server.pipeline import search_hits

    out = []
    for kind, question in _workload(topics, n, agent_every, zipf, seed):
        hits = search_hits(retriever, question, top_k, None, ())
        out.append((kind, [_Hit(load_key(h.chunk_id, plain[i > 0]), h.doc_id, len(h.token_ids))
                           for i, h in enumerate(hits)]))
    return out


PUBLISHED = ("holder", "lru", "fifo")  # what a peer finds (`replay`'s `published`)


class Published:
    """What one replica publishes to the peer tier, as `kvstore.tiers.peer.PeerTier` keeps it:
    every chunk its own tiers read, within `capacity_tokens`; "lru": a chunk it reads again is
    withdrawn last (the peer tier now), "fifo": the first published is the first withdrawn,
    however often it is read (the peer tier before). A peer's read of it changes nothing."""

    def __init__(self, capacity_tokens: int, policy: str) -> None:
        self.policy, self.capacity_tokens = policy, capacity_tokens
        self.held: OrderedDict[str, int] = OrderedDict()  # chunk -> tokens, first withdrawn first
        self._tokens = 0

    def offer(self, chunk: str, tokens: int) -> None:
        if chunk in self.held:
            if self.policy == "lru":
                self.held.move_to_end(chunk)
            return
        self.held[chunk] = tokens
        self._tokens += tokens
        while self._tokens > self.capacity_tokens and self.held:
            self._tokens -= self.held.popitem(last=False)[1]


def replay(requests: list[tuple[str, list[_Hit]]], replicas: int, capacity_tokens: int, placement: str | None,
           seed: int, peers: bool = False, keep_peer_reads: bool = False,
           published: str = "holder", published_tokens: int | None = None,
           memory: list[float] | None = None) -> tuple[float, list[tuple[str, int]], float]:
    """Route `requests` in order (placement None: power of two choices) over `replicas` LRU
    tiers; the fast-tier hit rate, the loads in order, and the local-plus-peer hit rate.
    With `peers` the replicas read each other's tiers (the peer tier, and routing that knows it):
    a chunk another replica's tier holds is a peer hit, read through as the peer tier does
    (`keep_peer_reads`: copied into the reader's tier too, as a read from disk is). Without,
    the last is the first. `published`: what a peer finds: "holder", the holder's own LRU tier,
    which the peer's read keeps (the bound); "lru" or "fifo", what the holder published, a copy
    of `published_tokens` (default: the tier's size) beside its tier (`Published`). `memory`, when
    given, gets after each request the most host memory a replica's chunk KV takes, in tiers' sizes,
    when the host tier holds what is published in the published copy's memory (`MemoryTier.share`):
    the chunks either holds, counted once."""
    if published not in PUBLISHED:
        raise ValueError(f"published must be one of {', '.join(PUBLISHED)}, got {published!r}")
    rng = random.Random(seed)
    tiers = [LRUTier(capacity_tokens) for _ in range(replicas)]
    shown = [Published(capacity_tokens if published_tokens is None else published_tokens, published)
             for _ in range(replicas)] if published != "holder" else None
    views = [ReplicaView(f"r{i}") for i in range(replicas)]
    hits, peer_hits, loads = 0, 0, []
    for _kind, chunks in requests:  # an agent loop's later calls read the KV tree: no loads
        if placement is None:
            i = rng.randrange(replicas)
        else:
            for view, tier in zip(views, tiers, strict=True):
                view.summary = ReplicaSummary({Tier.CPU: KeyFilter.of(tier.held)}, EMPTY)
            keys = _Placed(tuple(c.key for c in chunks), tokens=tuple(c.tokens for c in chunks), by=placement,
                           documents=tuple(c.doc for c in chunks))
            i = views.index(route(views, keys, Policy.CHUNK, rng=rng, peers=peers).replicas[0])
        found = tiers if shown is None else shown  # what a peer finds
        for c in chunks:
            holders = [j for j, t in enumerate(found) if peers and j != i and c.key in t.held]
            if not keep_peer_reads and holders and c.key not in tiers[i].held:  # read through, not kept here
                if shown is None:
                    tiers[holders[0]].read(c.key, c.tokens)  # the peer's copy was used: it stays
                peer_hits += 1
                loads.append((c.key, c.tokens))
                continue
            elsewhere = bool(holders)
            local = tiers[i].read(c.key, c.tokens)
            if shown is not None:
                shown[i].offer(c.key, c.tokens)  # what its own tiers read, it publishes (or uses again)
            hits += local
            peer_hits += local or elsewhere
            loads.append((c.key, c.tokens))
        if memory is not None:
            memory.append(max(sum({**t.held, **(shown[j].held if shown else {})}.values())
                              for j, t in enumerate(tiers)) / capacity_tokens)
    n = len(loads) or 1
    return hits / n, loads, peer_hits / n


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = map(int, text.split("-"))
        return list(range(lo, hi + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1-8", help="workload seeds: a range 1-8 or a list 1,3 (default 1-8)")
    p.add_argument("--placement", default=",".join(PLACEMENTS),
                   help=f"placement keys to compare, of {', '.join(PLACEMENTS)} (default all; best is the router's)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--cpu-share", type=float, default=0.125, help="one replica's CPU tier, share of the corpus")
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--topics", type=int, default=24)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--agent-every", type=int, default=5)
    p.add_argument("--index", type=Path, default=None, help="the cluster bench's index (default: built here, 2 min)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--published", choices=PUBLISHED, default="holder",
                   help="what a peer finds: holder = the holder's own LRU tier, which a peer's read keeps (the "
                        "bound); lru / fifo = what the holder published, withdrawn least recently used first "
                        "(the peer tier) or first published first (default holder)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    from ragkv.retriever.manifest import read_manifest
    from ragkv.retriever.search import Retriever
    from ragkv.server.settings import ServerSettings

    placements = [x.strip() for x in args.placement.split(",") if x.strip()]
    if unknown := set(placements) - set(PLACEMENTS):
        p.error(f"--placement: unknown {sorted(unknown)}; choose from {', '.join(PLACEMENTS)}")
    if args.replicas < 2 or not 0 < args.cpu_share <= 1:
        p.error("--replicas must be >= 2 and --cpu-share in (0, 1]")
    with tempfile.TemporaryDirectory(prefix="ragkv-replay-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, None, None, args.topics)
        topics, tokens = _topics(index)
        capacity = int(tokens * args.cpu_share)
        defaults, manifest = ServerSettings(), read_manifest(index)
        plain = plain_reads(manifest.neighbours if manifest else None, defaults.default_mode, defaults.focus_handover)
        with Retriever.open(index) as retriever:  # the embedder loads once, for every seed
            by_seed = {seed: _requests(retriever, topics, plain, seed, args.requests, args.agent_every, args.zipf,
                                       args.top_k) for seed in _seeds(args.seeds)}
        rows = []
        for seed, requests in by_seed.items():
            pow2, pow2_loads, _ = replay(requests, args.replicas, capacity, None, seed)
            pow2_pooled = lru_hit_rate(pow2_loads, capacity * args.replicas) or 0.0
            pow2_memory: list[float] = []
            _, _, pow2_peer = replay(requests, args.replicas, capacity, None, seed, peers=True,
                                     published=args.published, memory=pow2_memory)
            row: dict = {"seed": seed, "pow2": round(pow2, 3),
                         "pow2_with_peers": {"hit_rate": round(pow2_peer, 3), "pooled": pow2_pooled,
                                             "of_pooled": round(pow2_peer / pow2_pooled, 2) if pow2_pooled else None,
                                             "host_memory": round(max(pow2_memory, default=0.0), 3)},
                         "pow2_twice_the_tier": round(replay(requests, args.replicas, 2 * capacity, None, seed)[0], 3)}
            for placement in placements:
                rate, loads, _ = replay(requests, args.replicas, capacity, placement, seed)
                pooled = lru_hit_rate(loads, capacity * args.replicas) or 0.0
                used: list[float] = []
                _, _, with_peers = replay(requests, args.replicas, capacity, placement, seed, peers=True,
                                          published=args.published, memory=used)
                peer_pooled = pooled  # the bound of the same requests' loads
                row[placement] = {"hit_rate": round(rate, 3), "pooled": pooled, "over_pow2": round(rate / pow2, 2),
                                  "share_of_placement_gain": round((rate - pow2) / (pooled - pow2), 2)
                                  if pooled > pow2 else None,
                                  "of_pooled": round(rate / pooled, 2) if pooled else None,
                                  "with_peers": {"hit_rate": round(with_peers, 3), "pooled": peer_pooled,
                                                 "of_pooled": round(with_peers / peer_pooled, 2)
                                                 if peer_pooled else None,
                                                 "host_memory": round(max(used, default=0.0), 3)},
                                  # what a second copy's memory buys without peers: the tier twice as large
                                  "twice_the_tier": round(replay(requests, args.replicas, 2 * capacity, placement,
                                                                 seed)[0], 3)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    half = len(rows) // 2 or 1
    means = {}
    for name, part in (("first_half", rows[:half]), ("second_half", rows[half:])):
        if part:
            means[name] = {pl: {"over_pow2": round(statistics.mean(r[pl]["over_pow2"] for r in part), 2),
                                "share_of_placement_gain": round(statistics.mean(
                                    r[pl]["share_of_placement_gain"] or 0.0 for r in part), 2),
                                "of_pooled": round(statistics.mean(r[pl]["of_pooled"] or 0.0 for r in part), 2),
                                "with_peers_of_pooled": round(statistics.mean(
                                    r[pl]["with_peers"]["of_pooled"] or 0.0 for r in part), 2),
                                "hit_rate": round(statistics.mean(r[pl]["hit_rate"] for r in part), 3),
                                "with_peers_hit_rate": round(statistics.mean(
                                    r[pl]["with_peers"]["hit_rate"] for r in part), 3),
                                "with_peers_host_memory": round(max(r[pl]["with_peers"]["host_memory"] for r in part), 3),
                                "twice_the_tier_hit_rate": round(statistics.mean(r[pl]["twice_the_tier"] for r in part), 3)}
                           for pl in placements}
            means[name]["pow2_with_peers_of_pooled"] = round(statistics.mean(  # type: ignore[assignment]
                r["pow2_with_peers"]["of_pooled"] or 0.0 for r in part), 2)
    report = {"seeds": rows, "means": means,
              "config": {k: v for k, v in vars(args).items() if k not in ("json", "index")}}
    if args.json:
        print(json.dumps(report))
    else:
        for name, m in means.items():
            print(f"{name} ({', '.join(str(r['seed']) for r in (rows[:half] if name == 'first_half' else rows[half:]))}):")
            for pl, v in m.items():
                if not isinstance(v, dict):
                    print(f"  pow2 with peers: local-plus-peer hits {v:.2f} of the pooled bound")
                    continue
                print(f"  {pl:<9} hits over pow2 {v['over_pow2']:.2f}x, share of placement's gain "
                      f"{v['share_of_placement_gain']:.2f}, {v['of_pooled']:.2f} of the pooled bound; with peers "
                      f"{v['with_peers_of_pooled']:.2f} of it")
                print(f"            host memory: without peers {v['hit_rate']:.3f}; with peers {v['with_peers_hit_rate']:.3f} "
                      f"in at most {v['with_peers_host_memory']:.2f}x the tier (one copy); the tier twice as "
                      f"large, without peers {v['twice_the_tier_hit_rate']:.3f} (what two copies' memory buys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
