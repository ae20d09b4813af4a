"""PDF, HTML and .docx documents: one document per page or section, each naming its source and page.

The tests write their own files: PDFs by hand (a few objects and a text stream), .docx with
python-docx, HTML as text.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest

from ragkv.indexer.corpus import CorpusError, load_corpus
from ragkv.types import SearchMode


def write_pdf(path: Path, pages: list[str]) -> Path:
    """A minimal valid PDF, one line of Helvetica text per page."""
    streams = []
    for text in pages:
        escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1")
        streams.append(b"BT /F1 12 Tf 72 720 Td (" + escaped + b") Tj ET")
    return write_pdf_streams(path, streams)


def write_pdf_streams(path: Path, contents: list[bytes], flate: bool = False) -> Path:
    """A minimal valid PDF whose pages' content streams are `contents`, Flate-compressed when
    `flate` (small on disk, large once inflated)."""
    n = len(contents)
    font = 3 + 2 * n
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(n))
               + b"] /Count %d >>" % n]
    for i, content in enumerate(contents):
        stream = zlib.compress(content, 9) if flate else content
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 %d 0 R >> >> >>" % (4 + 2 * i, font))
        objects.append(b"<< /Length %d%s >>\nstream\n" % (len(stream), b" /Filter /FlateDecode" if flate else b"")
                       + stream + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(bytes(out))
    return path


HTML = """<!doctype html><html><head><title>Field guide</title><style>p {color: red}</style></head>
<body><nav>Home | About</nav><p>Intro text before any heading.</p>
<h1>Owls</h1><p>Owls hunt at night.</p><ul><li>Barn owl</li><li>Snowy owl</li></ul>
<h2>Hawks</h2><p>Hawks hunt by day.</p><script>var secret = "not text";</script>
</body></html>"""


def test_pdf_pages_keep_source_and_page(tmp_path: Path) -> None:
    write_pdf(tmp_path / "report.pdf", ["The launch code is 4721.", "", "Bluebird ships in May."])
    docs = load_corpus(tmp_path).documents
    assert [d.doc_id for d in docs] == ["report.pdf#page=1", "report.pdf#page=3"]  # the blank page has no text
    assert "4721" in docs[0].text and "Bluebird ships in May." in docs[1].text
    assert docs[1].metadata == {"source": "report.pdf", "page": 3, "pages": 3, "format": "pdf"}


def test_html_sections_keep_heading_and_title(tmp_path: Path) -> None:
    (tmp_path / "guide.html").write_text(HTML)
    docs = load_corpus(tmp_path).documents
    by_section = {d.metadata["section"]: d for d in docs}
    assert set(by_section) == {"Field guide", "Owls", "Hawks"}  # text before a heading goes under the title
    owls = by_section["Owls"]
    assert owls.text.startswith("Owls") and "Owls hunt at night." in owls.text and "Snowy owl" in owls.text
    assert owls.metadata["source"] == "guide.html" and owls.metadata["title"] == "Field guide"
    assert owls.doc_id == f"guide.html#section={owls.metadata['section_index']}"
    everything = " ".join(d.text for d in docs)
    assert "not text" not in everything and "color: red" not in everything and "Home | About" not in everything


def test_docx_sections(tmp_path: Path) -> None:
    import docx

    document = docx.Document()
    document.add_heading("Setup", level=1)
    document.add_paragraph("Install the package first.")
    document.add_heading("Usage", level=1)
    document.add_paragraph("Run ragkv index on the folder.")
    document.save(str(tmp_path / "manual.docx"))
    docs = load_corpus(tmp_path).documents
    assert [(d.metadata["section"], d.text) for d in docs] == [
        ("Setup", "Setup\n\nInstall the package first."), ("Usage", "Usage\n\nRun ragkv index on the folder.")]
    assert all(d.metadata["source"] == "manual.docx" for d in docs)


def test_missing_parser_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_pdf(tmp_path / "a.pdf", ["text"])
    monkeypatch.setitem(sys.modules, "pypdf", None)  # import pypdf now raises ImportError, as when not installed
    with pytest.raises(CorpusError) as info:
        load_corpus(tmp_path)
    assert "a.pdf" in str(info.value) and "ragkv[ingest]" in str(info.value) and "pypdf" in str(info.value)


def test_damaged_pdf_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\nthis is not a pdf")
    with pytest.raises(CorpusError, match="broken.pdf"):
        load_corpus(tmp_path)


def test_pdf_and_html_index_and_search_with_page_metadata(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from ragkv.indexer.job import IndexJobConfig, run_index
    from ragkv.retriever import Retriever

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_pdf(corpus / "memo.pdf", ["Cats sleep most of the day.", "The Bluebird launch code is 4721."])
    (corpus / "guide.html").write_text(HTML)
    run_index(IndexJobConfig(corpus=corpus, out=tmp_path / "index", model=str(tiny_llama_dir), progress=False,
                             precompute_kv=False))
    retriever = Retriever.open(tmp_path / "index")
    try:
        hits = retriever.search("Bluebird launch code", 1, mode=SearchMode.LEXICAL)
    finally:
        retriever.close()
    assert hits[0].metadata["source"] == "memo.pdf" and hits[0].metadata["page"] == 2
    assert "4721" in hits[0].text
