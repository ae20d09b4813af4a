"""Shared by the indexer and retriever tests: a tiny corpus, tiny models, and index comparison."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np

TOPICS = {
    "animals.txt": (
        "Cats are small carnivorous mammals. They sleep for most of the day. "
        "Dogs were domesticated from wolves thousands of years ago. Dogs are loyal companions. "
        "Horses can sleep standing up. Elephants have excellent memory and live in herds."
    ),
    "cooking.md": (
        "# Bread\n\nBread is made from flour, water, salt and yeast. Knead the dough for ten minutes. "
        "Let it rise until it doubles in size.\n\nBake at a high temperature until the crust is brown. "
        "Sourdough uses a fermented starter instead of commercial yeast."
    ),
    "space.txt": (
        "Mars is the fourth planet from the Sun. It has two small moons named Phobos and Deimos. "
        "Jupiter is the largest planet in the solar system. Saturn has spectacular rings made of ice. "
        "A light year is the distance light travels in one year."
    ),
    "notes/needle.txt": (
        "Internal memo. The secret launch code of project Bluebird is 4721. "
        "Keep the Bluebird launch code confidential and never share it by email."
    ),
}
JSONL = [
    {"id": "faq-1", "text": "To reset your password, open settings and choose reset. A link arrives by email.",
     "metadata": {"lang": "en", "kind": "faq"}},
    {"id": "faq-2", "text": "Invoices are sent on the first day of each month. Payment is due within thirty days.",
     "metadata": {"lang": "en", "kind": "faq"}},
]
NEEDLE_QUESTION = "What is the launch code of project Bluebird?"
CHUNK_SIZE = 48  # tokens: the tiny tokenizer has 400 tokens, so a few sentences per chunk
OVERLAP = 8


def write_corpus(root: Path, topics: dict[str, str] = TOPICS, jsonl: list[dict] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in topics.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, "utf-8")
    rows = JSONL if jsonl is None else jsonl
    if rows:
        (root / "faq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    return root


def dump_index(index_dir: Path) -> dict:
    """Everything an index holds that must not depend on how it was built (crashes, shards)."""
    conn = sqlite3.connect(f"file:{index_dir / 'chunks.sqlite'}?mode=ro", uri=True)
    try:
        docs = conn.execute("SELECT doc_id, content_hash, source, n_chunks FROM documents ORDER BY doc_id").fetchall()
        chunks = conn.execute(
            "SELECT row, chunk_id, doc_id, ordinal, text, metadata, token_ids, n_tokens, kv_key, kv_done "
            "FROM chunks ORDER BY row").fetchall()
        emb = conn.execute("SELECT embedding FROM chunks ORDER BY row").fetchall()
    finally:
        conn.close()
    vectors = np.stack([np.frombuffer(e, dtype="<f4") for (e,) in emb]) if emb else np.zeros((0, 0))
    manifest = json.loads((index_dir / "manifest.json").read_text())
    for volatile in ("created_at", "updated_at", "kv_uris", "shard", "faiss_sha256"):  # the checksum: of bytes built apart
        manifest.pop(volatile)
    return {"documents": docs, "chunks": chunks, "vectors": vectors, "manifest": manifest}


def assert_same_index(a: Path, b: Path) -> None:
    da, db = dump_index(a), dump_index(b)
    assert da["manifest"] == db["manifest"]
    assert da["documents"] == db["documents"]
    assert da["chunks"] == db["chunks"]
    np.testing.assert_allclose(da["vectors"], db["vectors"], atol=1e-5)


def kv_files(kv_dir: Path) -> set[str]:
    return {p.name for p in kv_dir.rglob("*.safetensors")}


def index_chunks(index_dir: Path) -> list:
    """Every chunk record (`ChunkRecord`) of the index at `index_dir`, read-only."""
    from ragkv.retriever.chunk_db import ChunkDB

    db = ChunkDB.open(index_dir, readonly=True)
    try:
        return list(db.iter_chunks())
    finally:
        db.close()
