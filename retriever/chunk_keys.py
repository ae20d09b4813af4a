"""Chunk KV keys, beside the index format: which KV serves a chunk, and the key that names it.

An index records, per chunk, the key of the KV the indexer computed (`SearchHit.kv_key`): its
plain KV (after the shared prefix alone) or, on an index built with neighbours
(`NeighbourOptions`, the manifest's `neighbours`), its KV after its most similar chunks. Which
of the two a query reads depends on the mode and the chunk's place in the prompt
(`NeighbourOptions.serves_plain`), and a plain key is built here, not read from the index, so
it names this build's file format and the serving model. The indexer, the server, the
cluster's router and the benches all take their keys from this module.

Imports nothing heavy: kvstore (which loads torch) only when a key is built.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ragkv.types import Mode

if TYPE_CHECKING:
    from ragkv.kvstore import ChunkContext, ChunkKey, PrefixHash


class IndexedChunk(Protocol):
    """A chunk as the index records it: a search hit, or the indexer's own record."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def kv_key(self) -> ChunkKey: ...  # the KV the indexer computed (plain, or after neighbours)


class NeighbourChoice(str, enum.Enum):
    """How a chunk's neighbours are chosen."""

    NEAREST = "nearest"  # the m highest cosine similarities of the chunks' embeddings
    RANDOM = "random"  # m other chunks drawn at random (seeded): the control for NEAREST


class NeighbourContext(str, enum.Enum):
    """How the neighbours sit before a chunk while its KV is computed."""

    TOKENS = "tokens"  # their tokens are prefilled with the chunk (each sees the farther ones)
    # their own plain KV (stored anyway) is placed before the chunk and only the chunk's
    # tokens are computed: the same KV as TOKENS for one neighbour within the budget (a
    # neighbour's plain KV is what its tokens give after the prefix); the context costs
    # attention only, no forward of its own (MuSiQue: 2.2x plain indexing at m = 1 and 2.4x at m = 2,
    # against 2.2x and 3.0x with tokens), and the plain KV is stored for focus to read
    KV = "kv"


@dataclass(frozen=True, slots=True)
class NeighbourOptions:
    """How neighbour-conditioned KV is computed; m = 0 means plain KV (after the prefix only)."""

    m: int = 0  # neighbours per chunk
    budget_tokens: int = 1024  # most context tokens before a chunk (neighbours cut to fit)
    choice: NeighbourChoice = NeighbourChoice.NEAREST  # how neighbours are picked
    seed: int = 0  # NeighbourChoice.RANDOM only
    context: NeighbourContext = NeighbourContext.TOKENS  # the neighbours as tokens or as their plain KV

    def __post_init__(self) -> None:
        if self.m < 0 or self.budget_tokens < 1:
            raise ValueError(f"neighbours need m >= 0 and budget_tokens >= 1, got m={self.m}, "
                             f"budget_tokens={self.budget_tokens}")
        object.__setattr__(self, "choice", NeighbourChoice(self.choice))
        object.__setattr__(self, "context", NeighbourContext(self.context))

    @property
    def enabled(self) -> bool:
        return self.m > 0

    @property
    def plain_first(self) -> bool:
        """Whether the prompt's first chunk is served from its plain KV: where the index stores the
        plain KV too (`NeighbourContext.KV`). In the prompt the first chunk follows the prefix
        alone, which is exactly the context its plain KV was computed in, so its KV is exact there
        and no recompute has to correct it (its neighbour KV attended to a passage the prompt does
        not hold; the first chunk's error reaches every later token: docs/quality.md, issue 39)."""
        return self.enabled and self.context is NeighbourContext.KV

    def serves_plain(self, mode: Mode, focus_handover: bool = False, first: bool = False) -> bool:
        """Whether a query in `mode` reads the plain KV (after the prefix only) of an index built
        with these options, rather than the neighbour KV the index recorded for each chunk.

        Plain when there are no neighbours; for the prompt's `first` chunk where the index stores
        the plain KV too (`plain_first`); and for focus without handover over such an index: that
        focus blends the chunks it keeps and drops the others, which a neighbour KV has attended
        to, so the plain KV is its exact input. Focus with handover drops nothing when several
        chunks matter and, in a lookup, blends the kept chunks whose KV came after neighbours, so
        the neighbour KV serves its other chunks (docs/quality.md).
        """
        focus_plain = Mode(mode) is Mode.FOCUS and not focus_handover and self.context is NeighbourContext.KV
        return not self.enabled or focus_plain or (first and self.plain_first)

    def tag(self) -> str:
        """The options as one string: the ChunkKey context tag and the manifest's record."""
        seed = f",seed={self.seed}" if self.choice is NeighbourChoice.RANDOM else ""
        context = f",context={self.context.value}" if self.context is not NeighbourContext.TOKENS else ""
        return f"neighbours:m={self.m},budget={self.budget_tokens},choice={self.choice.value}{seed}{context}"

    def as_dict(self) -> dict:
        return {"m": self.m, "budget_tokens": self.budget_tokens, "choice": self.choice.value, "seed": self.seed,
                "context": self.context.value}

    @classmethod
    def from_dict(cls, d: dict | None) -> NeighbourOptions:
        return cls() if not d else cls(int(d["m"]), int(d["budget_tokens"]), NeighbourChoice(d["choice"]),
                                       int(d.get("seed", 0)), NeighbourContext(d.get("context", "tokens")))


