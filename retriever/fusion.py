"""Fusing ranked lists from several searches (dense, lexical) into one, and metadata filters.

Reciprocal rank fusion by default: a chunk scores ``sum_m w_m / (rrf_k + rank_m)``
over the searches that ranked it, so neither search's score scale matters. The
weighted alternative min-max normalizes each list's scores to [0, 1] and adds them
with the same weights. Knows nothing of FAISS, BM25 or the chunk database: rows in,
rows out.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragkv.types import MetadataFilter, SearchMode

DEFAULT_SEARCH_MODE = SearchMode.HYBRID  # measured: docs/retrieval.md


class FusionMethod(str, enum.Enum):
    """How hybrid search combines the dense and lexical lists."""

    RRF = "rrf"  # reciprocal rank fusion: ranks only
    WEIGHTED = "weighted"  # min-max normalized scores, weighted sum


@dataclass(frozen=True, slots=True)
class FusionConfig:
    """How hybrid search fuses, and how deep each search looks before fusing or reranking."""

    method: FusionMethod = FusionMethod.RRF  # how the lists are combined
    dense_weight: float = 1.0  # weight of the dense list, >= 0
    lexical_weight: float = 1.0  # weight of the lexical (BM25) list, >= 0
    rrf_k: int = 60  # RRF's rank offset (Cormack et al.'s 60): larger flattens the rank curve
    candidates: int = 50  # chunks each search returns before fusion, and the reranker's pool

    def __post_init__(self) -> None:
        if not isinstance(self.method, FusionMethod):
            try:
                object.__setattr__(self, "method", FusionMethod(str(self.method).lower()))
            except ValueError:
                allowed = ", ".join(m.value for m in FusionMethod)
                raise ValueError(f"fusion must be one of {allowed}, got {self.method!r}") from None
        for name in ("dense_weight", "lexical_weight"):
            w = getattr(self, name)
            if not (isinstance(w, (int, float)) and np.isfinite(w) and w >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {w!r}")
        if self.dense_weight == self.lexical_weight == 0:
            raise ValueError("dense_weight and lexical_weight are both 0: give one of them weight")
        if not (isinstance(self.rrf_k, int) and self.rrf_k >= 0):
            raise ValueError(f"rrf_k must be an int >= 0, got {self.rrf_k!r}")
        if not (isinstance(self.candidates, int) and self.candidates >= 1):
            raise ValueError(f"candidates must be an int >= 1, got {self.candidates!r}")


Ranked = Sequence[tuple[int, float]]  # (row, score), best first


@dataclass(frozen=True, slots=True)
class Fused:
    """One chunk of a fused list."""

    row: int  # chunk-database row
    score: float  # fused score (RRF sum or weighted normalized score), higher is better
    found_by: tuple[SearchMode, ...]  # the searches whose lists held it


def _normalized(ranked: Ranked) -> dict[int, float]:
    if not ranked:
        return {}
    s = np.asarray([sc for _, sc in ranked], dtype=np.float64)  # [n]
    lo, hi = float(s.min()), float(s.max())
    span = hi - lo
    return {row: (1.0 if span == 0 else (sc - lo) / span) for row, sc in ranked}


def fuse(dense: Ranked, lexical: Ranked, config: FusionConfig) -> list[Fused]:
    """Fuse the dense and lexical lists; best first, ties broken by dense rank then row."""
    lists = ((SearchMode.DENSE, dense, config.dense_weight), (SearchMode.LEXICAL, lexical, config.lexical_weight))
    score: dict[int, float] = {}
    found: dict[int, list[SearchMode]] = {}
    for mode, ranked, weight in lists:
        if config.method is FusionMethod.RRF:
            contrib = {row: weight / (config.rrf_k + rank) for rank, (row, _) in enumerate(ranked, start=1)}
        else:
            contrib = {row: weight * v for row, v in _normalized(ranked).items()}
        for row, c in contrib.items():
            score[row] = score.get(row, 0.0) + c
            found.setdefault(row, []).append(mode)
    dense_rank = {row: i for i, (row, _) in enumerate(dense)}
    order = sorted(score, key=lambda r: (-score[r], dense_rank.get(r, len(dense)), r))
    return [Fused(r, score[r], tuple(found[r])) for r in order]


def filters_key(filters: Sequence[MetadataFilter]) -> str:
    """A cache key naming a set of filters (their order does not matter)."""
    return json.dumps(sorted([f.key, f.op.value, f.value] for f in filters), sort_keys=True, default=str)


def allowed_rows(metadata_by_row: Mapping[int, Mapping[str, Any]], filters: Sequence[MetadataFilter]) -> np.ndarray:
    """Rows whose metadata satisfies every filter, ascending: ``[M]`` int64."""
    keep = [row for row, meta in metadata_by_row.items() if all(f.matches(meta) for f in filters)]
    return np.asarray(sorted(keep), dtype=np.int64)
