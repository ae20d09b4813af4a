"""The cluster's routing, as pure functions (server/routing.py): Bloom filters of chunk keys,
the tier-weighted chunk score, conversation affinity, the expected time to first token that
prices load and locality in seconds, rendezvous placement of chunk sets, power-of-two."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import Counter

import pytest

from ragkv.kvstore.key_filter import EMPTY, KeyFilter
from ragkv.server.routing import (
    AFFINITY_BONUS,
    DEFAULT_PASS_S,
    SETTLE_S,
    TIER_WEIGHTS,
    ConversationPins,
    Policy,
    Reason,
    ReplicaSummary,
    ReplicaView,
    RouteKeys,
    Speeds,
    chunk_score,
    conversation_id,
    expected_ttft,
    home_weight,
    note_routed,
    pooled_keys,
    rank,
    route,
)
from ragkv.types import Tier


def _key(i: int) -> str:
    return hashlib.sha256(f"chunk {i}".encode()).hexdigest()


def _view(name: str, queue: int = 0, **tiers: list[int]) -> ReplicaView:
    summary = ReplicaSummary({Tier(t): KeyFilter.of(_key(i) for i in ids) for t, ids in tiers.items()})
    return ReplicaView(name, summary, queue=queue)


def test_a_key_filter_holds_every_key_and_few_others() -> None:
    held = [_key(i) for i in range(2000)]
    f = KeyFilter.of(held, fp_rate=0.01)
    assert all(k in f for k in held)  # no false negatives
    false_positives = sum(_key(i) in f for i in range(2000, 22000))
    assert false_positives / 20000 < 0.03
    assert f.nbytes < 2000 * 2  # about 1.2 bytes per key at 1%: compact, not a key list
    assert "conversation-1" in KeyFilter.of(["conversation-1"])  # any string, hashed first


def test_an_empty_filter_holds_nothing_and_a_bad_rate_is_refused() -> None:
    assert _key(1) not in KeyFilter.of([])
    with pytest.raises(ValueError, match="fp_rate"):
        KeyFilter.of([_key(1)], fp_rate=1.5)


def test_the_summary_survives_ray_serves_plain_dict() -> None:
    s = ReplicaSummary({Tier.CPU: KeyFilter.of([_key(1)]), Tier.DISK: KeyFilter.of([_key(2)])},
                       KeyFilter.of(["c1"]), queue=3,
                       speeds=Speeds({Tier.DISK: (0.01, 2e-5), Tier.S3: (0.2, 1e-4)}, 3e-4, 0.7, 2.5),
                       gauges={"kv_tree_bytes": 1024.0, "tier_chunks_cpu": 12.0})
    back = ReplicaSummary.from_dict(s.to_dict())
    assert back == s
    assert ReplicaSummary.from_dict(None) == ReplicaSummary()


def test_the_score_weighs_each_chunk_by_the_fastest_tier_holding_it() -> None:
    view = _view("a", gpu=[0], cpu=[0, 1], disk=[2])
    keys = RouteKeys((_key(0), _key(1), _key(2), _key(3)))
    expected = (TIER_WEIGHTS[Tier.GPU] + TIER_WEIGHTS[Tier.CPU] + TIER_WEIGHTS[Tier.DISK]) / 4
    assert chunk_score(view, keys) == pytest.approx(expected)
    assert chunk_score(_view("b"), keys) == 0.0
    assert TIER_WEIGHTS[Tier.GPU] > TIER_WEIGHTS[Tier.CPU] > TIER_WEIGHTS[Tier.DISK] > 0
    assert Tier.S3 not in TIER_WEIGHTS  # S3 is everyone's


def test_chunk_routing_picks_the_replica_holding_the_chunks_in_its_fastest_tiers() -> None:
    keys = RouteKeys(tuple(_key(i) for i in range(4)))
    views = [_view("disk", disk=[0, 1, 2, 3]), _view("cpu", cpu=[0, 1, 2, 3]), _view("none")]
    assert [v.replica_id for v in rank(views, keys, Policy.CHUNK)] == ["cpu", "disk", "none"]


def test_a_conversation_goes_back_to_its_replica_over_chunk_locality() -> None:
    conv = conversation_id("docs", "What is the secret number?")
    views = [_view("chunks", gpu=[0, 1]), _view("tree")]
    views[1].summary = ReplicaSummary(conversations=KeyFilter.of([conv]))
    keys = RouteKeys((_key(0), _key(1)), conv)
    assert rank(views, keys, Policy.CHUNK)[0].replica_id == "tree"
    assert chunk_score(views[1], keys) == AFFINITY_BONUS


def test_an_overloaded_replica_is_passed_over_whatever_it_holds() -> None:
    keys = RouteKeys((_key(0),))
    views = [_view("busy", queue=9, gpu=[0]), _view("idle", queue=0), _view("idle2", queue=3)]
    ranked = rank(views, keys, Policy.CHUNK, rng=random.Random(0))
    # 9 passes of backlog against none: beyond a slack of one pass, ranked after the soonest
    assert [v.replica_id for v in ranked] == ["idle", "idle2", "busy"]
    # within a slack that wide, locality wins over a shorter queue
    assert rank(views, keys, Policy.CHUNK, slack=10)[0].replica_id == "busy"


def test_the_expected_time_to_first_token_is_the_backlog_plus_each_chunks_load_by_measured_speeds() -> None:
    keys = RouteKeys((_key(0), _key(1)), tokens=(100, 300))
    slow_disk = Speeds({Tier.DISK: (0.5, 1e-3)}, compute_s_per_token=1e-2, pass_s=0.4, backlog_s=1.0)
    view = ReplicaView("a", ReplicaSummary({Tier.DISK: KeyFilter.of([_key(0)])}, speeds=slow_disk), queue=2)
    # chunk 0 from its disk (0.5 + 100 ms), chunk 1 from nowhere: computed (300 x 10 ms); the
    # summary's backlog plus a pass for each of the 2 requests routed since it
    assert expected_ttft(view, keys) == pytest.approx(1.0 + 2 * 0.4 + (0.5 + 0.1) + 3.0)
    # a read slower than computing is priced as the compute the loading controller would choose
    assert Speeds({Tier.DISK: (9.0, 0.0)}, 1e-3).chunk_s(Tier.DISK, 100) == pytest.approx(0.1)
    # S3 is read when no tier of the replica's own holds the chunk and it beats a compute
    assert Speeds({Tier.S3: (0.05, 1e-4)}, 1e-3).chunk_s(None, 100) == pytest.approx(0.06)


def test_a_replica_whose_reads_are_slow_loses_to_one_that_computes_sooner_by_more_than_the_slack() -> None:
    """Holding a chunk is worth what it saves in seconds: a disk read slower than another
    replica's compute plus its slack does not win the request."""
    keys = RouteKeys((_key(0),), tokens=(512,))
    slow = ReplicaView("slow", ReplicaSummary({Tier.DISK: KeyFilter.of([_key(0)])},
                                              speeds=Speeds({Tier.DISK: (5.0, 0.0)}, None, 0.2)))
    fast = ReplicaView("fast", ReplicaSummary(speeds=Speeds({}, 1e-4, 0.2)))
    assert route([slow, fast], keys, Policy.CHUNK).replicas[0].replica_id == "fast"
    slow.summary = dataclasses.replace(slow.summary, speeds=Speeds({Tier.DISK: (0.1, 0.0)}, None, 0.2))
    ranking = route([slow, fast], keys, Policy.CHUNK)
    assert ranking.replicas[0].replica_id == "slow" and ranking.reason is Reason.HELD


