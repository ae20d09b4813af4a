"""retriever: query embedding, FAISS search and chunk metadata.

Owns the on-disk index format (manifest.json, chunks.sqlite, vectors.faiss) that the
indexer writes and the server reads. Knows nothing of the engine or KV tensors;
never imports gRPC. Importing the package is light: numpy, FAISS and torch load
only when ``Retriever``/``SearchHit`` are first used, so the CLI stays a client install.
"""

from typing import Any

from ragkv.retriever.manifest import IndexState, Manifest, ShardSpec, VectorIndexKind
from ragkv.retriever.records import ChunkId, ChunkRecord, DocId, Fingerprint

__all__ = [
    "ChunkId", "ChunkRecord", "DocId", "Fingerprint", "SearchHit", "IndexState", "Manifest",
    "Retriever", "ShardSpec", "VectorIndexKind",
]


def __getattr__(name: str) -> Any:
    if name in ("SearchHit", "Retriever"):
        from ragkv.retriever import search

        return getattr(search, name)
    raise AttributeError(f"module 'retriever' has no attribute {name!r}")
