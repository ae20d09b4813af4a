"""kvstore: ChunkKey, the per-chunk KV file format, and the tiers (gpu, cpu, disk, s3)
behind one TieredStore.

Knows nothing of the engine's internals, gRPC or FAISS: it stores named tensors
with metadata and hands them back bit-exact or not at all.
"""