def context_ids(neighbour_ids: Sequence[Sequence[int]], budget_tokens: int) -> list[int]:
    """The context a chunk is prefilled after: its neighbours' tokens, most similar nearest the chunk
    (what its neighbour key names: the indexer computes after it, the server again after it).

    Args:
        neighbour_ids: each neighbour's token ids, most similar first.
        budget_tokens: the most tokens kept; the farthest neighbours go (or lose their first
            tokens) first.
    """
    out: list[int] = []
    for ids in neighbour_ids:  # most similar first: it ends up last, next to the chunk
        room = budget_tokens - len(out)
        if room <= 0:
            break
        out = list(ids)[-room:] + out
    return out


@dataclass(frozen=True, slots=True)
class NeighbourRecipe:
    """How the indexer computed a chunk's neighbour KV, found again from the index's record of its
    neighbours and checked against its key: a server missing that KV computes the same, and keeps
    it under the same key."""

    context: ChunkContext  # the options' tag and the context's tokens: what the key names
    neighbours: tuple[tuple[int, ...], ...]  # each neighbour's token ids, most similar first
    options: NeighbourOptions  # as tokens before the chunk, or as the neighbours' plain KV


def neighbour_recipe(hit: IndexedChunk, neighbour_ids: Sequence[Sequence[int]], options: NeighbourOptions,
                     prefix_hash: PrefixHash, model_fp: str, tokenizer_fp: str) -> NeighbourRecipe | None:
    """The context `hit`'s neighbour KV was computed after, given its neighbours' tokens as the index
    records them (most similar first); None when the key the index recorded names another (an index
    rebuilt since, or one whose neighbours are not recorded): its KV cannot be computed again here."""
    from ragkv.kvstore import ChunkContext, ChunkKey

    if not options.enabled or not neighbour_ids:
        return None
    context = ChunkContext(options.tag(), tuple(context_ids(neighbour_ids, options.budget_tokens)))
    key = ChunkKey.from_prefix_hash(model_fp, tokenizer_fp, prefix_hash, hit.token_ids, context.hash())
    if key != hit.kv_key:
        return None
    return NeighbourRecipe(context, tuple(tuple(int(i) for i in ids) for ids in neighbour_ids), options)


def chunk_key(model_fp: str, tokenizer_fp: str, prefix_ids: Sequence[int], chunk_ids: Sequence[int],
              context: ChunkContext | None = None) -> ChunkKey:
    """The key of a chunk's KV computed after `prefix_ids` (and `context`, when the chunk was
    prefilled after neighbour tokens): the one place a key is built from token ids."""
    from ragkv.kvstore import ChunkKey

    return ChunkKey.build(model_fp, tokenizer_fp, list(prefix_ids), list(chunk_ids), context)


def serving_keys(hits: Sequence[IndexedChunk], mode: Mode, neighbours: NeighbourOptions, prefix_hash: PrefixHash,
                 model_fp: str, tokenizer_fp: str, focus_handover: bool = False) -> list[ChunkKey]:
    """`serving_key` of each hit of one prompt, in prompt order (the first is the prompt's first
    chunk): the keys a replica reads, the ingress routes on, and calibration measures."""
    return [serving_key(h, mode, neighbours, prefix_hash, model_fp, tokenizer_fp, focus_handover, first=i == 0)
            for i, h in enumerate(hits)]


def serving_key(hit: IndexedChunk, mode: Mode, neighbours: NeighbourOptions, prefix_hash: PrefixHash, model_fp: str,
                tokenizer_fp: str, focus_handover: bool = False, first: bool = False) -> ChunkKey:
    """The key of the KV a search hit is served from in `mode`, the prompt's `first` chunk or a
    later one: its plain KV's, built here for the serving model (an index of an older format
    just misses), or the neighbour KV's the index recorded (it names the neighbours' context,
    which only the indexer knows). The server reads it; the cluster's ingress routes on it."""
    from ragkv.kvstore import ChunkKey

    if neighbours.serves_plain(mode, focus_handover, first):
        return ChunkKey.from_prefix_hash(model_fp, tokenizer_fp, prefix_hash, hit.token_ids)
    return hit.kv_key
