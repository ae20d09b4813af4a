"""The peer tier (kvstore/tiers/peer.py) with an in-process directory and object store: what
one replica computes another reads, verified; a lost, slow or damaged copy is a miss that
falls through to the next tier, and the directory stops naming it; what a replica publishes
stays within its budget, least recently used out first; the host tier holds what is published in
the object's memory, once. The same tier over Ray: tests/server/test_peer_ray.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from ragkv.kvstore import (
    CpuTier,
    DiskTier,
    KVEntry,
    PeerDirectory,
    PeerReadError,
    PeerTier,
    S3Settings,
    S3Tier,
    Tier,
    TieredStore,
)
from ragkv.kvstore.compression import Compression
from ragkv.kvstore.fileformat import encode
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, assert_same, make_entry


class Cluster:
    """Objects by handle, each owned by the replica that put it: a replica's objects die with it."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}
        self.owner: dict[int, str] = {}
        self.slow: set[int] = set()  # handles whose reads hang
        self.puts = 0

    def objects(self, replica: str) -> Objects:
        return Objects(self, replica)

    def kill(self, replica: str) -> None:
        for h in [h for h, r in self.owner.items() if r == replica]:
            del self.data[h], self.owner[h]


class Objects:
    def __init__(self, cluster: Cluster, replica: str) -> None:
        self.cluster, self.replica = cluster, replica

    def put(self, data: bytes) -> object:
        c = self.cluster
        c.puts += 1
        c.data[c.puts], c.owner[c.puts] = bytes(data), self.replica
        return c.puts

    def get(self, handle: object, timeout_s: float) -> bytes:
        c = self.cluster
        assert isinstance(handle, int)
        if handle in c.slow:
            time.sleep(timeout_s)
            raise PeerReadError(f"not read within {timeout_s}s")
        if handle not in c.data:
            raise PeerReadError("lost with its owner")
        return c.data[handle]

    def view(self, handle: object) -> memoryview | None:
        data = self.cluster.data.get(handle)  # type: ignore[call-overload]
        return None if data is None else memoryview(data)  # read-only: the object's own memory


def _store(name: str, directory: PeerDirectory, cluster: Cluster, *, budget: int = 1 << 20,
           timeout_s: float = 2.0, below: list | None = None) -> tuple[TieredStore, PeerTier]:
    peer = PeerTier(name, directory, cluster.objects(name), MODEL_FP, TOKENIZER_FP, budget, read_timeout_s=timeout_s)
    store = TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP), *(below or [])])
    store.attach(peer)
    return store, peer


def _publish(store: TieredStore, peer: PeerTier, entry: KVEntry) -> None:
    store.put(entry)  # a computed chunk: into the host tier, and published
    assert peer.flush(), "the publish never finished"


def test_a_chunk_computed_on_one_replica_is_read_by_another_verified_and_read_through() -> None:
    directory, cluster = PeerDirectory(), Cluster()
    a, peer_a = _store("a", directory, cluster)
    b, peer_b = _store("b", directory, cluster)
    entry = make_entry(1)
    _publish(a, peer_a, entry)

    assert b.where(entry.key) is Tier.PEER  # the loading controller prices it as a peer read
    hit = b.read(entry.key)
    assert hit is not None and hit.tier is Tier.PEER
    assert_same(hit.entry, entry)
    st = peer_b.stats()
    assert (st.hits, st.bytes_read) == (1, len(encode(entry)))
    assert not b.tier(Tier.CPU).contains(entry.key)  # read through: the pool holds it once
    assert peer_b.stats().entries == 0  # and b does not publish it again
    assert a.tier(Tier.CPU).contains(entry.key) and peer_a.stats().entries == 1


def test_a_replica_may_keep_what_it_reads_from_a_peer() -> None:
    directory, cluster = PeerDirectory(), Cluster()
    a, peer_a = _store("a", directory, cluster)
    peer_b = PeerTier("b", directory, cluster.objects("b"), MODEL_FP, TOKENIZER_FP, 1 << 20, keep_reads=True)
    b = TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP)])
    b.attach(peer_b)
    entry = make_entry(11)
    _publish(a, peer_a, entry)
    assert b.read(entry.key).tier is Tier.PEER
    again = b.read(entry.key)  # kept in b's host tier: not read from the peer again
    assert again is not None and again.tier is Tier.CPU and peer_b.stats().hits == 1


