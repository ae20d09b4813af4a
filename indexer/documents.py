"""Real documents: PDF, HTML and .docx files split into page or section documents.

Each PDF page, and each HTML or .docx section (the text under one heading), becomes one
`corpus.Document` whose metadata keeps where it came from: ``source`` (the file), and
``page`` (PDF, 1-based) or ``section`` (the heading text) with its ``section_index``.
A question's sources then name the page to open, and filters can select by them.

The parsers are maintained libraries in the optional ``ingest`` extra (pypdf,
beautifulsoup4, python-docx); they are imported only when such a file is met, and a
missing one is a CorpusError that names the extra.

Knows nothing of tokens, embeddings or KV.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ragkv.errors import CorpusError

EXTRA_HINT = "pip install 'ragkv[ingest]'"
_HEADINGS = ("h1", "h2", "h3")
_SPACES = re.compile(r"[ \t\r\f\v]+")
_BLANK_LINES = re.compile(r"\n\s*\n+")

# one page or section: (doc id suffix, text, metadata beyond "source")
Part = tuple[str, str, dict[str, Any]]


class IngestError(CorpusError):
    """A document cannot be read: a parser is missing, or the file is damaged."""


def _need(module: str, package: str, rel: str, kind: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise IngestError(
            f"{rel} is a {kind} file and reading it needs the {package!r} package of the ingest extra: "
            f"{EXTRA_HINT}"
        ) from None


def _clean(text: str) -> str:
    lines = (_SPACES.sub(" ", line).strip() for line in text.splitlines())
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def pdf_parts(path: Path, rel: str) -> list[Part]:
    """One part per PDF page with text: ``#page=N`` with metadata ``page`` (1-based)."""
    pypdf = _need("pypdf", "pypdf", rel, "PDF")
    try:
        reader = pypdf.PdfReader(str(path))
        pages = [(n, _clean(page.extract_text() or "")) for n, page in enumerate(reader.pages, start=1)]
    except Exception as exc:  # pypdf raises many types on damaged files; name the file
        raise IngestError(f"{rel}: cannot read the PDF ({type(exc).__name__}: {exc})") from exc
    total = len(pages)
    return [(f"#page={n}", text, {"page": n, "pages": total, "format": "pdf"}) for n, text in pages if text]


def _sections(blocks: Iterator[tuple[str | None, str]]) -> list[tuple[str | None, str]]:
    """Group (heading or None, text) blocks into (heading, text under it) sections."""
    sections: list[tuple[str | None, list[str]]] = [(None, [])]
    for heading, text in blocks:
        if heading is not None:
            sections.append((heading, [heading]))
        elif text:
            sections[-1][1].append(text)
    return [(h, _clean("\n\n".join(parts))) for h, parts in sections if _clean("\n\n".join(parts))]


def _section_parts(sections: list[tuple[str | None, str]], fmt: str, title: str | None) -> list[Part]:
    out = []
    for i, (heading, text) in enumerate(sections, start=1):
        meta: dict[str, Any] = {"section": heading or title or "", "section_index": i, "format": fmt}
        if title:
            meta["title"] = title
        out.append((f"#section={i}", text, meta))
    return out


def html_parts(path: Path, rel: str) -> list[Part]:
    """One part per HTML section (text under an h1-h3 heading): ``#section=N``."""
    bs4 = _need("bs4", "beautifulsoup4", rel, "HTML")
    raw = path.read_bytes()
    soup = bs4.BeautifulSoup(raw, "html.parser")
    for tag in soup(["script", "style", "noscript", "template", "svg", "nav", "footer"]):
        tag.decompose()
    title = _clean(soup.title.get_text(" ")) if soup.title else None
    if soup.title:
        soup.title.decompose()
    body = soup.body or soup

    def blocks() -> Iterator[tuple[str | None, str]]:
        for el in body.find_all([*_HEADINGS, "p", "li", "pre", "td", "th", "blockquote", "dd", "dt"]):
            if el.name in _HEADINGS:
                yield _clean(el.get_text(" ")), ""
            elif not el.find_parent(["p", "li", "pre", "td", "th", "blockquote", "dd", "dt"]):
                yield None, el.get_text("\n" if el.name == "pre" else " ")

    sections = _sections(blocks())
    if not sections:  # no block tags at all: the page's plain text
        text = _clean(body.get_text("\n"))
        sections = [(None, text)] if text else []
    return _section_parts(sections, "html", title)


def docx_parts(path: Path, rel: str) -> list[Part]:
    """One part per .docx section (paragraphs under a Heading/Title style): ``#section=N``."""
    docx = _need("docx", "python-docx", rel, ".docx")
    try:
        document = docx.Document(str(path))
    except Exception as exc:  # python-docx raises zip and XML errors on damaged files
        raise IngestError(f"{rel}: cannot read the .docx file ({type(exc).__name__}: {exc})") from exc
    title = (document.core_properties.title or "").strip() or None

    def blocks() -> Iterator[tuple[str | None, str]]:
        for p in document.paragraphs:
            style = (p.style.name if p.style is not None else "") or ""
            if style.startswith(("Heading", "Title")) and p.text.strip():
                yield _clean(p.text), ""
            else:
                yield None, p.text
        for table in document.tables:
            for row in table.rows:
                yield None, " | ".join(cell.text.strip() for cell in row.cells)

    return _section_parts(_sections(blocks()), "docx", title)


READERS: dict[str, Callable[[Path, str], list[Part]]] = {
    ".pdf": pdf_parts,
    ".html": html_parts,
    ".htm": html_parts,
    ".docx": docx_parts,
}
