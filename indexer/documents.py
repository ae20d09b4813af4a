"""Real documents: PDF, HTML and .docx files split into page or section documents.

Each PDF page, and each HTML or .docx section (the text under one heading), becomes one
`corpus.Document` whose metadata keeps where it came from: ``source`` (the file), and
``page`` (PDF, 1-based) or ``section`` (the heading text) with its ``section_index``.
A question's sources then name the page to open, and filters can select by them.

The parsers are maintained libraries in the optional ``ingest`` extra (pypdf,
beautifulsoup4, python-docx); they are imported only when such a file is met, and a
missing one is a CorpusError that names the extra.

A corpus may hold files from anyone, so reading one is bounded (`IngestLimits`): a file
past MAX_FILE_MIB, a PDF past MAX_PAGES pages, a .docx whose parts unzip past
MAX_UNZIPPED_MIB (a zip bomb), or text past MAX_TEXT_MIB (a PDF's compressed streams) is
refused before or while it is parsed. The parsers run in a child process (indexer/sandbox.py,
reused across files) under a time limit (TIMEOUT_S) and an address-space cap (MEMORY_MIB).
Each refusal is an IngestError (a CorpusError: the index run stops, as for a damaged file)
naming the file, the limit and the environment variable that raises it (RAGKV_INGEST_*).

Knows nothing of tokens, embeddings or KV.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ragkv.errors import CorpusError
from ragkv.indexer.sandbox import SANDBOX, SandboxError, SandboxOverrun

EXTRA_HINT = "pip install 'ragkv[ingest]'"
MIB = 1 << 20
MAX_FILE_MIB = 64  # a PDF, HTML or .docx file's size on disk
MAX_PAGES = 2_000  # a PDF's pages
MAX_TEXT_MIB = 32  # the text one file gives (UTF-8), all its pages or sections together
MAX_UNZIPPED_MIB = 256  # a .docx's parts once unzipped (XML, images)
TIMEOUT_S = 120.0  # parsing one file
MEMORY_MIB = 2_048  # the parser process's address space
MAX_PLAIN_FILE_MIB = 1_024  # a .txt, .md or .jsonl file's size on disk (read whole into memory)
_HEADINGS = ("h1", "h2", "h3")
_SPACES = re.compile(r"[ \t\r\f\v]+")
_BLANK_LINES = re.compile(r"\n\s*\n+")

# one page or section: (doc id suffix, text, metadata beyond "source")
Part = tuple[str, str, dict[str, Any]]


class IngestError(CorpusError):
    """A document cannot be read: a parser is missing, the file is damaged, or it is over a limit."""


@dataclass(frozen=True)
class IngestLimits:
    """How much reading one PDF, HTML or .docx file may take; `from_env` reads RAGKV_INGEST_*."""

    max_file_bytes: int = MAX_FILE_MIB * MIB
    max_pages: int = MAX_PAGES
    max_text_bytes: int = MAX_TEXT_MIB * MIB
    max_unzipped_bytes: int = MAX_UNZIPPED_MIB * MIB
    timeout_s: float = TIMEOUT_S
    memory_bytes: int = MEMORY_MIB * MIB
    max_plain_file_bytes: int = MAX_PLAIN_FILE_MIB * MIB  # .txt, .md, .jsonl: no parser, just their size

    @classmethod
    def from_env(cls) -> IngestLimits:
        """The defaults, each replaced by its environment variable where set (`ENV`).

        Raises:
            IngestError: A variable is not a positive number.
        """
        values: dict[str, Any] = {}
        for field, (var, scale) in ENV.items():
            raw = os.environ.get(var, "").strip()
            if not raw:
                continue
            try:
                value = float(raw) * scale
            except ValueError:
                value = 0.0
            if not value > 0:
                raise IngestError(f"{var}={raw!r} must be a positive number")
            values[field] = value if field == "timeout_s" else int(value)
        return cls(**values)


ENV: dict[str, tuple[str, int]] = {  # IngestLimits field -> (environment variable, its unit in the field's)
    "max_file_bytes": ("RAGKV_INGEST_MAX_FILE_MIB", MIB),
    "max_pages": ("RAGKV_INGEST_MAX_PAGES", 1),
    "max_text_bytes": ("RAGKV_INGEST_MAX_TEXT_MIB", MIB),
    "max_unzipped_bytes": ("RAGKV_INGEST_MAX_UNZIPPED_MIB", MIB),
    "timeout_s": ("RAGKV_INGEST_TIMEOUT_S", 1),
    "memory_bytes": ("RAGKV_INGEST_MEMORY_MIB", MIB),
    "max_plain_file_bytes": ("RAGKV_INGEST_MAX_PLAIN_FILE_MIB", MIB),
}


def check_plain_file(path: Path, rel: str, limits: IngestLimits | None = None) -> None:
    """Refuse a .txt, .md or .jsonl file past `max_plain_file_bytes` before it is read (whole)."""
    limits = limits or IngestLimits.from_env()
    size = path.stat().st_size
    if size > limits.max_plain_file_bytes:
        raise _over(rel, f"the file is {_size(size)}", "max_plain_file_bytes", limits)


def _over(rel: str, what: str, field: str, limits: IngestLimits) -> IngestError:
    """The refusal of a file over one limit: the file, the limit, and how to raise it."""
    var, scale = ENV[field]
    limit = getattr(limits, field)
    if scale == MIB:
        shown, bigger = _size(limit), f"{max(1, math.ceil(4 * limit / MIB))}"
    elif field == "timeout_s":
        shown, bigger = f"{limit:g} s", f"{max(1, math.ceil(4 * limit))}"
    else:
        shown, bigger = f"{limit:,}", f"{4 * limit}"
    return IngestError(f"{rel}: {what}, over the limit of {shown} ({var}): if the file is trusted, raise it "
                       f"(e.g. {var}={bigger}), else move the file out of the corpus")


def _size(n: int) -> str:
    if n % MIB == 0:
        return f"{n // MIB} MiB"
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n:,} bytes"


class _TextBudget:
    """Counts the text a file gives and refuses it past ``max_text_bytes``."""

    def __init__(self, rel: str, limits: IngestLimits) -> None:
        self.rel, self.limits, self.used = rel, limits, 0

    def take(self, text: str) -> str:
        self.used += len(text.encode("utf-8", "surrogatepass"))
        if self.used > self.limits.max_text_bytes:
            raise _over(self.rel, f"its text reaches {_size(self.used)}", "max_text_bytes", self.limits)
        return text


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


def pdf_parts(path: Path, rel: str, limits: IngestLimits | None = None) -> list[Part]:
    """One part per PDF page with text: ``#page=N`` with metadata ``page`` (1-based).

    In this process: `READERS` runs it in the parser process.
    """
    limits = limits or IngestLimits.from_env()
    pypdf = _need("pypdf", "pypdf", rel, "PDF")
    budget = _TextBudget(rel, limits)
    try:
        reader = pypdf.PdfReader(str(path))
        total = len(reader.pages)
        if total > limits.max_pages:
            raise _over(rel, f"the PDF has {total:,} pages", "max_pages", limits)
        pages = [(n, _clean(budget.take(page.extract_text() or ""))) for n, page in enumerate(reader.pages, start=1)]
    except (IngestError, MemoryError):  # a MemoryError is the parser process's memory limit
        raise
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


def html_parts(path: Path, rel: str, limits: IngestLimits | None = None) -> list[Part]:
    """One part per HTML section (text under an h1-h3 heading): ``#section=N``.

    In this process: `READERS` runs it in the parser process.
    """
    limits = limits or IngestLimits.from_env()
    bs4 = _need("bs4", "beautifulsoup4", rel, "HTML")
    budget = _TextBudget(rel, limits)
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
                yield budget.take(_clean(el.get_text(" "))), ""
            elif not el.find_parent(["p", "li", "pre", "td", "th", "blockquote", "dd", "dt"]):
                yield None, budget.take(el.get_text("\n" if el.name == "pre" else " "))

    sections = _sections(blocks())
    if not sections:  # no block tags at all: the page's plain text
        text = _clean(budget.take(body.get_text("\n")))
        sections = [(None, text)] if text else []
    return _section_parts(sections, "html", title)


def docx_parts(path: Path, rel: str, limits: IngestLimits | None = None) -> list[Part]:
    """One part per .docx section (paragraphs under a Heading/Title style): ``#section=N``.

    In this process: `READERS` runs it in the parser process.
    """
    import zipfile

    limits = limits or IngestLimits.from_env()
    docx = _need("docx", "python-docx", rel, ".docx")
    budget = _TextBudget(rel, limits)
    try:
        with zipfile.ZipFile(path) as archive:  # the sizes it declares bound what zipfile unzips
            unzipped = sum(info.file_size for info in archive.infolist())
        if unzipped > limits.max_unzipped_bytes:
            raise _over(rel, f"the .docx unzips to {_size(unzipped)}", "max_unzipped_bytes", limits)
        document = docx.Document(str(path))
    except (IngestError, MemoryError):  # a MemoryError is the parser process's memory limit
        raise
    except Exception as exc:  # python-docx raises zip and XML errors on damaged files
        raise IngestError(f"{rel}: cannot read the .docx file ({type(exc).__name__}: {exc})") from exc
    title = (document.core_properties.title or "").strip() or None

    def blocks() -> Iterator[tuple[str | None, str]]:
        for p in document.paragraphs:
            style = (p.style.name if p.style is not None else "") or ""
            text = budget.take(p.text)
            if style.startswith(("Heading", "Title")) and text.strip():
                yield _clean(text), ""
            else:
                yield None, text
        for table in document.tables:
            for row in table.rows:
                yield None, budget.take(" | ".join(cell.text.strip() for cell in row.cells))

    return _section_parts(_sections(blocks()), "docx", title)


_PARSERS: dict[str, tuple[Callable[..., list[Part]], str, str, str]] = {  # suffix -> parser, module, package, kind
    ".pdf": (pdf_parts, "pypdf", "pypdf", "PDF"),
    ".html": (html_parts, "bs4", "beautifulsoup4", "HTML"),
    ".htm": (html_parts, "bs4", "beautifulsoup4", "HTML"),
    ".docx": (docx_parts, "docx", "python-docx", ".docx"),
}


def read_parts(path: Path, rel: str, limits: IngestLimits | None = None) -> list[Part]:
    """A PDF, HTML or .docx file's parts, parsed in the parser process under ``limits``.

    Args:
        limits: None: `IngestLimits.from_env()` (the defaults, or RAGKV_INGEST_*).

    Raises:
        IngestError: Its parser is not installed, the file is damaged, or it is over a limit:
            its size, pages, unzipped size or text, the parse's time or memory.
    """
    limits = limits or IngestLimits.from_env()
    suffix = path.suffix.lower()
    _, module, package, kind = _PARSERS[suffix]
    size = path.stat().st_size
    if size > limits.max_file_bytes:
        raise _over(rel, f"the file is {_size(size)}", "max_file_bytes", limits)
    try:
        installed = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        _need(module, package, rel, kind)  # raises the error naming the extra
    try:
        parts = SANDBOX.call(f"{__name__}:_parse", [suffix, str(path), rel, dataclasses.asdict(limits)],
                             timeout_s=limits.timeout_s, memory_bytes=limits.memory_bytes,
                             max_reply_bytes=8 * limits.max_text_bytes + MIB)
    except SandboxError as exc:
        raise IngestError(str(exc) if exc.kind == "IngestError" else
                          f"{rel}: cannot read the {kind} file ({exc.kind}: {exc})") from None
    except SandboxOverrun as exc:
        if exc.reason == "time":
            raise _over(rel, f"parsing it took over {limits.timeout_s:g} s", "timeout_s", limits) from None
        raise _over(rel, f"parsing it ran out of memory ({exc})", "memory_bytes", limits) from None
    return [(suffix_, text, meta) for suffix_, text, meta in parts]


def _parse(suffix: str, path: str, rel: str, limits: dict[str, Any]) -> list[Part]:
    """In the parser process: a file's parts (`read_parts`)."""
    return _PARSERS[suffix][0](Path(path), rel, IngestLimits(**limits))


READERS: dict[str, Callable[[Path, str], list[Part]]] = {
    ".pdf": read_parts,
    ".html": read_parts,
    ".htm": read_parts,
    ".docx": read_parts,
}
"""Each format's reader: its parts, parsed in the parser process under `IngestLimits.from_env()`."""
