"""Two replicas' pipelines over one index, pooled through the peer tier (in-process directory and
object store; the same tier on Ray: tests/server/test_peer_ray.py). Replica B has no KV of its own
(an empty disk tier): it reads what replica A read from its disk, from A's published copy, and
answers as a replica that computed every chunk from scratch."""

from __future__ import annotations

from pathlib import Path

from ragkv.client import RagClient
from ragkv.kvstore import PeerDirectory, PeerTier
from ragkv.server.settings import CollectionSpec
from ragkv.types import Mode, Tier
from tests.kvstore.test_peer import Cluster
from tests.server.fakes import ServerThread, settings
from tests.server.test_pipeline import QUESTION, tiny_index  # noqa: F401 - the session fixture


def _replica(index: Path, name: str | None, directory: PeerDirectory, cluster: Cluster, disk: Path | None):
    """A one-process server standing for a replica: its pipeline, with a peer tier unless `name` is None."""
    from ragkv.server.assembly import build_pipeline

    made = []

    def factory(s):
        pipeline = build_pipeline(s)
        if name is not None:
            for store in pipeline.stores():
                store.attach(PeerTier(name, directory, cluster.objects(name), store.model_fp, store.tokenizer_fp,
                                      64 << 20, store.compression))
        made.append(pipeline)
        return pipeline

    server = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_disk_dir=disk), factory)
    return server, made[0]


def _ask(server: ServerThread):
    with RagClient(server.addr, timeout=60) as client:
        stream = client.query(QUESTION, mode=Mode.REUSE, top_k=3, max_new_tokens=8)
        chunks = stream.chunks
        return [c.kv_tier for c in chunks], stream.result()


def test_a_replica_without_the_kv_reads_its_peers_copy_and_answers_as_from_scratch(
        tiny_index: Path, tmp_path: Path) -> None:  # noqa: F811 - the fixture
    directory, cluster = PeerDirectory(), Cluster()
    a, pa = _replica(tiny_index, "a", directory, cluster, None)
    b, pb = _replica(tiny_index, "b", directory, cluster, tmp_path / "b-disk")
    scratch, _ = _replica(tiny_index, None, directory, cluster, tmp_path / "scratch-disk")
    try:
        tiers_a, answer_a = _ask(a)
        assert set(tiers_a) == {Tier.DISK}
        for store in pa.stores():
            assert store.tier(Tier.PEER).flush()
        tiers_b, answer_b = _ask(b)
        tiers_s, answer_s = _ask(scratch)
        again_a, answer_a2 = _ask(a)  # its host tier's KV, now in the published objects' memory
    finally:
        for server in (a, b, scratch):
            server.stop()
    assert again_a == [Tier.CPU] * 3 and answer_a2.text == answer_a.text
    held = pa.peer_counters()
    assert held["host_tier_shared_bytes"] == held["host_tier_bytes"] > 0  # one copy of each chunk on A's host
    assert tiers_b == [Tier.PEER] * 3 and set(tiers_s) == {Tier.COMPUTED}
    assert answer_b.text == answer_s.text == answer_a.text
    counters = pb.peer_counters()
    assert counters["peer_reads"] == 3 and counters["peer_read_bytes"] > 0 and counters["peer_errors"] == 0
    assert pa.peer_counters()["peer_published_bytes"] > 0
