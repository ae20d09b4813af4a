"""Reading a corpus folder: ``.txt`` and ``.md`` files are one document each, ``.jsonl``
files hold one ``{"id", "text", "metadata"}`` document per line, and PDF, HTML and .docx
files one document per page or section (indexer/documents.py, the ``ingest`` extra).
Other files are named in ``Corpus.skipped`` and left out.

Knows nothing of tokens, embeddings or KV.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragkv.errors import CorpusError
from ragkv.retriever.records import ContentHash, DocId, content_hash


class DocFormat(enum.Enum):
    """File formats the indexer reads."""

    TEXT = ".txt"  # one document, id = relative path
    MARKDOWN = ".md"  # one document, id = relative path
    JSONL = ".jsonl"  # one document per line, id = its "id" field
    PDF = ".pdf"  # one document per page, id = path#page=N (the ingest extra)
    HTML = ".html"  # one document per section under a heading, id = path#section=N
    HTM = ".htm"  # as HTML
    DOCX = ".docx"  # one document per section under a heading style, id = path#section=N


@dataclass(frozen=True, slots=True)
class Document:
    """One document to index."""

    doc_id: DocId  # relative path for .txt/.md, the "id" field for .jsonl lines, path#page=N / #section=N
    text: str  # the full text
    metadata: Mapping[str, Any]  # {"source": path} plus a JSONL line's own "metadata", or page / section
    source: str  # corpus-relative path of the file, with ":LINE" for JSONL
    content_hash: ContentHash  # hash of text + metadata: what decides "changed"


@dataclass(frozen=True, slots=True)
class Corpus:
    """The documents of a corpus folder, sorted by id."""

    root: Path  # the corpus folder
    documents: tuple[Document, ...]  # sorted by doc_id
    skipped: tuple[str, ...]  # relative paths of files in no DocFormat


def load_corpus(root: str | Path) -> Corpus:
    """Read every document under ``root`` (recursively; hidden files and folders are skipped).

    Raises:
        CorpusError: ``root`` is missing or not a folder, holds no document, a JSONL
            line is malformed, or two documents share an id.
    """
    root = Path(root)
    if not root.exists():
        raise CorpusError(f"corpus {root} does not exist: give a folder of .txt, .md, .jsonl, .pdf, .html or .docx files")
    if not root.is_dir():
        raise CorpusError(f"corpus {root} is not a folder: give a folder of .txt, .md, .jsonl, .pdf, .html or .docx files")
    formats = {f.value: f for f in DocFormat}
    docs: dict[DocId, Document] = {}
    skipped: list[str] = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        fmt = formats.get(path.suffix.lower())
        if fmt is None:
            skipped.append(rel.as_posix())
            continue
        for doc in _read_file(path, rel.as_posix(), fmt):
            if doc.doc_id in docs:
                raise CorpusError(
                    f"document id {doc.doc_id!r} appears twice ({docs[doc.doc_id].source} and "
                    f"{doc.source}): give each document a unique id"
                )
            docs[doc.doc_id] = doc
    if not docs:
        extra = f" (skipped: {', '.join(skipped[:5])})" if skipped else ""
        raise CorpusError(f"corpus {root} holds no .txt, .md, .jsonl, .pdf, .html or .docx document{extra}")
    return Corpus(root, tuple(docs[k] for k in sorted(docs)), tuple(skipped))


def _read_file(path: Path, rel: str, fmt: DocFormat) -> list[Document]:
    if fmt in (DocFormat.PDF, DocFormat.HTML, DocFormat.HTM, DocFormat.DOCX):
        from ragkv.indexer.documents import READERS

        out = []
        for suffix, text, extra in READERS[fmt.value](path, rel):
            meta = {"source": rel, **extra}
            out.append(Document(DocId(rel + suffix), text, meta, rel + suffix, content_hash(text, meta)))
        return out
    from ragkv.indexer.documents import check_plain_file

    check_plain_file(path, rel)  # a text file is read whole: bounded first
    try:
        raw = path.read_text("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{rel} is not UTF-8 text ({exc}): convert it or move it out") from exc
    if fmt is not DocFormat.JSONL:
        meta = {"source": rel}
        return [Document(DocId(rel), raw, meta, rel, content_hash(raw, meta))]
    out = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{rel}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{where} is not valid JSON ({exc.msg}): fix or remove the line") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), (str, int)) \
                or not isinstance(obj.get("text"), str):
            raise CorpusError(
                f'{where} needs an object with a string or int "id" and a string "text", '
                f'got keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}'
            )
        user_meta = obj.get("metadata") or {}
        if not isinstance(user_meta, dict):
            raise CorpusError(f'{where}: "metadata" must be an object, got {type(user_meta).__name__}')
        meta = {"source": rel, **user_meta}
        out.append(Document(DocId(str(obj["id"])), obj["text"], meta, where, content_hash(obj["text"], meta)))
    return out
