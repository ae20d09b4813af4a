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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ragkv.retriever.chunk_keys import NeighbourChoice, NeighbourContext, NeighbourOptions, context_ids

if TYPE_CHECKING:
    import numpy as np

__all__ = ["INDEX_DEFAULT", "INDEX_KV_COMPRESSION", "PLAIN_COPY_COMPRESSION", "context_ids", "select_neighbours"]

_BLOCK = 1024  # rows whose similarities to every chunk are held at once
_DUPLICATE = 1.0 - 1e-6  # cosine similarity at which two chunks count as the same text


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
# first chunk and is the context every neighbour pass reads, so int8 (KL 2e-4 to it on MuSiQue
# 30x5: docs/kv-compression.md) (`IndexJobConfig.plain_kv_compression`)
PLAIN_COPY_COMPRESSION = "int8"
# how `ragkv index` stores each chunk's own KV unless told otherwise: int4 (KIVI's groups), which
# holds KL at most 0.005 on blend, the served default, on both shipped models over MuSiQue 30x5,
# so that with the int8 plain copies the index holds 0.82 of one bf16 copy's bytes
# (docs/kv-compression.md). The library's own default (IndexJobConfig) stays uncompressed.
INDEX_KV_COMPRESSION = "int4"
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