def test_a_chunk_set_nobody_holds_goes_to_its_rendezvous_home_and_homes_spread_over_replicas() -> None:
    views = [_view(f"r{i}") for i in range(4)]
    firsts = Counter()
    for n in range(400):
        keys = RouteKeys((_key(4 * n), _key(4 * n + 1), _key(4 * n + 2)))
        ranking = route(views, keys, Policy.CHUNK, rng=random.Random(n))
        home = max(views, key=lambda v: home_weight(v.replica_id, keys.chunks[0]))
        assert ranking.replicas[0] is home and ranking.reason is Reason.HOME
        firsts[home.replica_id] += 1
    assert set(firsts) == {"r0", "r1", "r2", "r3"} and min(firsts.values()) > 60  # about 100 each


def test_questions_with_one_best_chunk_share_its_home_whatever_else_they_retrieve() -> None:
    """Placement by the best-ranked chunk: questions whose best match is one chunk go to its
    home whatever their other chunks (of its document or another), where a min-hash over
    their keys or the document most of them come from would often split them."""
    views = [_view(f"r{i}") for i in range(4)]
    homes = Counter()
    for doc in range(40):
        best = _key(100 * doc)
        for q in range(6):
            others = tuple(_key(100 * doc + 1 + (q + j) % 5) for j in range(2)) if q < 3 else \
                tuple(_key(99_000 + 10 * doc + q + j) for j in range(3))  # its document's, or others'
            keys = RouteKeys((best, *others))
            assert keys.placement == best
            homes[(doc, rank(views, keys, Policy.CHUNK)[0].replica_id)] += 1
    assert len(homes) == 40  # one home per best chunk
    assert len({replica for _, replica in homes}) == 4  # the homes spread over the replicas
    # without chunks, the conversation
    assert RouteKeys((), conversation_id("docs", "q")).placement == conversation_id("docs", "q")


