"""Hostile files in a corpus (indexer/documents.py, indexer/sandbox.py): what an attacker who
can drop a file into the corpus folder may try, and the refusal each meets.

Each refusal is a CorpusError naming the file, the limit and the RAGKV_INGEST_* variable that
raises it; the parsers run in a child process, so a parser that runs away costs the indexer
neither its memory nor more than the time limit.
"""

from __future__ import annotations

import time
import zipfile
from pathlib import Path

import pytest

from ragkv.indexer.corpus import CorpusError, load_corpus
from tests.indexer.test_documents import write_pdf, write_pdf_streams

MIB = 1 << 20


def _refused(corpus: Path, *needles: str) -> str:
    with pytest.raises(CorpusError) as info:
        load_corpus(corpus)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "huge.pdf", ["Cats sleep."])
    with pdf.open("r+b") as f:
        f.truncate(65 * MIB)  # 65 MiB on disk (sparse: zeros after %%EOF)
    t0 = time.perf_counter()
    _refused(tmp_path, "huge.pdf", "the file is 65 MiB", "limit of 64 MiB", "RAGKV_INGEST_MAX_FILE_MIB=256")
    assert time.perf_counter() - t0 < 5


def test_the_file_size_limit_can_be_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_pdf(tmp_path / "memo.pdf", ["Cats sleep most of the day. " * 40])
    monkeypatch.setenv("RAGKV_INGEST_MAX_FILE_MIB", "0.001")  # about 1 KB
    _refused(tmp_path, "memo.pdf", "limit of 1,048 bytes", "RAGKV_INGEST_MAX_FILE_MIB=1")
    monkeypatch.setenv("RAGKV_INGEST_MAX_FILE_MIB", "1")
    assert [d.doc_id for d in load_corpus(tmp_path).documents] == ["memo.pdf#page=1"]


def test_a_pdf_over_the_page_limit_is_refused(tmp_path: Path) -> None:
    write_pdf(tmp_path / "pages.pdf", ["p"] * 2001)
    _refused(tmp_path, "pages.pdf", "2,001 pages", "limit of 2,000", "RAGKV_INGEST_MAX_PAGES")


def test_the_page_limit_can_be_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_pdf(tmp_path / "three.pdf", ["one", "two", "three"])
    monkeypatch.setenv("RAGKV_INGEST_MAX_PAGES", "2")
    _refused(tmp_path, "three.pdf", "3 pages", "limit of 2", "RAGKV_INGEST_MAX_PAGES")
    monkeypatch.setenv("RAGKV_INGEST_MAX_PAGES", "3")
    assert len(load_corpus(tmp_path).documents) == 3


