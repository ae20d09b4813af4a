"""The peer tier on Ray (kvstore/tiers/peer_ray.py): two simulated nodes (`ray.cluster_utils.Cluster`),
a replica on each. What one publishes the other reads across nodes, verified; a replica killed
after publishing leaves a miss, not a hang, and the directory stops naming its copies; a dead
replica is forgotten (what the router does when Ray Serve reports it)."""

from __future__ import annotations

import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install 'ragkv[ray]'")

from ray.cluster_utils import Cluster

MODEL_FP, TOKENIZER_FP = "model-a", "tok-a"


def _entry(seed: int, tokens: int = 16):  # -> KVEntry; built on the replicas too, so nothing here is imported by them
    import torch

    from ragkv.kvstore import ChunkKey, KVEntry, hash_prefix

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50_000, (tokens,), generator=g)  # [T]
    return KVEntry(key=ChunkKey.build(MODEL_FP, TOKENIZER_FP, [1, 2], ids.tolist()),
                   k=torch.randn(2, 2, tokens, 8, generator=g), v=torch.randn(2, 2, tokens, 8, generator=g),  # [L, Hkv, T, D]
                   token_ids=ids, positions=torch.arange(2, 2 + tokens), model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP,
                   prefix_hash=hash_prefix([1, 2]))


