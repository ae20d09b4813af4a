"""kvstore: ChunkKey, the per-chunk KV file format, and the tiers (gpu, cpu, disk, s3, and a
cluster's peer tier) behind one TieredStore.

Knows nothing of the engine's internals, gRPC or FAISS (it must not import
engine/, server/, retriever/ or indexer/): it stores named tensors with metadata
and hands them back bit-exact (or within the stated tolerance when compressed),
or not at all.

Shapes: `[L, Hkv, T, D]` = layers, KV heads, tokens, head dim (legend in engine/).

    store = TieredStore(StoreConfig.from_uris(["cpu", "disk:/x"]), model_fp, tokenizer_fp)
    store.put(entry)
    handles = store.prefetch(keys)    # the one read: handle.future, handle.hit(timeout) -> Hit | None
    hit = store.read(key)             # the same lookup on this thread: Hit(entry, tier, seconds) or None
    hit = store.read(key, layered=True)  # hit.layers.wait(l) before reading layer l (filled behind compute)
"""

from ragkv.kvstore.compression import Compression
from ragkv.kvstore.config import StoreConfig, TierSpec, parse_bytes
from ragkv.kvstore.entry import KVEntry, RopeMode
from ragkv.kvstore.eviction import Policy
from ragkv.kvstore.keys import FORMAT_VERSION, ChunkContext, ChunkKey, ContextHash, PrefixHash, hash_prefix
from ragkv.kvstore.layered import LayerGate
from ragkv.kvstore.store import PrefetchHandle, StoreStats, TieredStore
from ragkv.kvstore.tiers.base import Hit, StorageTier, Tier, TierStats
from ragkv.kvstore.tiers.disk import DiskTier
from ragkv.kvstore.tiers.memory import CpuTier, GpuTier, MemoryTier
from ragkv.kvstore.tiers.peer import PeerCopy, PeerDirectory, PeerReadError, PeerTier
from ragkv.kvstore.tiers.s3 import S3Settings, S3Tier

__all__ = [
    "FORMAT_VERSION",
    "ChunkContext",
    "ChunkKey",
    "ContextHash",
    "Compression",
    "CpuTier",
    "DiskTier",
    "GpuTier",
    "Hit",
    "KVEntry",
    "LayerGate",
    "MemoryTier",
    "PeerCopy",
    "PeerDirectory",
    "PeerReadError",
    "PeerTier",
    "Policy",
    "PrefetchHandle",
    "PrefixHash",
    "RopeMode",
    "S3Settings",
    "S3Tier",
    "StorageTier",
    "StoreConfig",
    "StoreStats",
    "Tier",
    "TierSpec",
    "TierStats",
    "TieredStore",
    "hash_prefix",
    "parse_bytes",
]
