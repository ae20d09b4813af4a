"""The routing replay's own arithmetic, on a toy workload: no index, no Ray."""

from __future__ import annotations

import random

import pytest

from bench.routing_replay import Published, _Hit, _Placed, main, replay


def _workload(n: int = 300, topics: int = 8, seed: int = 0) -> list[tuple[str, list[_Hit]]]:
    """`n` requests over `topics` topics of three 10-token chunks, the first a bit more popular
    than the next; each request's chunks in a random order."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = rng.choices(range(topics), [1 / (r + 1) for r in range(topics)])[0]
        chunks = [_Hit(f"t{t}c{j}", f"d{t}", 10) for j in range(3)]
        rng.shuffle(chunks)
        out.append(("ask", chunks))
    return out


def test_chunk_routing_keeps_more_in_the_tiers_than_pow2_and_every_read_is_a_load() -> None:
    requests = _workload()
    pow2, pow2_loads, _ = replay(requests, 4, 60, None, seed=1)  # each tier holds two topics
    best, best_loads, _ = replay(requests, 4, 60, "best", seed=1)
    assert len(pow2_loads) == len(best_loads) == 3 * len(requests)
    assert best > 1.5 * pow2  # a topic's requests meet its chunks where they are


def test_with_peers_a_chunk_another_replica_holds_counts_and_pow2_gains_most() -> None:
    requests = _workload()
    pow2, _, same = replay(requests, 4, 60, None, seed=1)
    assert same == pow2  # without peers, local is all there is
    _, _, pow2_peers = replay(requests, 4, 60, None, seed=1, peers=True)
    best, _, _ = replay(requests, 4, 60, "best", seed=1)
    _, _, best_peers = replay(requests, 4, 60, "best", seed=1, peers=True)
    assert pow2_peers > 1.5 * pow2  # pow2 scatters topics: their chunks are mostly on another replica
    assert best_peers >= best and best_peers > pow2
    one_topic = [("ask", [_Hit("a", "d", 10)])] * 3
    assert replay(one_topic, 2, 60, None, seed=0, peers=True)[2] == pytest.approx(2 / 3)  # read once, then held
    # read through, a chunk read from a peer stays one copy: a reader's own tier keeps only its own
    two = [("ask", [_Hit(k, "d", 10)]) for k in ("a", "b", "a", "b", "a", "b")]
    kept = replay(two, 2, 10, None, seed=3, peers=True, keep_peer_reads=True)[2]
    through = replay(two, 2, 10, None, seed=3, peers=True)[2]
    assert through >= kept


def test_what_a_replica_published_is_withdrawn_as_its_policy_says_and_a_peer_finds_only_that() -> None:
    lru, fifo = Published(20, "lru"), Published(20, "fifo")
    for p in (lru, fifo):
        p.offer("a", 10)
        p.offer("b", 10)
        p.offer("a", 10)  # read again by its own replica
        p.offer("c", 10)
    assert list(lru.held) == ["a", "c"] and list(fifo.held) == ["b", "c"]
    seq = [("ask", [_Hit(k, "d", 10)]) for k in ("x", "y", "z", "w")]
    with pytest.raises(ValueError, match="published must be one of holder, lru, fifo"):
        replay(seq, 2, 20, None, seed=0, peers=True, published="random")
    # a peer finds only what the holder published (not its tier, nor kept by the peer's read)
    requests = _workload()
    rates = {pub: replay(requests, 4, 60, None, seed=1, peers=True, published=pub)[2] for pub in ("holder", "lru", "fifo")}
    assert rates["holder"] >= rates["lru"] >= rates["fifo"] and rates["holder"] > rates["fifo"]


def test_the_host_memory_a_replica_takes_counts_a_published_chunk_its_tier_holds_once() -> None:
    # one replica reads a, b, c (its tier holds two: b, c); it published all three, within 30 tokens
    seq = [("ask", [_Hit(k, "d", 10)]) for k in ("a", "b", "c")]
    used: list[float] = []
    replay(seq, 1, 20, "best", seed=0, peers=True, published="lru", published_tokens=30, memory=used)
    assert used[-1] == pytest.approx(30 / 20)  # a (published only), b and c (both, one copy)
    used.clear()
    replay(_workload(), 4, 60, "best", seed=1, peers=True, published="lru", memory=used)
    assert max(used) <= 1.0  # the same budget, the same reads: what is published is what the tier holds


def test_placement_keys_compared() -> None:
    chunks = ("k3", "k1", "k2")
    assert _Placed(chunks, by="best").placement == "k3"
    assert _Placed(chunks, by="least").placement == "k1"
    assert _Placed(chunks, by="document", documents=("b", "a", "a")).placement == "doc\0a"


def test_unknown_placement_is_refused_by_name(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--placement", "best,nearest"])
    assert "unknown ['nearest']" in capsys.readouterr().err
