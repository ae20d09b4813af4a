"""The chunk database: chunk text, metadata, token ids, embeddings and progress, in SQLite.

One file, ``chunks.sqlite``, beside the FAISS index. The indexer writes it in
small transactions (one per batch), so a crash or ``kill -9`` loses at most the
batch in flight and never leaves a half-written row. The FAISS index stores each
chunk's ``row`` (SQLite rowid) as its id, so search results map straight back here.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ragkv.retriever.records import ChunkId, ChunkRecord, ContentHash, DocId, DocumentRecord

if TYPE_CHECKING:  # kvstore pulls torch in; `ragkv index --help` must not
    from ragkv.kvstore import ChunkKey

DB_NAME = "chunks.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    doc_id TEXT PRIMARY KEY,
    content_hash TEXT NOT NULL,
    source TEXT NOT NULL,
    n_chunks INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    row INTEGER PRIMARY KEY,          -- the FAISS id of this chunk
    chunk_id TEXT NOT NULL UNIQUE,
    doc_id TEXT NOT NULL REFERENCES documents(doc_id) ON DELETE CASCADE,
    ordinal INTEGER NOT NULL,
    text TEXT NOT NULL,
    metadata TEXT NOT NULL,           -- JSON object
    token_ids BLOB NOT NULL,          -- int32 little-endian [T]
    n_tokens INTEGER NOT NULL,
    kv_key TEXT NOT NULL,
    embedding BLOB,                   -- float32 [dim], NULL until embedded
    kv_done INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id, ordinal);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS neighbours (  -- neighbour-conditioned KV: what each chunk was computed after
    row INTEGER PRIMARY KEY REFERENCES chunks(row) ON DELETE CASCADE,
    rows TEXT NOT NULL                -- JSON list of its neighbours' rows, most similar first
);
CREATE TABLE IF NOT EXISTS calibrated_keys (  -- the chunks' KV keys when the calibration was measured
    kv_key TEXT PRIMARY KEY
);
"""

# meta keys
_VECTORS_VERSION = "vectors_version"  # bumped whenever the set of chunks or embeddings changes
_FAISS_VERSION = "faiss_version"  # the vectors_version the FAISS file on disk was built from
_LEXICAL_VERSION = "lexical_version"  # the vectors_version the lexical (BM25) index was built from