def test_the_peer_tier_is_asked_after_the_local_tiers_and_before_s3() -> None:
    store, _ = _store("a", PeerDirectory(), Cluster())
    assert [t.tier for t in store.tiers] == [Tier.CPU, Tier.PEER]
    with pytest.raises(ValueError, match="already"):
        store.attach(PeerTier("a2", PeerDirectory(), Cluster().objects("a2"), MODEL_FP, TOKENIZER_FP, 1 << 20))
    with pytest.raises(ValueError, match="model"):
        store.attach(PeerTier("x", PeerDirectory(), Cluster().objects("x"), "model-b", TOKENIZER_FP, 1 << 20))


def test_a_dead_peers_copy_is_a_miss_and_the_directory_stops_naming_it() -> None:
    directory, cluster = PeerDirectory(), Cluster()
    a, peer_a = _store("a", directory, cluster)
    b, peer_b = _store("b", directory, cluster)
    entry = make_entry(2)
    _publish(a, peer_a, entry)
    cluster.kill("a")

    assert b.read(entry.key) is None  # a miss: the request computes it
    assert peer_b.stats().errors == 1
    assert directory.lookup(entry.key.hex) == []


def test_a_read_past_its_deadline_is_a_miss_not_a_hang() -> None:
    directory, cluster = PeerDirectory(), Cluster()
    a, peer_a = _store("a", directory, cluster)
    b, _ = _store("b", directory, cluster, timeout_s=0.2)
    entry = make_entry(3)
    _publish(a, peer_a, entry)
    cluster.slow.update(cluster.data)

    t0 = time.perf_counter()
    assert b.read(entry.key) is None
    assert time.perf_counter() - t0 < 1.0


def test_damaged_bytes_are_refused_by_their_checksums_and_the_next_tier_serves(
        bucket: str, s3_settings: S3Settings) -> None:
    directory, cluster = PeerDirectory(), Cluster()
    a, peer_a = _store("a", directory, cluster)
    s3 = S3Tier(bucket, "", MODEL_FP, TOKENIZER_FP, s3_settings)
    b, peer_b = _store("b", directory, cluster, below=[s3])
    entry = make_entry(4)
    _publish(a, peer_a, entry)
    s3.put(entry)
    (handle,) = cluster.data
    damaged = bytearray(cluster.data[handle])
    damaged[-10] ^= 0xFF  # one bit of the last layer's values
    cluster.data[handle] = bytes(damaged)

    hit = b.read(entry.key)
    assert hit is not None and hit.tier is Tier.S3  # the peer's copy was refused; S3's served
    assert_same(hit.entry, entry)
    assert peer_b.stats().rejected == 1
    assert [c.replica for c in directory.lookup(entry.key.hex)] == ["b"]  # a's is gone; b published S3's


def test_what_s3_gives_is_published_as_its_verified_bytes(bucket: str, s3_settings: S3Settings) -> None:
    directory, cluster = PeerDirectory(), Cluster()
    s3 = S3Tier(bucket, "", MODEL_FP, TOKENIZER_FP, s3_settings)
    a, peer_a = _store("a", directory, cluster, below=[s3])
    b, _ = _store("b", directory, cluster)
    entry = make_entry(5)
    s3.put(entry)

    assert a.read(entry.key).tier is Tier.S3
    assert peer_a.flush()
    hit = b.read(entry.key)  # b has no S3 tier at all: only a's read of it
    assert hit is not None and hit.tier is Tier.PEER
    assert_same(hit.entry, entry)
    host = a.tier(Tier.CPU)  # a's host tier took S3's read before the peer tier published it: held once
    assert isinstance(host, CpuTier) and host.shared_bytes == entry.nbytes