def test_a_hot_set_whose_home_is_busy_overflows_to_its_second_home_and_only_there() -> None:
    keys = RouteKeys(tuple(_key(i) for i in range(4)))
    views = [_view(f"r{i}") for i in range(4)]
    order = sorted(views, key=lambda v: -home_weight(v.replica_id, keys.chunks[0]))
    home, second = order[0], order[1]
    home.summary = ReplicaSummary({Tier.CPU: KeyFilter.of(keys.chunks)}, speeds=Speeds(pass_s=0.5, backlog_s=3.0))
    for seed in range(10):  # the home holds the set but is 3 s behind: the second home, every time
        ranking = route(views, keys, Policy.CHUNK, rng=random.Random(seed))
        assert ranking.replicas[0] is second and ranking.reason is Reason.OVERFLOW
        assert ranking.replicas[-1] is home
    # the second home now holds a copy too (the router believes what it routed): it stays there
    note_routed(second, keys)
    second.queue = 0
    ranking = route(views, keys, Policy.CHUNK)
    assert ranking.replicas[0] is second and ranking.reason is Reason.HELD
    # once the home's backlog drains, the set's requests go home again
    home.summary = dataclasses.replace(home.summary, speeds=Speeds(pass_s=0.5))
    assert {route(views, keys, Policy.CHUNK).replicas[0].replica_id for _ in range(5)} <= \
        {home.replica_id, second.replica_id}


def test_the_live_queue_counts_beyond_the_published_backlog() -> None:
    """Summaries are a second old: requests Ray counts in a replica's queue past the summary's
    each add a pass to its expected backlog, so a burst does not pile onto one replica."""
    keys = RouteKeys((_key(0),))
    a = ReplicaView("a", ReplicaSummary(queue=1, speeds=Speeds(pass_s=0.5, backlog_s=0.5)), queue=1)
    assert a.backlog_s() == pytest.approx(0.5)
    a.queue = 5
    assert a.backlog_s() == pytest.approx(0.5 + 4 * 0.5)
    assert ReplicaView("cold").backlog_s() == 0.0 and ReplicaView("cold").pass_s == DEFAULT_PASS_S
    b = _view("b")
    assert rank([a, b], keys, Policy.CHUNK)[0] is b