def _ids_blob(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def _ids_from_blob(blob: bytes) -> tuple[int, ...]:
    return tuple(int(x) for x in np.frombuffer(blob, dtype="<i4"))


class ChunkDB:
    """SQLite store of documents and chunks; thread-safe behind one lock.

    Open with ``ChunkDB.open(dir)`` to write (WAL journal while a run is going) or
    ``ChunkDB.open(dir, readonly=True)`` to serve.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path, readonly: bool) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.path = path  # the database file
        self.readonly = readonly  # True when opened for serving

    @classmethod
    def open(cls, index_dir: Path, *, readonly: bool = False) -> ChunkDB:
        """Open (and for writing, create) the database in ``index_dir``."""
        path = Path(index_dir) / DB_NAME
        if readonly:
            if not path.exists():
                raise FileNotFoundError(
                    f"no chunk database at {path}: is {index_dir} an index built by `ragkv index`?"
                )
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        else:
            Path(index_dir).mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a Spot reclaim is a power cut for a local disk; never lose a commit.
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.executescript(_SCHEMA)
        return cls(conn, path, readonly)

    def close(self, *, compact: bool = False) -> None:
        """Close; with ``compact``, fold the WAL back into one self-contained file first."""
        with self._lock:
            if compact and not self.readonly:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._conn.execute("PRAGMA journal_mode=DELETE")
            self._conn.close()

    # ---- meta ---------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def _bump_vectors(self) -> None:
        # caller holds the lock, inside a transaction
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES(?, '1') ON CONFLICT(key) "
            "DO UPDATE SET value = CAST(value AS INTEGER) + 1",
            (_VECTORS_VERSION,),
        )

    def vectors_version(self) -> str:
        return self.get_meta(_VECTORS_VERSION) or "0"

    def faiss_is_current(self) -> bool:
        """True when the FAISS file was built from the chunks as they are now."""
        return self.get_meta(_FAISS_VERSION) == self.vectors_version()

    def mark_faiss_built(self, version: str) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (_FAISS_VERSION, version)
            )

    def lexical_is_current(self) -> bool:
        """True when the lexical index was built from the chunks as they are now."""
        return self.get_meta(_LEXICAL_VERSION) == self.vectors_version()

    def mark_lexical_built(self, version: str) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (_LEXICAL_VERSION, version)
            )

    # ---- documents ----------------------------------------------------------------------

    def documents(self) -> dict[DocId, DocumentRecord]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT doc_id, content_hash, source, n_chunks FROM documents"
            ).fetchall()
        return {
            DocId(r[0]): DocumentRecord(DocId(r[0]), ContentHash(r[1]), r[2], int(r[3]))
            for r in rows
        }

    def replace_documents(
        self, docs: Sequence[tuple[DocumentRecord, Sequence[ChunkRecord]]]
    ) -> None:
        """Insert or replace documents with their chunks, in one transaction."""
        with self._lock, self._tx():
            for doc, chunks in docs:
                self._conn.execute("DELETE FROM chunks WHERE doc_id=?", (doc.doc_id,))
                self._conn.execute(
                    "INSERT OR REPLACE INTO documents(doc_id, content_hash, source, n_chunks) "
                    "VALUES(?, ?, ?, ?)",
                    (doc.doc_id, doc.content_hash, doc.source, doc.n_chunks),
                )
                self._conn.executemany(
                    "INSERT INTO chunks(chunk_id, doc_id, ordinal, text, metadata, token_ids, "
                    "n_tokens, kv_key) VALUES(?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            c.chunk_id,
                            c.doc_id,
                            c.ordinal,
                            c.text,
                            json.dumps(dict(c.metadata), sort_keys=True, ensure_ascii=False),
                            _ids_blob(c.token_ids),
                            len(c.token_ids),
                            c.kv_key.to_str(),
                        )
                        for c in chunks
                    ],
                )
            self._bump_vectors()

    def delete_documents(self, doc_ids: Iterable[DocId]) -> None:
        """Remove documents and all their chunks, in one transaction."""
        ids = list(doc_ids)
        if not ids:
            return
        with self._lock, self._tx():
            for d in ids:
                self._conn.execute("DELETE FROM chunks WHERE doc_id=?", (d,))
                self._conn.execute("DELETE FROM documents WHERE doc_id=?", (d,))
            self._bump_vectors()

    # ---- embeddings and KV progress -----------------------------------------------------

    def pending_embeddings(self) -> list[tuple[int, str]]:
        """(row, text) of every chunk without an embedding, in row order."""
        with self._lock:
            return self._conn.execute(
                "SELECT row, text FROM chunks WHERE embedding IS NULL ORDER BY row"
            ).fetchall()

    def set_embeddings(self, rows: Sequence[int], vectors: np.ndarray) -> None:
        """Store embeddings ``vectors: [N, dim]`` float32 for ``rows``, in one transaction."""
        xb = np.ascontiguousarray(vectors, dtype="<f4")
        with self._lock, self._tx():
            self._conn.executemany(
                "UPDATE chunks SET embedding=? WHERE row=?",
                [(xb[i].tobytes(), int(r)) for i, r in enumerate(rows)],
            )
            self._bump_vectors()

    def pending_kv(self) -> list[tuple[int, ChunkKey, tuple[int, ...]]]:
        """(row, kv_key, token_ids) of every chunk whose KV is not written yet, in row order."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT row, kv_key, token_ids FROM chunks WHERE kv_done=0 ORDER BY row"
            ).fetchall()
        return [(int(r), _key(k), _ids_from_blob(b)) for r, k, b in rows]

    def set_kv_done(self, rows: Sequence[int]) -> None:
        with self._lock, self._tx():
            self._conn.executemany(
                "UPDATE chunks SET kv_done=1 WHERE row=?", [(int(r),) for r in rows]
            )

    def reset_kv_done(self) -> None:
        """Forget which chunks have KV (the store changed): each is checked again."""
        with self._lock, self._tx():
            self._conn.execute("UPDATE chunks SET kv_done=0")

    def rekey(self, key_of: Callable[[tuple[int, ...]], ChunkKey]) -> int:
        """Give every chunk the KV key `key_of(token_ids)` names now; a chunk whose key changed
        (a new kvstore format version) is marked as having no KV. Returns how many changed.

        What changes a key apart from the chunk's own tokens (format version, model, prefix)
        is the same for every chunk, so when the first chunk's key holds, all do: a resume
        pays one key, not one per chunk."""
        with self._lock:
            first = self._conn.execute("SELECT kv_key, token_ids FROM chunks ORDER BY row LIMIT 1").fetchone()
            if first is None or key_of(_ids_from_blob(first[1])).to_str() == first[0]:
                return 0
            rows = self._conn.execute("SELECT row, kv_key, token_ids FROM chunks").fetchall()
        changed = [(key, int(r)) for r, old, b in rows if (key := key_of(_ids_from_blob(b)).to_str()) != old]
        if changed:
            with self._lock, self._tx():
                self._conn.executemany("UPDATE chunks SET kv_key=?, kv_done=0 WHERE row=?", changed)
        return len(changed)

    def set_kv_keys(self, keys: dict[int, ChunkKey]) -> int:
        """Give each row its KV key; a row whose key changed is marked as having no KV.
        Returns how many changed (neighbour-conditioned KV: a chunk's key names its context)."""
        with self._lock:
            rows = self._conn.execute("SELECT row, kv_key FROM chunks").fetchall()
        changed = [(keys[int(r)].to_str(), int(r)) for r, old in rows if int(r) in keys and keys[int(r)].to_str() != old]
        if changed:
            with self._lock, self._tx():
                self._conn.executemany("UPDATE chunks SET kv_key=?, kv_done=0 WHERE row=?", changed)
        return len(changed)

    def set_neighbours(self, neighbours: dict[int, Sequence[int]]) -> None:
        """Record each row's neighbours (rows, most similar first), replacing every earlier record:
        a server missing a chunk's neighbour KV computes it after the same (`neighbours_of`)."""
        with self._lock, self._tx():
            self._conn.execute("DELETE FROM neighbours")
            self._conn.executemany("INSERT INTO neighbours(row, rows) VALUES(?, ?)",
                                   [(int(r), json.dumps([int(n) for n in ns])) for r, ns in neighbours.items()])

    def neighbours_of(self, chunk_ids: Sequence[str]) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Each chunk's neighbours' token ids, most similar first, as the indexer recorded them; a
        chunk without a record (an index built without neighbours, or before they were recorded)
        is left out."""
        if not chunk_ids:
            return {}
        marks = ",".join("?" * len(chunk_ids))
        with self._lock:
            try:
                found = self._conn.execute(
                    f"SELECT c.chunk_id, n.rows FROM chunks c JOIN neighbours n ON n.row = c.row "
                    f"WHERE c.chunk_id IN ({marks})", list(chunk_ids)).fetchall()
            except sqlite3.OperationalError as exc:  # an index from before the table (opened read-only)
                if "no such table" not in str(exc):
                    raise
                return {}
        wanted = {cid: [int(r) for r in json.loads(rows)] for cid, rows in found}
        rows = sorted({r for rs in wanted.values() for r in rs})
        if not rows:
            return {}
        with self._lock:
            ids = dict(self._conn.execute(
                f"SELECT row, token_ids FROM chunks WHERE row IN ({','.join('?' * len(rows))})", rows).fetchall())
        return {cid: tuple(_ids_from_blob(ids[r]) for r in rs) for cid, rs in wanted.items()
                if all(r in ids for r in rs)}

    def record_calibrated_keys(self) -> None:
        """Remember the chunks' KV keys as they are now: what the index's calibration was measured
        on (`keys_changed_since_calibration` counts the change since)."""
        with self._lock, self._tx():
            self._conn.execute("DELETE FROM calibrated_keys")
            self._conn.execute("INSERT INTO calibrated_keys SELECT DISTINCT kv_key FROM chunks")

    def keys_changed_since_calibration(self) -> tuple[int, int] | None:
        """(KV keys when the calibration was measured, keys added or gone since): a changed chunk,
        or one whose neighbours changed, has a new key. None when no keys were recorded."""
        with self._lock:
            (then,) = self._conn.execute("SELECT COUNT(*) FROM calibrated_keys").fetchone()
            if not then:
                return None
            (added,) = self._conn.execute(
                "SELECT COUNT(DISTINCT kv_key) FROM chunks WHERE kv_key NOT IN (SELECT kv_key FROM calibrated_keys)"
            ).fetchone()
            (gone,) = self._conn.execute(
                "SELECT COUNT(*) FROM calibrated_keys WHERE kv_key NOT IN (SELECT kv_key FROM chunks)"
            ).fetchone()
        return int(then), int(added) + int(gone)

    def count_kv_pending(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM chunks WHERE kv_done=0").fetchone()[0])

    def all_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every chunk's (row ids ``[N]`` int64, embeddings ``[N, dim]`` float32), in row order.

        Raises:
            RuntimeError: a chunk has no embedding (a bug: build vectors after embedding).
        """
        with self._lock:
            rows = self._conn.execute("SELECT row, embedding FROM chunks ORDER BY row").fetchall()
        if any(e is None for _, e in rows):
            raise RuntimeError("all_vectors() called while some chunks have no embedding: a bug")
        ids = np.asarray([r for r, _ in rows], dtype=np.int64)  # [N]
        if not rows:
            return ids, np.zeros((0, 0), dtype=np.float32)
        xb = np.stack([np.frombuffer(e, dtype="<f4") for _, e in rows])  # [N, dim]
        return ids, xb.astype(np.float32, copy=False)

    # ---- whole-document copies (shard merge) ---------------------------------------------

    def export_documents(self) -> Iterator[tuple[DocumentRecord, list[tuple]]]:
        """Every document with its raw chunk rows, ordered by doc_id (for ``import_documents``)."""
        docs = self.documents()
        for doc_id in sorted(docs):
            with self._lock:
                rows = self._conn.execute(
                    "SELECT chunk_id, doc_id, ordinal, text, metadata, token_ids, n_tokens, kv_key, "
                    "embedding, kv_done FROM chunks WHERE doc_id=? ORDER BY ordinal", (doc_id,)
                ).fetchall()
            yield docs[doc_id], rows

    def import_documents(self, docs: Sequence[tuple[DocumentRecord, list[tuple]]]) -> None:
        """Insert documents with raw rows from ``export_documents``, in one transaction."""
        with self._lock, self._tx():
            for doc, rows in docs:
                self._conn.execute(
                    "INSERT INTO documents(doc_id, content_hash, source, n_chunks) VALUES(?, ?, ?, ?)",
                    (doc.doc_id, doc.content_hash, doc.source, doc.n_chunks),
                )
                self._conn.executemany(
                    "INSERT INTO chunks(chunk_id, doc_id, ordinal, text, metadata, token_ids, n_tokens, "
                    "kv_key, embedding, kv_done) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows,
                )
            self._bump_vectors()

    # ---- reads for serving --------------------------------------------------------------

    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])

    def stats(self) -> tuple[int, int, int]:
        """(documents, chunks, tokens)."""
        with self._lock:
            d = self._conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
            c, t = self._conn.execute("SELECT COUNT(*), COALESCE(SUM(n_tokens), 0) FROM chunks").fetchone()
        return int(d), int(c), int(t)

    def chunks_by_rows(self, rows: Sequence[int]) -> dict[int, ChunkRecord]:
        """The chunks with these rows (FAISS ids); missing rows are left out."""
        if not rows:
            return {}
        marks = ",".join("?" * len(rows))
        with self._lock:
            found = self._conn.execute(
                "SELECT row, chunk_id, doc_id, ordinal, text, metadata, token_ids, kv_key "
                f"FROM chunks WHERE row IN ({marks})",
                [int(r) for r in rows],
            ).fetchall()
        return {int(r[0]): _record(r[1:]) for r in found}

    def texts(self) -> tuple[list[int], list[str]]:
        """(rows, texts) of every chunk, in row order: what the lexical index is built from."""
        with self._lock:
            found = self._conn.execute("SELECT row, text FROM chunks ORDER BY row").fetchall()
        return [int(r) for r, _ in found], [str(t) for _, t in found]

    def metadata_by_row(self) -> dict[int, dict]:
        """Every chunk's document metadata (JSON types kept), by row: what filters test."""
        with self._lock:
            found = self._conn.execute("SELECT row, metadata FROM chunks ORDER BY row").fetchall()
        parsed: dict[str, dict] = {}  # chunks of one document share one metadata text
        return {int(r): parsed.setdefault(m, json.loads(m)) for r, m in found}

    def iter_chunks(self) -> Iterator[ChunkRecord]:
        """Every chunk, ordered by (doc_id, ordinal)."""
        with self._lock:
            found = self._conn.execute(
                "SELECT chunk_id, doc_id, ordinal, text, metadata, token_ids, kv_key "
                "FROM chunks ORDER BY doc_id, ordinal"
            ).fetchall()
        for r in found:
            yield _record(r)

    def iter_embeddings(self) -> Iterator[tuple[ChunkId, np.ndarray | None, bool]]:
        """(chunk_id, embedding or None, kv_done) of every chunk, ordered by (doc_id, ordinal)."""
        with self._lock:
            found = self._conn.execute(
                "SELECT chunk_id, embedding, kv_done FROM chunks ORDER BY doc_id, ordinal"
            ).fetchall()
        for cid, e, done in found:
            yield ChunkId(cid), None if e is None else np.frombuffer(e, dtype="<f4"), bool(done)

    # ---- internals ----------------------------------------------------------------------

    class _Tx:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def __enter__(self) -> None:
            self.conn.execute("BEGIN IMMEDIATE")

        def __exit__(self, exc_type: object, *_: object) -> None:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")

    def _tx(self) -> ChunkDB._Tx:
        if self.readonly:
            raise RuntimeError(f"write to {self.path} opened read-only: a bug")
        return ChunkDB._Tx(self._conn)


def _key(text: str) -> ChunkKey:
    """A stored key column as a ChunkKey (kvstore is imported on first use: it pulls torch in)."""
    from ragkv.kvstore import ChunkKey

    return ChunkKey.from_str(text)


def _record(r: Sequence[object]) -> ChunkRecord:
    cid, doc_id, ordinal, text, metadata, token_ids, kv_key = r
    return ChunkRecord(
        chunk_id=ChunkId(str(cid)),
        doc_id=DocId(str(doc_id)),
        ordinal=int(ordinal),  # type: ignore[call-overload]
        text=str(text),
        metadata=json.loads(str(metadata)),
        token_ids=_ids_from_blob(token_ids),  # type: ignore[arg-type]
        kv_key=_key(str(kv_key)),
    )
