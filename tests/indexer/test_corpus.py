"""Reading corpora: formats, skipped files, and clear errors."""

from __future__ import annotations

import pytest

from ragkv.indexer.corpus import CorpusError, load_corpus
from tests.indexer.helpers import write_corpus


def test_reads_txt_md_jsonl_and_names_skipped_files(tmp_path):
    root = write_corpus(tmp_path / "c")
    (root / "image.png").write_bytes(b"\x89PNG")
    (root / ".hidden.txt").write_text("ignored")
    corpus = load_corpus(root)
    ids = [d.doc_id for d in corpus.documents]
    assert ids == sorted(ids)
    assert set(ids) == {"animals.txt", "cooking.md", "space.txt", "notes/needle.txt", "faq-1", "faq-2"}
    assert corpus.skipped == ("image.png",)
    faq = next(d for d in corpus.documents if d.doc_id == "faq-1")
    assert faq.metadata == {"lang": "en", "kind": "faq", "source": "faq.jsonl"}
    assert faq.source == "faq.jsonl:1"


def test_content_hash_tracks_text_and_metadata(tmp_path):
    root = write_corpus(tmp_path / "c")
    before = {d.doc_id: d.content_hash for d in load_corpus(root).documents}
    (root / "space.txt").write_text("Changed.")
    after = {d.doc_id: d.content_hash for d in load_corpus(root).documents}
    assert [k for k in before if before[k] != after[k]] == ["space.txt"]


def test_missing_and_empty_corpus(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.bin").write_bytes(b"\x00\x01")  # PDF, HTML and .docx are read now
    with pytest.raises(CorpusError, match=r"holds no \.txt.*skipped: a\.bin"):
        load_corpus(tmp_path / "empty")


@pytest.mark.parametrize("line,match", [
    ("{not json", "faq.jsonl:1 is not valid JSON"),
    ('{"text": "no id"}', 'needs an object with a string or int "id"'),
    ('{"id": 1, "text": "x", "metadata": [1]}', '"metadata" must be an object'),
])
def test_bad_jsonl_lines_name_the_line(tmp_path, line, match):
    root = tmp_path / "c"
    root.mkdir()
    (root / "faq.jsonl").write_text(line + "\n")
    with pytest.raises(CorpusError, match=match):
        load_corpus(root)


def test_duplicate_ids_are_an_error(tmp_path):
    root = write_corpus(tmp_path / "c", topics={}, jsonl=[{"id": "a", "text": "x"}, {"id": "a", "text": "y"}])
    with pytest.raises(CorpusError, match="'a' appears twice"):
        load_corpus(root)