def test_pow2_ignores_what_replicas_hold_and_prefers_the_shorter_queue() -> None:
    views = [_view("holds", queue=3, gpu=[0]), _view("empty", queue=1)]
    for seed in range(5):
        assert rank(views, RouteKeys((_key(0),)), Policy.POW2, rng=random.Random(seed))[0].replica_id == "empty"


def test_what_the_router_routed_counts_until_a_summary_that_holds_it() -> None:
    keys = RouteKeys((_key(7), _key(8)), conversation_id("docs", "q"))
    a, b = _view("a"), _view("b")
    note_routed(b, keys, now=100.0)
    assert b.queue == 1
    assert b.tier_of(_key(7)) is Tier.CPU
    assert rank([a, b], keys, Policy.CHUNK)[0].replica_id == "b"
    # a summary published before the request settled there (it crossed the routing) keeps the belief
    b.absorb(ReplicaSummary(), published_at=100.0 + SETTLE_S / 2)
    assert b.holds_conversation(keys.conversation) and b.tier_of(_key(7)) is Tier.CPU
    # one published after it: the replica's own word replaces it (here: the chunks were evicted)
    b.absorb(ReplicaSummary(conversations=KeyFilter.of([keys.conversation])), published_at=100.0 + 2 * SETTLE_S)
    assert b.tier_of(_key(7)) is None and b.holds_conversation(keys.conversation)
    # an older summary arriving late changes nothing
    b.absorb(ReplicaSummary(), published_at=50.0)
    assert b.holds_conversation(keys.conversation)


def test_a_conversation_is_named_by_what_every_call_repeats() -> None:
    one = conversation_id("docs", "first question", "system")
    assert one == conversation_id("docs", "first question", "system")
    assert one != conversation_id("docs", "another question", "system")
    assert one != conversation_id("other", "first question", "system")


def test_ranking_refuses_nothing_to_rank_and_a_negative_slack() -> None:
    with pytest.raises(ValueError, match="no replica"):
        rank([], RouteKeys(), Policy.CHUNK)
    with pytest.raises(ValueError, match="slack"):
        rank([_view("a")], RouteKeys(), Policy.CHUNK, slack=-1)


def test_replicas_holding_a_request_alike_are_chosen_by_its_home_not_by_order() -> None:
    views = [_view(f"r{i}", disk=list(range(60))) for i in range(3)]  # a disk every replica shares: it tells nothing
    firsts = Counter(rank(views, RouteKeys((_key(i),)), Policy.CHUNK)[0].replica_id for i in range(60))
    assert set(firsts) == {"r0", "r1", "r2"}


def test_without_chunks_or_a_conversation_it_is_power_of_two_among_the_soonest() -> None:
    rng = random.Random(1)
    views = [_view(f"r{i}", queue=q) for i, q in enumerate([0, 1, 1, 1])]
    firsts = Counter()
    for _ in range(300):
        ranking = route(views, RouteKeys(), Policy.CHUNK, slack=10, rng=rng)
        assert ranking.reason is Reason.BALANCED
        firsts[ranking.replicas[0].replica_id] += 1
    assert 0.35 < firsts["r0"] / 300 < 0.65  # r0 wins whenever it is drawn (half the draws)
    assert set(firsts) == {"r0", "r1", "r2", "r3"}