def test_a_pdf_whose_streams_inflate_past_the_text_limit_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """8 KB on disk, 1.7 MB of text once its compressed content streams are inflated."""
    line = b"BT /F1 12 Tf 72 720 Td (" + b"All work and no play. " * 20 + b") Tj ET\n"
    pdf = write_pdf_streams(tmp_path / "inflates.pdf", [line * (600_000 // len(line))] * 3, flate=True)
    assert pdf.stat().st_size < 20_000
    monkeypatch.setenv("RAGKV_INGEST_MAX_TEXT_MIB", "1")
    _refused(tmp_path, "inflates.pdf", "its text reaches", "limit of 1 MiB", "RAGKV_INGEST_MAX_TEXT_MIB")


def _docx(path: Path, paragraphs: list[str]) -> Path:
    import docx

    document = docx.Document()
    document.add_heading("Report", level=1)
    for text in paragraphs:
        document.add_paragraph(text)
    document.save(str(path))
    return path


def test_a_zip_bomb_docx_is_refused_before_it_is_unzipped(tmp_path: Path) -> None:
    """A .docx is a zip: one part of 300 MiB of zeros is 300 KB compressed."""
    bomb = _docx(tmp_path / "bomb.docx", ["Quarterly numbers."])
    with zipfile.ZipFile(bomb, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("word/media/image1.png", "w") as part:
            zeros = bytes(MIB)
            for _ in range(300):
                part.write(zeros)
    assert bomb.stat().st_size < 2 * MIB
    _refused(tmp_path, "bomb.docx", "unzips to 300.", "limit of 256 MiB", "RAGKV_INGEST_MAX_UNZIPPED_MIB")


def test_a_docx_past_the_text_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _docx(tmp_path / "long.docx", ["All work and no play. " * 40_000] * 2)  # 1.7 MB of text
    monkeypatch.setenv("RAGKV_INGEST_MAX_TEXT_MIB", "1")
    _refused(tmp_path, "long.docx", "its text reaches", "limit of 1 MiB", "RAGKV_INGEST_MAX_TEXT_MIB")


def _slow_html(path: Path, tags: int) -> Path:
    path.write_text("<html><body>" + "<p>x</p>" * tags + "</body></html>")
    return path


def test_a_parser_past_its_time_limit_is_stopped_and_the_next_file_reads(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """About 1.5 MB of tags: seconds of html.parser; the parse is stopped at the limit."""
    bad = tmp_path / "bad"
    bad.mkdir()
    _slow_html(bad / "slow.html", 190_000)
    monkeypatch.setenv("RAGKV_INGEST_TIMEOUT_S", "0.25")
    t0 = time.perf_counter()
    _refused(bad, "slow.html", "took over 0.25 s", "RAGKV_INGEST_TIMEOUT_S")
    assert time.perf_counter() - t0 < 5  # the start of the parser process and the limit, not the parse
    monkeypatch.delenv("RAGKV_INGEST_TIMEOUT_S")
    good = tmp_path / "good"
    good.mkdir()
    write_pdf(good / "memo.pdf", ["Bluebird ships in May."])
    assert "Bluebird" in load_corpus(good).documents[0].text  # a fresh parser process


def test_a_parser_past_its_memory_limit_fails_the_file_not_the_indexer(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """About 600 KB of tags become a tree of well over 100 MB in html.parser: past a 100 MiB
    address space (the parser process's Python and parsers take about a third of it)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    _slow_html(bad / "big.html", 75_000)
    monkeypatch.setenv("RAGKV_INGEST_MEMORY_MIB", "100")
    _refused(bad, "big.html", "out of memory", "limit of 100 MiB", "RAGKV_INGEST_MEMORY_MIB=400")
    good = tmp_path / "good"
    good.mkdir()
    _slow_html(good / "small.html", 10)
    assert load_corpus(good).documents  # a fresh parser process, under the same limit


def test_many_small_documents_share_one_parser_process(tmp_path: Path) -> None:
    from ragkv.indexer.sandbox import SANDBOX

    for i in range(12):
        write_pdf(tmp_path / f"memo{i}.pdf", [f"Memo {i}."])
        (tmp_path / f"page{i}.html").write_text(f"<h1>Page {i}</h1><p>Text {i}.</p>")
    load_corpus(tmp_path)  # the process is up
    started = SANDBOX.started
    t0 = time.perf_counter()
    docs = load_corpus(tmp_path).documents
    assert len(docs) == 24 and SANDBOX.started == started
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("name", ["big.txt", "big.md", "big.jsonl"])
def test_a_plain_text_file_over_its_limit_is_refused_before_it_is_read(tmp_path: Path, name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "ok.txt").write_text("a small document")
    with (corpus / name).open("wb") as f:  # 3 MiB, sparse: no 3 MiB is written or read
        f.seek(3 * 2**20 - 1)
        f.write(b"\n")
    monkeypatch.setenv("RAGKV_INGEST_MAX_PLAIN_FILE_MIB", "2")
    with pytest.raises(CorpusError, match=rf"{name}: the file is 3 MiB, over the limit of 2 MiB "
                                          r"\(RAGKV_INGEST_MAX_PLAIN_FILE_MIB\)"):
        load_corpus(corpus)
    monkeypatch.setenv("RAGKV_INGEST_MAX_PLAIN_FILE_MIB", "4")
    if name != "big.jsonl":  # (a JSONL line of zeros is no JSON object: refused for that instead)
        assert len(load_corpus(corpus).documents) == 2
