"""Neighbour-conditioned chunk KV (the idea of FusionRAG, arXiv 2601.12904): which chunks a
chunk is prefilled after, and the context tokens they make.

At index time each chunk is prefilled after the shared prefix *and* its m most similar
other chunks (by the index's own embeddings), and only the chunk's own KV is stored, so
its entries already carry some of the cross-chunk attention they will need when it is
served beside those chunks. The context sits between the prefix and the chunk, the most
similar neighbour nearest the chunk, and is cut to a token budget (its first tokens are
dropped: the tokens nearest the chunk stay).

Pure numpy and token ids: nothing here loads a model or touches the store.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragkv.types import Mode

if TYPE_CHECKING:
    import numpy as np

_BLOCK = 1024  # rows whose similarities to every chunk are held at once
_DUPLICATE = 1.0 - 1e-6  # cosine similarity at which two chunks count as the same text


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


# what `ragkv index` builds unless told otherwise: each chunk's KV computed after the last 512
# tokens of its most similar chunk (as that chunk's plain KV), and every chunk's plain KV too,
# stored int8 (PLAIN_COPY_COMPRESSION: storage 1.25x plain), which serves the prompt's first
# chunk (`plain_first`). 512 tokens, not 256: the chunk then sits where a served chunk sits,
# past the prefix and out of a 512-token sliding window's sight of it (MuSiQue 30x5: SmolLM2
# KL to full prefill 0.0196 -> 0.0165, Gemma 3 270M 0.0685 -> about 0.05, same TTFT). The
# plain first chunk took blend to 0.0134 and 0.0203 at the same TTFT (docs/quality.md, issue
# 39). Indexing is 2.2x plain prefill. The library's own default (`NeighbourOptions()`,
# IndexJobConfig) stays plain KV.
# how an index stores the plain copy of each chunk's KV (NeighbourContext.KV): it serves a prompt's
# first chunk, so int8 (a quarter of float32, KL 5e-5 to it: docs/kv-compression.md) keeps the
# index within 1.25x the bytes of plain KV (`IndexJobConfig.plain_kv_compression`)
PLAIN_COPY_COMPRESSION = "int8"
INDEX_DEFAULT = NeighbourOptions(m=1, budget_tokens=512, context=NeighbourContext.KV)


def select_neighbours(xb: np.ndarray, options: NeighbourOptions,
                      rows: Sequence[int] | None = None) -> list[list[int]]:
    """For each row of `xb` (or each of `rows`), its neighbours: row numbers, most similar first.

    A chunk is never its own neighbour, nor is any row whose vector is (nearly) its own:
    cosine similarity >= 1 - 1e-6 marks a duplicate passage, which adds no context.

    Args:
        xb: [n, d] embeddings (normalized or not: cosine similarity is used).
        rows: the rows to find neighbours for; None = all.
    """
    import numpy as np  # here, not at import: `ragkv index --help` reads this module's defaults

    xb = np.asarray(xb, dtype=np.float32)
    if xb.ndim != 2:
        raise ValueError(f"xb must be [n, d], got shape {xb.shape}")
    n = xb.shape[0]
    rows = list(range(n)) if rows is None else [int(r) for r in rows]
    if not options.enabled or n == 0:
        return [[] for _ in rows]
    norm = xb / np.maximum(np.linalg.norm(xb, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(options.seed)
    out: list[list[int]] = []
    for start in range(0, len(rows), _BLOCK):  # [block, n] similarities at a time, not [n, n]
        block = rows[start:start + _BLOCK]
        sims = norm[block] @ norm.T  # [B, n]
        same = sims >= _DUPLICATE  # [B, n] duplicates of the row (itself included)
        same[np.arange(len(block)), block] = True
        for i in range(len(block)):
            if options.choice is NeighbourChoice.NEAREST:
                s = np.where(same[i], -np.inf, sims[i])
                order = np.argsort(-s, kind="stable")[: options.m]
                out.append([int(j) for j in order if np.isfinite(s[j])])
            else:
                pool = np.flatnonzero(~same[i])
                out.append([int(j) for j in rng.permutation(pool)[: options.m]])
    return out


def context_ids(neighbour_ids: Sequence[Sequence[int]], budget_tokens: int) -> list[int]:
    """The context a chunk is prefilled after: its neighbours' tokens, most similar nearest the chunk.

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
