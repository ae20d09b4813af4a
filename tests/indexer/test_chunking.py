"""Chunking: sizes, sentence boundaries, overlap, exact substrings, stable ids."""

from __future__ import annotations

import re

import pytest

from ragkv.indexer.chunking import ChunkingConfig, chunk_document
from ragkv.retriever.records import DocId


def words(text: str) -> list[str]:
    """A toy tokenizer: words and punctuation."""
    return re.findall(r"\w+|[^\w\s]", text)


SENTENCES = " ".join(f"Sentence number {i} says something true." for i in range(30))  # 7 tokens each


def test_chunks_fit_and_end_on_sentence_boundaries():
    chunks = chunk_document(DocId("d"), SENTENCES, words, ChunkingConfig(size=30, overlap=0))
    assert len(chunks) == 8  # 4 sentences (28 tokens) per chunk, 30 sentences
    for c in chunks:
        assert len(c.token_ids) <= 30
        assert c.text.endswith("true.") and c.text.startswith("Sentence")
        assert SENTENCES[c.start : c.end] == c.text
        assert list(c.token_ids) == words(c.text)
    assert [c.ordinal for c in chunks] == list(range(8))
    # without overlap, the chunks tile the text
    assert " ".join(c.text for c in chunks) == SENTENCES


def test_overlap_repeats_whole_trailing_sentences():
    chunks = chunk_document(DocId("d"), SENTENCES, words, ChunkingConfig(size=30, overlap=8))
    for a, b in zip(chunks, chunks[1:]):
        last_sentence = a.text[a.text.rfind("Sentence"):]
        assert b.text.startswith(last_sentence)  # one 7-token sentence fits in 8
        assert b.start < a.end


def test_overlap_falls_back_to_words_when_no_sentence_fits():
    text = " ".join(f"Long sentence {i} " + "word " * 20 + "end." for i in range(4))  # 25 tokens each
    chunks = chunk_document(DocId("d"), text, words, ChunkingConfig(size=40, overlap=5))
    assert len(chunks) >= 4
    for a, b in zip(chunks, chunks[1:]):
        shared = a.end - b.start
        assert shared > 0, "consecutive chunks should overlap"
        assert len(words(text[b.start : a.end])) <= 5
        assert len(b.token_ids) <= 40


def test_long_sentence_and_long_word_are_split():
    text = "Start. " + "alpha " * 100 + "x" * 500 + " end."
    tok = lambda s: re.findall(r"\w{1,10}|[^\w\s]", s)  # noqa: E731 - a 500-char word is 50 tokens
    chunks = chunk_document(DocId("d"), text, tok, ChunkingConfig(size=32, overlap=0))
    assert all(len(c.token_ids) <= 32 for c in chunks)
    assert all(text[c.start : c.end] == c.text for c in chunks)
    covered = "".join(c.text for c in chunks).replace(" ", "")
    assert covered == text.replace(" ", "")


def test_real_tokenizer_counts_and_exact_ids(tiny_lm):
    from ragkv.engine import Engine

    prompt = Engine(tiny_lm).prompt
    text = "Paris is the capital of France. " * 40 + "\n\nThe secret number is 4721. Alice met Bob."
    chunks = chunk_document(DocId("d"), text, prompt.chunk_ids, ChunkingConfig(size=64, overlap=8))
    assert len(chunks) > 3
    for c in chunks:
        assert len(c.token_ids) <= 64
        assert list(c.token_ids) == prompt.chunk_ids(c.text)  # what the server will compute
        assert text[c.start : c.end] == c.text


def test_ids_are_stable_and_depend_on_doc_and_content():
    cfg = ChunkingConfig(size=30, overlap=0)
    a = chunk_document(DocId("d"), SENTENCES, words, cfg)
    b = chunk_document(DocId("d"), SENTENCES, words, cfg)
    other_doc = chunk_document(DocId("e"), SENTENCES, words, cfg)
    edited = chunk_document(DocId("d"), SENTENCES.replace("number 29", "number 99"), words, cfg)
    assert [c.chunk_id for c in a] == [c.chunk_id for c in b]
    assert not {c.chunk_id for c in a} & {c.chunk_id for c in other_doc}
    assert [c.chunk_id for c in a[:-1]] == [c.chunk_id for c in edited[:-1]]  # unchanged chunks keep ids
    assert a[-1].chunk_id != edited[-1].chunk_id
    assert all(re.fullmatch(r"[0-9a-f]{32}", c.chunk_id) for c in a)


def test_repeated_passages_get_distinct_ids():
    text = "Same words here. " * 3
    chunks = chunk_document(DocId("d"), text, words, ChunkingConfig(size=4, overlap=0))
    assert [c.text for c in chunks] == ["Same words here."] * 3
    assert len({c.chunk_id for c in chunks}) == 3


def test_empty_document_has_no_chunks():
    assert chunk_document(DocId("d"), "  \n\n ", words, ChunkingConfig()) == []


@pytest.mark.parametrize("size,overlap", [(0, 0), (10, 10), (10, -1)])
def test_invalid_config_names_the_value(size, overlap):
    with pytest.raises(ValueError, match=str(overlap if size else size)):
        ChunkingConfig(size=size, overlap=overlap)
