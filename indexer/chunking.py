"""Splitting a document into chunks of at most ``size`` LLM tokens, on sentence boundaries.

The text is cut into units (sentences, or paragraphs that end without
punctuation); units longer than a chunk are cut at word boundaries, and single
words longer than a chunk at characters. Units are packed greedily into chunks
of at most ``size`` tokens. Consecutive chunks share up to ``overlap`` tokens:
whole trailing sentences when they fit, else the trailing words of the last one.

A chunk's text is an exact (stripped) substring of the document, and its token
ids are the tokenizer's ids of exactly that text, so the index and the server
agree on them. Knows nothing of embeddings, FAISS or KV.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ragkv.retriever.records import ChunkId, DocId, chunk_id

Tokenize = Callable[[str], Sequence[int]]  # text -> token ids, no special tokens

DEFAULT_CHUNK_TOKENS = 512  # tokens per chunk at most
DEFAULT_OVERLAP_TOKENS = 32  # tokens shared by consecutive chunks at most

# A unit ends after . ! ? (and closing quotes/brackets) followed by whitespace, or at a blank line.
_UNIT_END = re.compile(r"(?<=[.!?])[\"'’”)\]]*\s+|\n[ \t]*\n\s*")
_WORD = re.compile(r"\S+\s*")


@dataclass(frozen=True, slots=True)
class ChunkingConfig:
    """How documents are cut."""

    size: int = DEFAULT_CHUNK_TOKENS  # tokens per chunk at most
    overlap: int = DEFAULT_OVERLAP_TOKENS  # tokens shared by consecutive chunks at most

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"chunk size must be >= 1 token, got {self.size}")
        if not 0 <= self.overlap < self.size:
            raise ValueError(
                f"chunk overlap must be in [0, size={self.size}) tokens, got {self.overlap}"
            )


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a document."""

    chunk_id: ChunkId  # stable id from doc id + content (see retriever.records.chunk_id)
    doc_id: DocId  # the document it was cut from
    ordinal: int  # position in the document, from 0
    text: str  # exact substring of the document, stripped of surrounding whitespace
    token_ids: tuple[int, ...]  # tokenize(text), len <= size
    start: int  # character offset of `text` in the document
    end: int  # character offset just past `text`


@dataclass(frozen=True, slots=True)
class _Span:
    start: int  # character offset in the document
    end: int  # character offset just past the span
    n_tokens: int  # tokens of the stripped span text


def chunk_document(
    doc_id: DocId, text: str, tokenize: Tokenize, config: ChunkingConfig, count: Tokenize | None = None
) -> list[Chunk]:
    """Cut ``text`` into chunks; an empty or whitespace-only text gives no chunk.

    Args:
        doc_id: the document's id (part of every chunk id).
        text: the document's text.
        tokenize: a chunk text's token ids as they will be stored (engine's ``chunk_ids``).
        config: size and overlap in tokens.
        count: a cheaper tokenizer used to measure sentences (by default ``tokenize``);
            every chunk is checked with ``tokenize`` at the end.
    """
    measure = count or tokenize
    units = _units(text, measure, config.size)
    chunks: list[Chunk] = []
    seen: dict[str, int] = {}
    pos = 0  # index of the first whole unit of the next chunk
    head: _Span | None = None  # partial unit carried over as overlap
    while pos < len(units):
        parts = ([head] if head else []) + _fill(units, pos, config.size - (head.n_tokens if head else 0))
        if len(parts) == (1 if head else 0):
            if head is None:  # pragma: no cover - every unit fits a chunk by construction
                raise RuntimeError(f"unit at {units[pos].start} of {doc_id!r} exceeds the chunk size: a bug")
            head = None  # the overlap and the next unit do not fit together: drop the overlap
            continue
        while True:
            start, end = _strip(text, parts[0].start, parts[-1].end)
            ids = tuple(tokenize(text[start:end]))
            if len(ids) <= config.size:
                break
            # merges at unit joins made it longer than counted: drop a unit, then the overlap
            if len(parts) > (2 if head else 1):
                parts.pop()
            elif head:
                parts, head = parts[1:], None
            else:  # pragma: no cover - a unit alone is within size by construction
                ids = ids[: config.size]
                break
        whole = len(parts) - (1 if head else 0)  # whole units consumed
        body = text[start:end]
        occurrence = seen.get(body, 0)
        seen[body] = occurrence + 1
        chunks.append(Chunk(chunk_id(doc_id, body, occurrence), doc_id, len(chunks), body, ids, start, end))
        nxt = pos + whole
        if nxt >= len(units):
            break
        head = None
        k = nxt
        # overlap never crowds out the next unit: a chunk must bring something new
        budget = min(config.overlap, config.size - units[nxt].n_tokens)
        while k > pos and units[k - 1].n_tokens <= budget:
            budget -= units[k - 1].n_tokens
            k -= 1
        if pos < k < nxt:
            pos = k  # overlap on sentence boundaries
            continue
        pos = nxt
        if budget > 0:
            head = _word_tail(text, units[nxt - 1], measure, budget)
    return chunks


def _fill(units: list[_Span], pos: int, room: int) -> list[_Span]:
    out = []
    for u in units[pos:]:
        if u.n_tokens > room:
            break
        out.append(u)
        room -= u.n_tokens
    return out


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _units(text: str, tokenize: Tokenize, size: int) -> list[_Span]:
    """Sentence spans covering ``text``, each cut further until it fits ``size`` tokens."""
    bounds = [0] + [m.end() for m in _UNIT_END.finditer(text)] + [len(text)]
    out: list[_Span] = []
    for a, b in zip(bounds, bounds[1:]):
        s, e = _strip(text, a, b)
        if s == e:
            continue
        n = len(tokenize(text[s:e]))
        if n <= size:
            out.append(_Span(s, e, n))
        else:
            out.extend(_split_long(text, s, e, tokenize, size))
    return out


def _split_long(text: str, start: int, end: int, tokenize: Tokenize, size: int) -> list[_Span]:
    """Cut one over-long sentence at word boundaries (words longer than a chunk at characters)."""
    words: list[tuple[int, int]] = []
    for m in _WORD.finditer(text, start, end):
        ws, we = _strip(text, m.start(), m.end())
        n = len(tokenize(text[ws:we]))
        if n <= size:
            words.append((ws, we))
            continue
        step = max(1, (we - ws) * size // (2 * n))  # about half a chunk of characters
        words.extend((p, min(p + step, we)) for p in range(ws, we, step))
    out: list[_Span] = []
    i = 0
    while i < len(words):
        lo, hi = i + 1, len(words)  # words[i:lo] fits; find the longest run that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tokenize(text[words[i][0] : words[mid - 1][1]])) <= size:
                lo = mid
            else:
                hi = mid - 1
        out.append(_Span(words[i][0], words[lo - 1][1], len(tokenize(text[words[i][0] : words[lo - 1][1]]))))
        i = lo
    return out


def _word_tail(text: str, unit: _Span, tokenize: Tokenize, budget: int) -> _Span | None:
    """The longest run of trailing words of ``unit`` within ``budget`` tokens, or None."""
    starts = [m.start() for m in _WORD.finditer(text, unit.start, unit.end)]
    best: _Span | None = None
    for s in reversed(starts[1:]):  # never the whole unit: that would not move forward
        n = len(tokenize(text[s : unit.end]))
        if n > budget:
            break
        best = _Span(s, unit.end, n)
    return best