def test_what_a_local_disk_gives_the_host_tier_is_published_too(tmp_path) -> None:
    directory, cluster = PeerDirectory(), Cluster()
    disk = DiskTier(str(tmp_path), MODEL_FP, TOKENIZER_FP)
    a, peer_a = _store("a", directory, cluster, below=[disk])
    b, _ = _store("b", directory, cluster)
    entry = make_entry(9)
    disk.put(entry)

    assert [t.tier for t in a.tiers] == [Tier.CPU, Tier.DISK, Tier.PEER]
    read = a.read(entry.key, layered=True)  # the serving path: promoted once the whole file has passed
    assert read.tier is Tier.DISK
    read.layers.wait_all(5)
    deadline = time.monotonic() + 5
    while peer_a.stats().entries == 0 and time.monotonic() < deadline:  # the promotion runs behind the read
        time.sleep(0.01)
    assert peer_a.flush() and peer_a.stats().entries == 1
    hit = b.read(entry.key)
    assert hit is not None and hit.tier is Tier.PEER
    assert_same(hit.entry, entry)


def test_what_a_replica_publishes_stays_in_its_budget_oldest_out_first() -> None:
    directory, cluster = PeerDirectory(), Cluster()
    entries = [make_entry(10 + i) for i in range(4)]
    size = len(encode(entries[0]))
    a, peer_a = _store("a", directory, cluster, budget=2 * size)
    for e in entries:
        _publish(a, peer_a, e)

    st = peer_a.stats()
    assert (st.entries, st.bytes_used, st.evictions) == (2, 2 * size, 2)
    assert [bool(directory.lookup(e.key.hex)) for e in entries] == [False, False, True, True]


def test_a_published_chunk_the_replica_uses_again_is_withdrawn_after_ones_it_did_not() -> None:
    """What goes first is what this replica used least recently (its host tier's hits count), not what
    it published first: a hot chunk stays published while colder ones come and go."""
    directory, cluster = PeerDirectory(), Cluster()
    hot, *cold = [make_entry(20 + i) for i in range(4)]
    size = len(encode(hot))
    a, peer_a = _store("a", directory, cluster, budget=2 * size)
    _publish(a, peer_a, hot)
    for e in cold:
        _publish(a, peer_a, e)
        hit = a.read(hot.key)  # the replica serves the hot chunk from its host tier again
        assert hit is not None and hit.tier is Tier.CPU
        assert peer_a.flush()
    assert directory.lookup(hot.key.hex), "the chunk this replica keeps using was withdrawn"
    assert [bool(directory.lookup(e.key.hex)) for e in cold] == [False, False, True]
    assert peer_a.stats().evictions == 2


def test_a_copy_the_replica_still_holds_is_named_again_before_the_directorys_ttl_drops_it() -> None:
    """The directory forgets a copy not named within its time-to-live; a replica names what it still
    publishes again as it goes on serving, so a chunk published once stays found for as long as it is
    held (before, every copy vanished from the directory 10 minutes after its first publish)."""
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731

    class Counting(PeerDirectory):
        renamed = 0

        def publish_many(self, replica: str, copies: list) -> None:
            self.renamed += 1
            super().publish_many(replica, copies)

    directory, cluster = Counting(ttl_s=600.0, clock=clock), Cluster()
    peer = PeerTier("a", directory, cluster.objects("a"), MODEL_FP, TOKENIZER_FP, 1 << 20, clock=clock,
                    reannounce_s=300.0)
    store = TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP)])
    store.attach(peer)
    old, used = make_entry(40), make_entry(41)
    _publish(store, peer, old)
    now[0] = 200.0
    _publish(store, peer, used)
    now[0] = 350.0  # `old` was named 350 s ago: the next hit names it again
    assert store.read(used.key) is not None and peer.flush()
    now[0] = 700.0  # past `old`'s first publish plus the TTL
    assert directory.lookup(old.key.hex), "a copy still held vanished from the directory at its TTL"
    assert directory.lookup(used.key.hex)
    assert directory.renamed == 1  # (`old`, once, in one call with whatever else was due)
    # every announcement due at once (reannounce_s 0): one pass names each copy once and ends
    peer.reannounce_s = 0.0
    before = directory.renamed
    assert store.read(used.key) is not None and peer.flush(timeout_s=5.0)
    assert directory.renamed == before + 1
    peer.reannounce_s = 300.0
    # a copy the replica withdrew is not named again
    peer.delete(old.key)
    now[0] = 1000.0
    assert store.read(used.key) is not None and peer.flush()
    assert not directory.lookup(old.key.hex) and directory.lookup(used.key.hex)


