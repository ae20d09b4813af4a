"""The one exception tree of ragkv.

Every package raises these (or plain ValueError/TypeError for caller mistakes);
`server/` alone maps them to gRPC status codes. This module imports nothing heavy
so that engine, kvstore and the client can all share it.
"""

from __future__ import annotations


class RagKVError(Exception):
    """Base of every error ragkv raises on purpose."""


class ModelLoadError(RagKVError):
    """A model could not be loaded: missing path, unreachable hub, corrupt file."""


class UnsupportedModelError(ModelLoadError):
    """The model loads, but its architecture or attention cannot be served correctly."""


class ModelCheckError(UnsupportedModelError):
    """A model's forward through ragkv does not match transformers' (the correctness gate)."""


class CorpusError(RagKVError):
    """The corpus to index is missing, empty, or holds a malformed document."""


class KVFormatError(RagKVError):
    """A KV file is malformed, truncated, or belongs to another model or layout."""


class StoreError(RagKVError):
    """A storage tier failed in a way the caller must hear about (not a plain miss)."""


class KVReadStalledError(StoreError):
    """A layer-by-layer KV read made no progress for the request's KV wait limit mid-prompt."""


class IndexMismatchError(RagKVError):
    """An index was built with another model, tokenizer or embedder than the one in use."""

