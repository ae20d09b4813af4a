"""The typed records an index is made of: ids, documents' and chunks' rows.

Ids are NewTypes over ``str`` so that a chunk id, a document id and a content hash
cannot be swapped by accident. This module knows nothing of SQLite or FAISS.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

DocId = NewType("DocId", str)  # a document's id: its relative path, or the "id" of a JSONL line
ChunkId = NewType("ChunkId", str)  # 32 hex chars, sha256 over (doc id, occurrence, chunk text)
ContentHash = NewType("ContentHash", str)  # 64 hex chars, sha256 of a document's text + metadata
from ragkv.types import Fingerprint  # noqa: E402, F401 - re-exported: the index's records name it here

if TYPE_CHECKING:  # kvstore pulls torch in; `ragkv index --help` must not
    from ragkv.kvstore import ChunkKey

CHUNK_ID_HEX = 32  # hex characters kept from the sha256 of a chunk id (128 bits)


def content_hash(text: str, metadata: Mapping[str, Any]) -> ContentHash:
    """Hash a document's text and metadata: a change in either re-indexes it."""
    payload = json.dumps({"text": text, "metadata": metadata}, sort_keys=True, ensure_ascii=False)
    return ContentHash(hashlib.sha256(payload.encode("utf-8")).hexdigest())


def chunk_id(doc_id: DocId, text: str, occurrence: int) -> ChunkId:
    """The stable id of a chunk: document id + the chunk's content.

    Args:
        doc_id: The document the chunk belongs to.
        text: The chunk's text.
        occurrence: How many earlier chunks of the same document have exactly this
            text (0 almost always); keeps ids unique when a passage repeats.
    """
    h = hashlib.sha256()
    for part in (doc_id, str(occurrence), text):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return ChunkId(h.hexdigest()[:CHUNK_ID_HEX])


@dataclass(frozen=True, slots=True)
class DocumentRecord:
    """One document as the index remembers it (to detect changes on re-index)."""

    doc_id: DocId  # the document's id
    content_hash: ContentHash  # hash of text + metadata when it was indexed
    source: str  # corpus-relative path of the file it came from
    n_chunks: int  # how many chunks it was split into


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One chunk: its text, metadata, LLM token ids and the key of its KV."""

    chunk_id: ChunkId  # stable id (see chunk_id())
    doc_id: DocId  # the document it was cut from
    ordinal: int  # position of the chunk in its document, from 0
    text: str  # the chunk's text, an exact substring of the document (stripped)
    metadata: Mapping[str, Any]  # the document's metadata (JSON-serializable)
    token_ids: tuple[int, ...]  # the LLM's token ids of `text`, no special tokens
    kv_key: ChunkKey  # names its KV in the store: (model, tokenizer, prefix, token_ids[, context])