class Replica:
    """A replica's store: a host tier and the peer tier, over the cluster's directory."""

    def __init__(self, name: str, timeout_s: float = 2.0) -> None:
        from ragkv.kvstore import CpuTier, PeerTier, TieredStore
        from ragkv.kvstore.tiers.peer_ray import RayDirectory, RayObjects, find_directory

        self.peer = PeerTier(name, RayDirectory(find_directory(), timeout_s), RayObjects(), MODEL_FP, TOKENIZER_FP,
                             1 << 20, read_timeout_s=timeout_s)
        self.store = TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP)])
        self.store.attach(self.peer)

    def publish(self, seed: int, tokens: int = 16) -> bool:
        self.store.put(_entry(seed, tokens))  # computed here: into the host tier, and published
        return self.peer.flush()

    def held_in_the_object_store(self, seed: int, tokens: int) -> tuple[int, int, bool]:
        """(the host tier's shared bytes, the entry's bytes, whether its K and V lie inside the
        published object's memory in this node's object store)."""
        import numpy as np

        from ragkv.kvstore import Tier
        from ragkv.kvstore.tiers.peer_ray import RayObjects

        want = _entry(seed, tokens)
        host = self.store.tier(Tier.CPU)
        held = host.get(want.key)
        (copy,) = [c for c in self.peer.copies(want.key) if c.replica == self.peer.replica]
        view = RayObjects().view(copy.handle)
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data
        inside = all(start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + len(view)
                     for t in (held.k, held.v))
        return host.shared_bytes, want.nbytes, inside

    def read(self, seed: int, tokens: int = 16) -> tuple[str, bool] | None:
        import torch

        want = _entry(seed, tokens)
        hit = self.store.read(want.key)
        if hit is None:
            return None
        return hit.tier.value, bool(torch.equal(hit.entry.k, want.k) and torch.equal(hit.entry.v, want.v))

    def name_again(self, seed: int) -> bool:
        """Use a chunk it holds, with every announcement due: it names its copies to the directory again."""
        self.peer.reannounce_s = 0.0
        assert self.store.read(_entry(seed).key) is not None
        return self.peer.flush(timeout_s=10.0)

    def peer_reads(self) -> tuple[int, int]:
        st = self.peer.stats()
        return st.hits, st.errors

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def nodes():
    """A head node and a second node, each with its own object store."""
    if ray.is_initialized():
        ray.shutdown()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replicas cannot import tests/
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 4},
                                                        "object_store_memory": 80 << 20})
    c.add_node(num_cpus=1, resources={"node_b": 4}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    from ragkv.kvstore.tiers.peer_ray import directory_actor

    directory_actor()
    yield c
    ray.shutdown()
    c.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _replica(node: str, name: str, timeout_s: float = 2.0):
    return ray.remote(num_cpus=0, resources={node: 1})(Replica).remote(name, timeout_s)


def _directory():
    from ragkv.kvstore.tiers.peer_ray import RayDirectory, find_directory

    return RayDirectory(find_directory(), 5.0)


def test_a_chunk_published_on_one_node_is_read_verified_on_another(nodes) -> None:
    a, b = _replica("node_a", "a"), _replica("node_b", "b")
    assert ray.get(a.node.remote()) != ray.get(b.node.remote())
    assert ray.get(a.publish.remote(1))

    assert ray.get(b.read.remote(1)) == ("peer", True)
    assert ray.get(b.peer_reads.remote()) == (1, 0)
    assert ray.get(b.read.remote(1)) == ("peer", True)  # read through: the pool holds it once
    assert ray.get(b.peer_reads.remote()) == (2, 0)


def test_a_replicas_host_tier_holds_what_it_published_in_the_object_stores_shared_memory(nodes) -> None:
    """One copy on the host: 2048 tokens (256 KiB of K, past what Ray keeps in a process's own heap)
    go into the node's object store, and the host tier's entry views them there."""
    a, b = _replica("node_a", "g"), _replica("node_b", "h")
    assert ray.get(a.publish.remote(5, 2048))
    shared, nbytes, inside = ray.get(a.held_in_the_object_store.remote(5, 2048))
    assert shared == nbytes > 256 << 10 and inside
    assert ray.get(a.read.remote(5, 2048)) == ("cpu", True)  # the shared copy is the KV that was computed
    assert ray.get(b.read.remote(5, 2048)) == ("peer", True)


def test_a_copy_the_directory_lost_is_named_again_and_read_across_nodes(nodes) -> None:
    """The directory forgets a copy (its TTL, or a restart of its actor); the replica that still holds
    it names it again, in one call, with its object's reference intact: a peer reads it."""
    e, f = _replica("node_a", "e"), _replica("node_b", "f")
    assert ray.get(e.publish.remote(3))
    key = _entry(3).key.hex
    _directory().withdraw("e", [key])
    deadline = time.monotonic() + 5
    while _directory().lookup(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _directory().lookup(key)
    assert ray.get(e.name_again.remote(3), timeout=60)
    assert [x.replica for x in _directory().lookup(key)] == ["e"]
    assert ray.get(f.read.remote(3), timeout=60) == ("peer", True)


def test_a_replica_killed_after_publishing_is_a_miss_not_a_hang(nodes) -> None:
    c, d = _replica("node_a", "c"), _replica("node_b", "d", timeout_s=3.0)
    assert ray.get(c.publish.remote(2))
    key = _entry(2).key.hex
    assert [x.replica for x in _directory().lookup(key)] == ["c"]
    ray.kill(c)  # its objects go with it; the directory still names them

    t0 = time.perf_counter()
    assert ray.get(d.read.remote(2)) is None  # a miss: the request computes the chunk
    assert time.perf_counter() - t0 < 10.0
    assert ray.get(d.peer_reads.remote()) == (0, 1)
    deadline = time.monotonic() + 5
    while _directory().lookup(key) and time.monotonic() < deadline:  # the report is sent, not awaited
        time.sleep(0.05)
    assert _directory().lookup(key) == []


def test_the_router_forgets_a_dead_replicas_copies(nodes) -> None:
    pytest.importorskip("ray.serve")
    from ragkv.server.cluster import forget_peer

    e = _replica("node_a", "e")
    assert ray.get(e.publish.remote(3)) and ray.get(e.publish.remote(4))
    assert _directory().stats()["replicas"] >= 1
    forget_peer("e")  # ChunkRouter.on_replica_actor_died
    deadline = time.monotonic() + 5
    while any(_directory().lookup(_entry(s).key.hex) for s in (3, 4)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_directory().lookup(_entry(s).key.hex) == [] for s in (3, 4))