def test_publishing_runs_off_the_callers_thread() -> None:
    directory, cluster = PeerDirectory(), Cluster()
    gate = threading.Event()

    class Held(Objects):
        def put(self, data: bytes) -> object:
            gate.wait(5)
            return super().put(data)

    peer = PeerTier("a", directory, Held(cluster, "a"), MODEL_FP, TOKENIZER_FP, 1 << 20)
    store = TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP)])
    store.attach(peer)
    entry = make_entry(6)
    t0 = time.perf_counter()
    store.put(entry)
    assert time.perf_counter() - t0 < 1.0 and directory.lookup(entry.key.hex) == []
    gate.set()
    assert peer.flush() and len(directory.lookup(entry.key.hex)) == 1


def test_a_directory_that_cannot_answer_is_a_miss() -> None:
    class Down(PeerDirectory):
        def lookup(self, key: str) -> list:
            raise PeerReadError("no answer")

    cluster = Cluster()
    b, peer_b = _store("b", Down(), cluster)
    key = make_entry(7).key
    assert b.where(key) is None and b.read(key) is None
    assert peer_b.stats().errors >= 1


def test_the_directory_forgets_a_dead_replica_expires_old_copies_and_stays_bounded() -> None:
    now = [0.0]
    d = PeerDirectory(ttl_s=10.0, max_entries=3, clock=lambda: now[0])
    d.publish("k1", "a", 1, 100)
    now[0] = 1.0
    d.publish("k1", "b", 2, 100)
    d.publish("k2", "a", 3, 100)
    assert [c.replica for c in d.lookup("k1")] == ["b", "a"]  # newest first
    assert d.forget("a") == 2
    assert [c.replica for c in d.lookup("k1")] == ["b"] and d.lookup("k2") == []
    for i in range(5):
        d.publish(f"n{i}", "c", 10 + i, 1)
    assert d.stats()["copies"] == 3 and d.lookup("k1") == [] and d.lookup("n0") == []
    now[0] = 100.0
    assert d.stats()["copies"] == 0 and d.lookup("n4") == []
    with pytest.raises(ValueError, match="ttl_s"):
        PeerDirectory(ttl_s=0)


def test_a_peer_tier_refuses_another_models_entry_and_needs_a_budget() -> None:
    peer = PeerTier("a", PeerDirectory(), Cluster().objects("a"), MODEL_FP, TOKENIZER_FP, 1 << 20)
    with pytest.raises(ValueError, match="model"):
        peer.write(make_entry(8, model_fp="model-b"), {})
    with pytest.raises(ValueError, match="budget"):
        PeerTier("a", PeerDirectory(), Cluster().objects("a"), MODEL_FP, TOKENIZER_FP, 0)


def test_a_requests_keys_are_looked_up_in_one_directory_call() -> None:
    class Counting(PeerDirectory):
        calls = 0

        def lookup(self, key: str) -> list:
            Counting.calls += 1
            return super().lookup(key)

        def lookup_many(self, keys: list[str]) -> list[list]:
            Counting.calls += 1
            return [PeerDirectory.lookup(self, k) for k in keys]

    directory, cluster = Counting(), Cluster()
    a, peer_a = _store("a", directory, cluster)
    b, _ = _store("b", directory, cluster)
    entries = [make_entry(20 + i) for i in range(4)]
    for e in entries[:2]:
        _publish(a, peer_a, e)
    b.put(entries[2])  # b holds this one itself
    Counting.calls = 0
    assert b.where_many([e.key for e in entries]) == [Tier.PEER, Tier.PEER, Tier.CPU, None]
    assert Counting.calls == 1  # one call for the three keys b's own tiers lack
    assert b.read(entries[0].key).tier is Tier.PEER and Counting.calls == 1  # the read reuses the answer


def _inside(t: torch.Tensor, data: bytes) -> bool:
    """Whether tensor `t`'s memory lies inside `data`'s buffer (a view of it, not a copy)."""
    start = np.frombuffer(data, dtype=np.uint8).ctypes.data
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + len(data)


