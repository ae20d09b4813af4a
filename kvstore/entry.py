"""KVEntry: one chunk's KV tensors and the metadata that says whose they are.

Knows nothing of files, tiers or compression: an entry always holds the
tensors the engine uses, in the dtype they were computed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from ragkv.kvstore.keys import ChunkKey, ContextHash, PrefixHash, check_fingerprint, check_prefix_hash

# The dtypes K and V may be stored in (the file records which).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RopeMode(str, Enum):
    """Whether stored keys have RoPE applied. A str enum, so it compares equal to its value."""

    PRE_ROPE = "pre_rope"  # K before RoPE; the engine rotates at the final positions
    POST_ROPE = "post_rope"  # K already rotated at `positions`


class ComputedKV(Protocol):
    """A chunk's KV as a model computed it (the engine's ChunkKV is one): what
    `KVEntry.of` stores, so the store needs no import of the engine."""

    token_ids: torch.Tensor  # [T] int64
    k: torch.Tensor  # [L, Hkv, T, D], before RoPE
    v: torch.Tensor  # [L, Hkv, T, D]
    positions: torch.Tensor  # [T] int64


@dataclass(frozen=True, slots=True)
class KVEntry:
    """One chunk's KV, as prefilled after the shared prefix.

    The store hands out the tensors it holds without copying them: treat them as
    read-only (apply RoPE out of place). Shapes and dtypes are checked here, and
    the key is checked against (fingerprints, prefix hash, token ids), so an
    entry cannot carry another chunk's name.
    """

    key: ChunkKey  # sha256 of (format version, fingerprints, prefix hash, token ids)
    k: torch.Tensor  # [L, Hkv, T, D] keys (before RoPE when rope_mode is PRE_ROPE)
    v: torch.Tensor  # [L, Hkv, T, D] values, same dtype and device as k
    token_ids: torch.Tensor  # [T] int64, on CPU: the chunk's tokens
    positions: torch.Tensor  # [T] int64, on CPU: positions the chunk was prefilled at
    model_fp: str  # model fingerprint (weights + config), one path segment
    tokenizer_fp: str  # tokenizer fingerprint, one path segment
    prefix_hash: PrefixHash  # sha256 hex of the prefix token ids the chunk was prefilled after
    rope_mode: RopeMode = RopeMode.PRE_ROPE  # whether k carries RoPE
    # the context prefilled between prefix and chunk (neighbour-conditioned KV); None = none
    context_hash: ContextHash | None = None

    @classmethod
    def of(cls, kv: ComputedKV, key: ChunkKey, model_fp: str, tokenizer_fp: str, prefix_hash: PrefixHash,
           context_hash: ContextHash | None = None) -> KVEntry:
        """A computed chunk KV as a store entry under `key` (`context_hash`: neighbour-conditioned KV).
        A V equal to K (multi-head latent attention's latent) is held once."""
        v = kv.k if kv.v is not kv.k and torch.equal(kv.k, kv.v) else kv.v
        return cls(key=key, k=kv.k, v=v, token_ids=kv.token_ids.cpu(), positions=kv.positions.cpu(),
                   model_fp=model_fp, tokenizer_fp=tokenizer_fp, prefix_hash=prefix_hash, context_hash=context_hash)

    def __post_init__(self) -> None:
        if not isinstance(self.key, ChunkKey):
            raise TypeError(f"key must be a ChunkKey, got {type(self.key).__name__}")
        object.__setattr__(self, "rope_mode", RopeMode(self.rope_mode))
        check_fingerprint(self.model_fp, "model fingerprint")
        check_fingerprint(self.tokenizer_fp, "tokenizer fingerprint")
        check_prefix_hash(self.prefix_hash)
        if self.context_hash is not None:
            check_prefix_hash(self.context_hash)
        for name in ("k", "v", "token_ids", "positions"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if self.k.dim() != 4:
            raise ValueError(f"k must be [L, Hkv, T, D], got shape {tuple(self.k.shape)}")
        if self.k.shape != self.v.shape:
            raise ValueError(f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} differ in shape")
        if self.k.dtype not in KV_DTYPES or self.v.dtype != self.k.dtype:
            raise TypeError(
                f"k and v must share one dtype of {[str(d) for d in KV_DTYPES]}, "
                f"got k {self.k.dtype} and v {self.v.dtype}"
            )
        if self.k.device != self.v.device:
            raise ValueError(f"k on {self.k.device} and v on {self.v.device} differ in device")
        t_len = self.k.shape[2]
        for name in ("token_ids", "positions"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.shape != (t_len,) or t.device.type != "cpu":
                raise ValueError(
                    f"{name} must be a CPU int64 tensor of shape ({t_len},), "
                    f"got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        expected = ChunkKey.from_prefix_hash(
            self.model_fp, self.tokenizer_fp, self.prefix_hash, self.token_ids.tolist(), self.context_hash
        )
        if expected != self.key:
            raise ValueError(
                f"key {self.key.hex} does not match the entry's fingerprints, prefix hash and "
                f"token ids (they give {expected.hex})"
            )

    @property
    def num_tokens(self) -> int:
        """T, the chunk's length in tokens."""
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes the entry's tensors occupy (what memory tiers count against their budget)."""
        v_bytes = 0 if self.v is self.k else self.v.nbytes  # one latent as both (MLA, read back from a file)
        return self.k.nbytes + v_bytes + self.token_ids.nbytes + self.positions.nbytes
