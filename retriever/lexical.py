"""The lexical index: BM25 (the ``bm25s`` package) over chunk text, beside FAISS.

Dense MiniLM search blurs exact names, codes and identifiers that many chunks
resemble; BM25 matches them token for token. Document ``i`` of the BM25 index is
the chunk at ``rows[i]`` of the chunk database, so hits map back as FAISS ids do.

Built by ``ragkv index`` from the chunk database whenever its chunks changed (the
same ``vectors_version`` test as FAISS): rebuilding from the database is cheap
(bench/retrieval_bench.py measures it: well under a second for 10k chunks), so an
incremental re-index rebuilds it rather than patching postings. Saved to
``lexical/`` in the index folder, swapped in atomically. Knows nothing of
embeddings or the engine.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LEXICAL_DIR = "lexical"  # folder in the index dir
ROWS_NAME = "rows.npy"  # int64 [N]: chunk-database row of each BM25 document
STOPWORDS = "en"  # bm25s' English stopword list
TOKEN_PATTERN = r"(?u)\b\w+\b"  # single characters too: codes like "B-7" keep their "7"


def tokenize(texts: Sequence[str]) -> list[list[str]]:
    """Lower-cased word tokens of each text, English stopwords removed (bm25s' tokenizer)."""
    import bm25s

    return bm25s.tokenize(list(texts), lower=True, token_pattern=TOKEN_PATTERN, stopwords=STOPWORDS,
                          return_ids=False, show_progress=False)


class LexicalIndex:
    """BM25 over the chunks of one index; read-only once built, safe from several threads.

    Args:
        bm25: the ``bm25s.BM25`` model (None for an empty index).
        rows: chunk-database row of each BM25 document, ``[N]`` int64.
    """

    def __init__(self, bm25, rows: np.ndarray) -> None:  # bm25: bm25s.BM25 | None
        self._bm25 = bm25
        self.rows = rows  # [N] int64

    @classmethod
    def build(cls, rows: Sequence[int], texts: Sequence[str]) -> LexicalIndex:
        """Index ``texts`` (one per chunk row)."""
        import bm25s

        if len(rows) != len(texts):
            raise ValueError(f"{len(rows)} rows but {len(texts)} texts: give one text per row")
        ids = np.asarray(rows, dtype=np.int64)  # [N]
        if not len(ids):
            return cls(None, ids)
        bm25 = bm25s.BM25()
        bm25.index(tokenize(texts), show_progress=False)
        return cls(bm25, ids)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query``: ``[N]`` float32, position i = ``rows[i]``."""
        if self._bm25 is None:
            return np.zeros(0, dtype=np.float32)
        tokens = [t for t in tokenize([query])[0] if t in self._bm25.vocab_dict]
        if not tokens:
            return np.zeros(len(self), dtype=np.float32)
        return np.asarray(self._bm25.get_scores(tokens), dtype=np.float32)

    def save(self, index_dir: Path) -> None:
        """Write to ``index_dir/lexical`` atomically (a temp folder renamed over the old one)."""
        index_dir = Path(index_dir)
        final = index_dir / LEXICAL_DIR
        tmp = index_dir / f".{LEXICAL_DIR}.tmp-{os.getpid()}"
        old = index_dir / f".{LEXICAL_DIR}.old-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        np.save(tmp / ROWS_NAME, self.rows)
        if self._bm25 is not None:
            self._bm25.save(str(tmp), show_progress=False)
        (tmp / "meta.json").write_text(json.dumps({"documents": len(self), "stopwords": STOPWORDS,
                                                   "token_pattern": TOKEN_PATTERN}))
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    @classmethod
    def load(cls, index_dir: Path) -> LexicalIndex | None:
        """The saved lexical index of ``index_dir``; None when it has none (built before BM25)."""
        import bm25s

        path = Path(index_dir) / LEXICAL_DIR
        if not (path / ROWS_NAME).exists():
            return None
        rows = np.load(path / ROWS_NAME)
        if not len(rows):
            return cls(None, rows)
        bm25 = bm25s.BM25.load(str(path), show_progress=False, verbosity=0)
        return cls(bm25, rows.astype(np.int64, copy=False))