def test_the_host_tier_holds_what_it_published_in_the_published_objects_memory() -> None:
    """One copy on the host: two (the host tier's and the object store's) in the same memory made
    the peer tier a loss against no peer tier at all (docs/quality.md)."""
    directory, cluster = PeerDirectory(), Cluster()
    store, peer = _store("a", directory, cluster)
    host = store.tier(Tier.CPU)
    assert isinstance(host, CpuTier)
    entry = make_entry(1)
    _publish(store, peer, entry)
    (copy,) = directory.lookup(entry.key.hex)
    held = host.get(entry.key)
    assert held is not None
    assert _inside(held.k, cluster.data[copy.handle]) and _inside(held.v, cluster.data[copy.handle])
    assert host.shared_bytes == entry.nbytes == host.stats().bytes_used  # counted once, in the host's budget
    hit = store.read(entry.key)
    assert hit is not None and hit.tier is Tier.CPU
    assert_same(hit.entry, entry)

    host.delete(entry.key)  # evicted here, still published: computed again, it is held in the object once more
    assert host.shared_bytes == 0
    store.put(entry)
    assert peer.flush() and host.shared_bytes == entry.nbytes
    again = host.get(entry.key)
    assert again is not None and _inside(again.k, cluster.data[copy.handle])
    assert cluster.puts == 1  # published once


def test_a_compressed_peer_copy_is_not_the_host_tiers_kv_and_is_not_shared() -> None:
    directory, cluster = PeerDirectory(), Cluster()
    peer = PeerTier("a", directory, cluster.objects("a"), MODEL_FP, TOKENIZER_FP, 1 << 20, Compression.INT8)
    store = TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP)])
    store.attach(peer)
    entry = make_entry(2)
    _publish(store, peer, entry)
    host = store.tier(Tier.CPU)
    assert isinstance(host, CpuTier) and host.shared_bytes == 0
    held = host.get(entry.key)
    assert held is not None
    assert_same(held, entry)


def test_a_compressed_file_published_as_stored_is_not_shared(tmp_path) -> None:
    """An index's plain copies are int8 on disk: the host tier holds them dequantized, and their
    published bytes (as stored) are not that KV."""
    directory, cluster = PeerDirectory(), Cluster()
    disk = DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP, compression=Compression.INT8)
    entry = make_entry(3)
    disk.put(entry)
    store, peer = _store("a", directory, cluster, below=[disk])
    assert store.read(entry.key) is not None and peer.flush()
    assert len(directory.lookup(entry.key.hex)) == 1  # published
    host = store.tier(Tier.CPU)
    assert isinstance(host, CpuTier) and host.contains(entry.key) and host.shared_bytes == 0


def test_what_the_host_tier_evicts_is_withdrawn_and_what_it_let_go_before_its_publish_is_not_published() -> None:
    """The published objects stay within what the host tier holds, not its size again beside it."""
    directory, cluster = PeerDirectory(), Cluster()
    entries = [make_entry(10 + i) for i in range(3)]
    peer = PeerTier("a", directory, cluster.objects("a"), MODEL_FP, TOKENIZER_FP, 1 << 20)
    host = CpuTier(MODEL_FP, TOKENIZER_FP, budget_bytes=2 * entries[0].nbytes)  # two entries
    store = TieredStore.from_tiers([host])
    store.attach(peer)
    for e in entries:
        _publish(store, peer, e)
    assert not host.contains(entries[0].key)
    assert peer.flush() and directory.lookup(entries[0].key.hex) == []  # evicted there: withdrawn
    assert all(len(directory.lookup(e.key.hex)) == 1 for e in entries[1:])
    assert peer.stats().entries == 2 and host.shared_bytes == 2 * entries[0].nbytes

    gate = threading.Event()

    class Held(Objects):
        def put(self, data: bytes) -> object:
            gate.wait(5)
            return super().put(data)

    directory, cluster = PeerDirectory(), Cluster()
    peer = PeerTier("b", directory, Held(cluster, "b"), MODEL_FP, TOKENIZER_FP, 1 << 20)
    host = CpuTier(MODEL_FP, TOKENIZER_FP)
    store = TieredStore.from_tiers([host])
    store.attach(peer)
    store.put(entries[0])  # published once the gate opens: it is still held then
    store.put(entries[1])  # queued behind it, and gone from the host tier before its turn
    assert host.delete(entries[1].key)
    gate.set()
    assert peer.flush()
    assert len(directory.lookup(entries[0].key.hex)) == 1 and directory.lookup(entries[1].key.hex) == []
    assert cluster.puts == 1  # never put in the object store