def test_a_pinned_replica_goes_first_while_alive_and_within_the_slack_else_routing_as_usual() -> None:
    """The replica that answered a conversation last (`RouteKeys.pinned`) beats chunk locality and
    the published affinity; dead (not a candidate) or overloaded, the request routes as any other."""
    conv = conversation_id("docs", "What is the secret number?")
    keys = RouteKeys((_key(0), _key(1)), conv)
    chunks, filtered, tree = _view("chunks", gpu=[0, 1]), _view("filtered"), _view("tree", queue=2)
    filtered.summary = ReplicaSummary(conversations=KeyFilter.of([conv]))  # a Bloom filter's false positive, say
    views = [chunks, filtered, tree]
    usual = [v.replica_id for v in rank(views, keys, Policy.CHUNK, rng=random.Random(0))]
    assert usual[0] == "filtered"
    pinned = RouteKeys(keys.chunks, conv, pinned="tree")
    for seed in range(5):
        ranked = [v.replica_id for v in rank(views, pinned, Policy.CHUNK, slack=2, rng=random.Random(seed))]
        assert ranked == ["tree", "filtered", "chunks"]  # the rest as they rank among themselves
    # its replica died (Ray no longer offers it): routing as usual
    assert [v.replica_id for v in rank([chunks, filtered], pinned, Policy.CHUNK)] == ["filtered", "chunks"]
    # overloaded past the slack: passed over as any replica is, ranked after those within it
    tree.queue = 9
    assert [v.replica_id for v in rank(views, pinned, Policy.CHUNK)][-1] == "tree"
    assert route(views, pinned, Policy.CHUNK).reason is not Reason.PINNED
    assert [v.replica_id for v in rank([tree], pinned, Policy.CHUNK)] == ["tree"]  # alone: still chosen


def test_conversation_pins_remember_the_last_replica_of_each_conversation_bounded() -> None:
    pins = ConversationPins(max_conversations=2)
    a, b, c = (conversation_id("docs", q) for q in ("a?", "b?", "c?"))
    assert pins.pin(RouteKeys((), a)) == RouteKeys((), a)  # none answered it yet
    pins.note(a, "r1")
    pins.note(b, "r2")
    pins.note(a, "r3")  # its last answer moved: the tree it left may be evicted, the new one holds it
    pins.note(None, "r1")  # no conversation: nothing to remember
    assert pins.pin(RouteKeys((), a)).pinned == "r3" and len(pins) == 2
    pins.note(c, "r1")  # over the bound: the conversation answered least recently (b) is forgotten
    assert pins.pin(RouteKeys((), b)).pinned is None and pins.pin(RouteKeys((), c)).pinned == "r1"
    assert pins.pin(RouteKeys()).pinned is None
    with pytest.raises(ValueError, match="max_conversations"):
        ConversationPins(0)


def test_with_peers_a_chunk_another_replica_holds_is_priced_between_local_and_missing() -> None:
    keys = RouteKeys(tuple(hashlib.sha256(str(i).encode()).hexdigest() for i in range(4)), tokens=(1000,) * 4)
    holder = ReplicaView("holder", ReplicaSummary({Tier.CPU: KeyFilter.of(keys.chunks)}, EMPTY))
    other = ReplicaView("other")
    pooled = pooled_keys([holder, other], keys)
    assert pooled == frozenset(keys.chunks)
    local, peer, missing = expected_ttft(holder, keys, pooled), expected_ttft(other, keys, pooled), \
        expected_ttft(other, keys)
    assert local < peer < missing


def test_with_peers_a_busy_holders_load_spreads_sooner() -> None:
    """The holder is 0.7 s behind: within a pass (0.5 s) of the others' misses (4 x 0.1 s), not of
    their peer reads (4 x 0.05 s), so with peers the request goes to a free replica that reads
    the holder's copies, and without them it waits for the holder."""
    keys = RouteKeys(tuple(hashlib.sha256(str(i).encode()).hexdigest() for i in range(4)), tokens=(1000,) * 4)
    holder = ReplicaView("holder", ReplicaSummary({Tier.CPU: KeyFilter.of(keys.chunks)}, EMPTY,
                                                  speeds=Speeds(backlog_s=0.7)))
    views = [holder, ReplicaView("b"), ReplicaView("c")]
    alone = route(views, keys, Policy.CHUNK, rng=random.Random(0))
    pooled = route(views, keys, Policy.CHUNK, rng=random.Random(0), peers=True)
    assert alone.replicas[0] is holder and alone.reason is Reason.HELD
    assert pooled.replicas[0] is not holder
