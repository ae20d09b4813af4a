"""The index job: corpus -> chunks -> embeddings -> per-chunk KV -> FAISS, resumable.

Every phase works from the chunk database's state, in small transactions, so a
crash or ``kill -9`` anywhere loses at most one batch, and rerunning the same
command resumes where it stopped:

1. diff the corpus against the database: delete the chunks of removed or changed
   documents, chunk new and changed ones (one transaction per batch of documents,
   in document-id order, so rows are numbered as in an uninterrupted run);
2. embed chunks that have no embedding;
3. prefill and store the KV of chunks not marked done (skipping keys the store has); then,
   in the index's own KV folder (not one named by ``--kv-store``, not one that shards
   share), remove the files no chunk reads: deleted and changed documents' KV;
4. rebuild the FAISS file and the lexical (BM25) index when the chunks changed, then
   mark the manifest complete (calibrated first, when asked: step 5). BM25 is rebuilt from the chunk database rather than
   patched: 10k chunks take well under a second (bench/retrieval_bench.py).

5. with ``calibrate``, when no calibration is recorded or the chunks whose KV changed since it
   was measured reach ``recalibrate_after`` of those it was measured on: measure blend at a few
   ratios against full prefill on a sample of the index's own chunk sets
   (``indexer.calibrate``), for the manifest.

A ``StopSignal`` (SIGTERM, Spot notice) is checked between batches: the job then
raises ``IndexInterrupted`` with all finished work saved.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ragkv.errors import IndexMismatchError
from ragkv.indexer.chunking import ChunkingConfig, chunk_document
from ragkv.indexer.corpus import Corpus, Document, load_corpus
from ragkv.indexer.kv_job import KVItem, KVWriter, open_store
from ragkv.indexer.neighbours import PLAIN_COPY_COMPRESSION, context_ids, select_neighbours
from ragkv.indexer.sharding import shard_of
from ragkv.indexer.spot import StopSignal
from ragkv.retriever import vector_index
from ragkv.retriever.chunk_db import ChunkDB
from ragkv.retriever.chunk_keys import NeighbourContext, NeighbourOptions, chunk_key
from ragkv.retriever.embedder import DEFAULT_EMBEDDER, Embedder
from ragkv.retriever.lexical import LEXICAL_DIR, ROWS_NAME, LexicalIndex
from ragkv.retriever.manifest import (
    KV_DIR_NAME,
    Calibration,
    IndexState,
    Manifest,
    ShardSpec,
    portable_kv_uris,
    read_manifest,
    resolve_kv_uris,
    write_manifest,
)
from ragkv.retriever.records import ChunkRecord, DocumentRecord, Fingerprint
from ragkv.types import DType

if TYPE_CHECKING:  # the engine and kvstore load torch: imported where they run, named here
    from ragkv.engine import Engine, LoadedModel
    from ragkv.indexer.ray_runner import RayKVRunner
    from ragkv.kvstore import ChunkKey

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MODEL = "smollm2-135m-instruct"  # the shipped SmolLM2 (engine.DEFAULT_MODEL)


class Runner(enum.Enum):
    """Where the KV batches are computed."""

    LOCAL = "local"  # this process: KVWriter overlaps prefill and writes on threads
    RAY = "ray"  # Ray actors, one model per worker (indexer.ray_runner; the `ray` extra)


@dataclass(frozen=True, slots=True)
class IndexJobConfig:
    """Everything one index run needs."""

    corpus: Path  # folder of .txt / .md / .jsonl files
    out: Path  # index folder (shards go to <out>/shard-i-of-N)
    model: str = DEFAULT_MODEL  # LLM spec for engine.load_model
    embedder: str = DEFAULT_EMBEDDER  # sentence-transformers model: shipped name or directory
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)  # chunk size and overlap
    kv_uris: tuple[str, ...] = ()  # kvstore tiers to write; () = ("disk:<out>/kv",)
    precompute_kv: bool = True  # False: chunks and vectors only (KV computed on first query)
    shard: ShardSpec | None = None  # index only this shard of the corpus
    doc_batch: int = 16  # documents chunked per transaction
    embed_batch: int = 64  # chunks embedded per transaction
    kv_batch: int = 4  # chunks prefilled per batch (per checkpoint)
    device: str = "cpu"  # torch device for the LLM and embedder
    dtype: DType = DType.FLOAT32  # LLM dtype
    model_check: bool = True  # run the quick correctness gate (engine.check) before indexing
    hnsw_threshold: int = vector_index.HNSW_THRESHOLD  # chunks at which FAISS switches to HNSW (IVF on a GPU)
    runner: Runner = Runner.LOCAL  # where the KV batches are computed
    ray_address: str | None = None  # Runner.RAY: ray.init address; None = $RAY_ADDRESS or a local instance
    ray_workers: int = 0  # Runner.RAY: actors; 0 = one per GPU (cuda) or per CPU of the cluster
    progress: bool = True  # tqdm bars on stderr
    system_prompt: str | None = None  # in the shared prefix, so in every chunk's KV and key; None = the default
    kv_compression: str = "none"  # how KV files store K and V: none, int8, fp8, int4 or int2 (kvstore.compression)
    # how the plain copy of each chunk's KV is stored where a neighbour index keeps one
    # (NeighbourContext.KV; it serves a prompt's first chunk): int8 by default (PLAIN_COPY_COMPRESSION)
    plain_kv_compression: str = PLAIN_COPY_COMPRESSION
    # neighbour-conditioned KV: each chunk prefilled after its m most similar chunks (m = 0: plain)
    neighbours: NeighbourOptions = field(default_factory=NeighbourOptions)
    # measure blend against full prefill on a sample of the corpus's own chunk sets and record it in
    # the manifest (indexer.calibrate; `ragkv index` does by default); False: the server's default ratio
    calibrate: bool = False
    # chunk sets calibration measures (None: `indexer.calibrate.sample_size`, 1 per 100 chunks, 4 to 32);
    # a calibration of another size is measured again
    calibration_sets: int | None = None
    # a calibration is kept until the chunks whose KV changed since it was measured (added, changed,
    # deleted, or computed after other neighbours) reach this share of the chunks it was measured on;
    # 0: measured again on any change. On 400 chunks or more, measuring again costs about what indexing
    # 4.5% of them does (`indexer.calibrate.SETS_PER_CHUNK`), so at 0.5 at most ~9% of the indexing
    # those changes took
    recalibrate_after: float = 0.5

    def __post_init__(self) -> None:
        if self.calibration_sets is not None and self.calibration_sets < 1:
            raise ValueError(f"calibration_sets must be >= 1 (or None for the default), got {self.calibration_sets}")
        if not 0.0 <= self.recalibrate_after <= 1.0:
            raise ValueError(f"recalibrate_after must be a share of the chunks in [0, 1] (0: measure again on any "
                             f"change), got {self.recalibrate_after}")

    def index_dir(self) -> Path:
        """Where this run writes: ``out``, or its shard's subfolder."""
        return self.out / self.shard.dir_name() if self.shard else self.out

    def resolved_kv_uris(self) -> tuple[str, ...]:
        """The tiers this run writes to, disk paths absolute (the manifest records them relative)."""
        return self.kv_uris or (f"disk:{(self.out / KV_DIR_NAME).resolve()}",)


@dataclass(frozen=True, slots=True)
class IndexSummary:
    """What a run did, for the summary line."""

    index_dir: Path  # where the index is
    documents: int  # documents in the index
    chunks: int  # chunks in the index
    tokens: int  # LLM tokens over all chunks
    documents_added: int  # new or changed documents chunked this run
    documents_deleted: int  # documents removed this run (gone or changed)
    chunks_embedded: int  # chunks embedded this run
    kv_chunks: int  # chunks whose KV was computed and written this run
    kv_tokens: int  # tokens prefilled this run
    kv_bytes: int  # KV bytes stored this run (as encoded: compressed copies count compressed)
    kv_seconds: float  # seconds in the KV phase
    seconds: float  # wall seconds of the whole run
    skipped_files: tuple[str, ...]  # corpus files that are not documents
    calibration: Calibration | None = None  # the manifest's (measured this run or kept), None = not calibrated
    calibration_seconds: float = 0.0  # seconds calibrating this run (0: kept, or not calibrated)
    # a kept calibration: the share of its chunks whose KV changed since it was measured (None: not kept,
    # or kept from before that was recorded), and the share at which it is measured again
    calibration_changed: float | None = None
    recalibrate_after: float = 0.5

    @property
    def kv_tokens_per_s(self) -> float:
        return self.kv_tokens / self.kv_seconds if self.kv_seconds > 0 else 0.0

    def lines(self) -> list[str]:
        """Human-readable summary."""
        out = [
            f"index {self.index_dir}: {self.documents} documents, {self.chunks} chunks, "
            f"{self.tokens} tokens",
            f"this run: +{self.documents_added}/-{self.documents_deleted} documents, "
            f"{self.chunks_embedded} chunks embedded, KV for {self.kv_chunks} chunks "
            f"({self.kv_tokens} tokens, {self.kv_bytes / 1e6:.1f} MB) in {self.kv_seconds:.1f} s "
            f"= {self.kv_tokens_per_s:.0f} tokens/s; {self.seconds:.1f} s total",
        ]
        if self.calibration is not None:
            c = self.calibration
            kls = ", ".join(f"{s.recompute_ratio:g}: {s.kl_mean:.4f}" for s in c.settings)
            if self.calibration_seconds and self.seconds:
                took = f", {self.calibration_seconds:.1f} s, {self.calibration_seconds / self.seconds:.0%} of this run"
            elif self.calibration_changed:
                took = (f", kept: {self.calibration_changed:.0%} of its chunks' KV changed since it was measured, "
                        f"measured again at {self.recalibrate_after:.0%} (--recalibrate-after)")
            else:
                took = ", kept"
            out.append(f"calibration ({c.sets} chunk sets of {c.chunks_per_set}, {c.method} questions{took}): "
                       f"blend's next-token KL to full prefill by recompute ratio: {kls}")
        if self.skipped_files:
            out.append(f"skipped {len(self.skipped_files)} non-document files: "
                       + ", ".join(self.skipped_files[:10]) + (" ..." if len(self.skipped_files) > 10 else ""))
        return out


def batched(items: Sequence[T], n: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="chunk" if desc != "chunking" else "doc",
                disable=not enabled, dynamic_ncols=True, leave=True)


def run_index(config: IndexJobConfig, stop: StopSignal | None = None, *, lm: LoadedModel | None = None,
              embedder: Embedder | None = None) -> IndexSummary:
    """Build or update the index of ``config``; resumable and incremental.

    Args:
        config: what to index and where.
        stop: checked between batches; when set, the job saves and raises IndexInterrupted.
        lm: an already loaded ``engine.LoadedModel`` (tests, benchmarks); else loaded here.
        embedder: an already loaded embedder; else loaded here.

    Raises:
        CorpusError: the corpus is missing, empty or malformed.
        IndexMismatchError: ``out`` holds an index built with other models or settings.
        IndexInterrupted: ``stop`` was set; rerun to resume.
    """
    t0 = time.perf_counter()
    stop = stop or StopSignal()
    corpus = load_corpus(config.corpus)
    docs = _shard_documents(corpus, config.shard)
    index_dir = config.index_dir()

    from ragkv.engine import Engine, load_model
    from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT

    lm = lm or load_model(config.model, device=config.device, dtype=config.dtype)
    if config.precompute_kv and lm.adapter.recurrent_layers:
        log.info("%s is a hybrid (recurrent %s layers): no chunk KV can be reused on it, so none is "
                 "precomputed; the index holds chunks and vectors, and queries are served in full mode",
                 lm.adapter.family.model_type, lm.adapter.family.recurrent)
        config = replace(config, precompute_kv=False)
    if config.precompute_kv:  # stored KV must be the model's own: refuse a model ragkv computes wrongly
        from ragkv.engine.check import gate_model

        gate_model(lm, skip=not config.model_check)
    embedder = embedder or Embedder.load(config.embedder, device=config.device)
    system_prompt = DEFAULT_SYSTEM_PROMPT if config.system_prompt is None else config.system_prompt
    if not system_prompt.strip():
        raise ValueError("the system prompt is empty: give --system-prompt TEXT or @FILE with some text")
    engine = Engine(lm, system_prompt=system_prompt)
    prefix_ids = tuple(engine.prompt.prefix_ids())
    kv_uris = config.resolved_kv_uris()

    index_dir.mkdir(parents=True, exist_ok=True)
    old = read_manifest(index_dir)
    now = time.time()
    manifest = Manifest(
        model_spec=config.model, model_fp=Fingerprint(str(lm.fingerprint)),
        tokenizer_fp=Fingerprint(str(lm.tokenizer_fingerprint)), embedder=config.embedder,
        embedder_fp=embedder.fingerprint, embedding_dim=embedder.dim, prefix_ids=prefix_ids,
        chunk_size=config.chunking.size, chunk_overlap=config.chunking.overlap,
        kv_uris=portable_kv_uris(kv_uris, index_dir, config.out),  # the index moves with its KV
        kv_precomputed=False, vector_index=vector_index.choose_kind(0, config.hnsw_threshold),
        state=IndexState.BUILDING, n_documents=0, n_chunks=0, n_tokens=0, shard=config.shard,
        created_at=old.created_at if old else now, updated_at=now,
        system_prompt=system_prompt, kv_compression=config.kv_compression,
        neighbours=config.neighbours.as_dict() if config.neighbours.enabled else None,
        plain_kv_compression=config.plain_kv_compression if config.neighbours.plain_first else None,
    )
    if old is not None:
        _check_compatible(index_dir, old, manifest)
    write_manifest(index_dir, manifest)

    db = ChunkDB.open(index_dir)
    try:
        if old is not None and resolve_kv_uris(old.kv_uris, index_dir) != kv_uris:
            db.reset_kv_done()  # another store: check every chunk against it again
        # keys name the kvstore format: after an upgrade the KV is written anew (with neighbours,
        # _neighbour_contexts gives every chunk its key, and a changed option changes them all)
        if old is not None and not config.neighbours.enabled:
            rekeyed = db.rekey(lambda ids: chunk_key(manifest.model_fp, manifest.tokenizer_fp, prefix_ids, ids))
            if rekeyed:
                log.info("%d chunks get new KV keys (the kvstore format changed): their KV is computed again",
                         rekeyed)
        added, deleted = _sync_documents(db, docs, engine, lm, manifest, config, stop)
        embedded = _embed_pending(db, embedder, config, stop)
        kv_chunks = kv_tokens = kv_bytes = 0
        kv_seconds = 0.0
        contexts = _neighbour_contexts(db, manifest, config.neighbours) if config.neighbours.enabled else {}
        if config.precompute_kv:
            t_kv = time.perf_counter()
            pending = db.pending_kv()
            plain = (0, 0, 0)
            if config.neighbours.context is NeighbourContext.KV:
                plain = _precompute_plain_kv(engine, lm, prefix_ids, kv_uris,
                                             [contexts[row] for row, _, _ in pending if row in contexts], config, stop)
            kv_chunks, kv_tokens, kv_bytes = (a + b for a, b in zip(plain, _precompute_kv(
                db, pending, engine, lm, prefix_ids, kv_uris, config, stop, contexts)))
            kv_seconds = time.perf_counter() - t_kv
            stop.check()
            swept = _sweep_kv(db, manifest, kv_uris, lm) if not config.kv_uris and config.shard is None else 0
            if swept:
                log.info("%d KV files no chunk of this index reads (deleted or changed documents, "
                         "older keys) were removed from %s", swept, kv_uris[0])
        stop.check()
        n_docs, n_chunks, n_tokens = db.stats()
        # IVF trained on the GPU when FAISS sees one (the gpu extra), else HNSW, past the threshold
        kind = vector_index.choose_kind(n_chunks, config.hnsw_threshold, gpu=vector_index.gpu_count() > 0)
        if not db.faiss_is_current() or old is None or old.vector_index is not kind \
                or not (index_dir / vector_index.FAISS_NAME).exists():
            version = db.vectors_version()
            ids, xb = db.all_vectors()
            if xb.size == 0:
                xb = xb.reshape(0, embedder.dim)
            faiss_sha256 = vector_index.save(vector_index.build(ids, xb, kind), index_dir)
            db.mark_faiss_built(version)
        else:  # the file of an earlier run: its checksum, recorded now if that run did not
            faiss_sha256 = vector_index.file_sha256(index_dir)
        if not db.lexical_is_current() or not (index_dir / LEXICAL_DIR / ROWS_NAME).exists():
            version = db.vectors_version()
            LexicalIndex.build(*db.texts()).save(index_dir)
            db.mark_lexical_built(version)
        kv_done = db.count_kv_pending() == 0
        calibration, calibration_s, changed = None, 0.0, None
        if config.calibrate and config.precompute_kv and kv_done:
            kept, changed = _kept_calibration(old, db, config, touched=bool(added or deleted or kv_chunks))
            t_cal = time.perf_counter()
            calibration = kept or _calibrate(db, manifest, kv_uris, engine, lm, config)
            calibration_s = 0.0 if kept else time.perf_counter() - t_cal
            stop.check()
        write_manifest(index_dir, replace(
            manifest, state=IndexState.COMPLETE, vector_index=kind, n_documents=n_docs,
            n_chunks=n_chunks, n_tokens=n_tokens, kv_precomputed=kv_done,
            updated_at=time.time(), faiss_sha256=faiss_sha256, calibration=calibration,
        ))
        if calibration is not None and changed is None:  # measured now (or kept from before keys were recorded)
            db.record_calibrated_keys()  # after the manifest: a crash between the two measures again, not less
        db.close(compact=True)
        db = None
    finally:
        if db is not None:
            db.close()
    return IndexSummary(
        index_dir=index_dir, documents=n_docs, chunks=n_chunks, tokens=n_tokens,
        documents_added=added, documents_deleted=deleted, chunks_embedded=embedded,
        kv_chunks=kv_chunks, kv_tokens=kv_tokens, kv_bytes=kv_bytes, kv_seconds=kv_seconds,
        seconds=time.perf_counter() - t0, skipped_files=corpus.skipped, calibration=calibration,
        calibration_seconds=calibration_s, calibration_changed=changed, recalibrate_after=config.recalibrate_after,
    )


def _shard_documents(corpus: Corpus, shard: ShardSpec | None) -> list[Document]:
    if shard is None:
        return list(corpus.documents)
    return [d for d in corpus.documents if shard_of(d.doc_id, shard.count) == shard.index]


def _check_compatible(index_dir: Path, old: Manifest, new: Manifest) -> None:
    for name in ("model_fp", "tokenizer_fp", "embedder_fp", "prefix_ids", "chunk_size", "chunk_overlap", "shard",
                 "kv_compression"):
        a, b = getattr(old, name), getattr(new, name)
        if name == "prefix_ids" and a != b and old.system_prompt != new.system_prompt:
            raise IndexMismatchError(
                f"{index_dir} was indexed with system prompt {old.system_prompt!r}, this run gives "
                f"{new.system_prompt!r}: the system prompt is in every chunk's KV; index into a new --out folder")
        if a != b:
            raise IndexMismatchError(
                f"{index_dir} holds an index built with another {name} ({str(a)[:40]!r}, now "
                f"{str(b)[:40]!r}): index into a new --out folder, or delete {index_dir} to rebuild"
            )


def _sync_documents(db: ChunkDB, docs: list[Document], engine: Engine, lm: LoadedModel, manifest: Manifest,
                    config: IndexJobConfig, stop: StopSignal) -> tuple[int, int]:
    """Delete gone documents, chunk new and changed ones. Returns (added, deleted)."""
    known = db.documents()
    wanted = {d.doc_id: d for d in docs}
    gone = sorted(set(known) - set(wanted))
    db.delete_documents(gone)
    todo = [d for d in docs if d.doc_id not in known or known[d.doc_id].content_hash != d.content_hash]
    changed = sum(1 for d in todo if d.doc_id in known)
    tok = lm.tokenizer

    def count(text: str) -> list[int]:
        return tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    with _bar(len(todo), "chunking", config.progress) as bar:
        for batch in batched(todo, config.doc_batch):
            stop.check()
            rows = []
            for doc in batch:
                chunks = chunk_document(doc.doc_id, doc.text, engine.prompt.chunk_ids, config.chunking, count)
                records = [
                    ChunkRecord(c.chunk_id, c.doc_id, c.ordinal, c.text, doc.metadata, c.token_ids,
                                chunk_key(manifest.model_fp, manifest.tokenizer_fp, manifest.prefix_ids, c.token_ids))
                    for c in chunks
                ]
                rows.append((DocumentRecord(doc.doc_id, doc.content_hash, doc.source, len(records)), records))
            db.replace_documents(rows)
            bar.update(len(batch))
    return len(todo), len(gone) + changed


def _embed_pending(db: ChunkDB, embedder: Embedder, config: IndexJobConfig, stop: StopSignal) -> int:
    pending = db.pending_embeddings()
    with _bar(len(pending), "embedding", config.progress) as bar:
        for batch in batched(pending, config.embed_batch):
            stop.check()
            xb = embedder.encode_documents([text for _, text in batch], batch_size=config.embed_batch)
            db.set_embeddings([row for row, _ in batch], xb)
            bar.update(len(batch))
    return len(pending)


@dataclass(frozen=True, slots=True)
class _Context:
    """What a chunk is computed after (neighbour-conditioned KV)."""

    ids: tuple[int, ...]  # its neighbours' tokens, cut to the budget (named in the key)
    neighbours: tuple[tuple[ChunkKey, tuple[int, ...]], ...]  # (plain key, token ids), most similar first
    own: tuple[ChunkKey, tuple[int, ...]]  # the chunk's own plain key and token ids


def _plain_key(manifest: Manifest, ids: Sequence[int]) -> ChunkKey:
    """The key of a chunk's plain KV (computed after the prefix alone) in this index's store."""
    return chunk_key(manifest.model_fp, manifest.tokenizer_fp, manifest.prefix_ids, ids)


def _neighbour_contexts(db: ChunkDB, manifest: Manifest, options: NeighbourOptions) -> dict[int, _Context]:
    """Every chunk's context (its neighbours, by the index's own embeddings), by row; each
    chunk gets the key of its KV computed after that context (a changed key: its KV is computed)."""
    from ragkv.kvstore import ChunkContext

    rows, xb = db.all_vectors()
    if not len(rows):
        return {}
    records = db.chunks_by_rows([int(r) for r in rows])
    ids_of = [records[int(r)].token_ids for r in rows]
    contexts, keys, recorded = {}, {}, {}
    for r, chunk_ids, nbrs in zip(rows, ids_of, select_neighbours(xb, options)):
        recorded[int(r)] = [int(rows[j]) for j in nbrs]
        ctx = tuple(context_ids([ids_of[j] for j in nbrs], options.budget_tokens))
        contexts[int(r)] = _Context(ctx, tuple((_plain_key(manifest, ids_of[j]), tuple(ids_of[j])) for j in nbrs),
                                    (_plain_key(manifest, chunk_ids), tuple(chunk_ids)))
        keys[int(r)] = chunk_key(manifest.model_fp, manifest.tokenizer_fp, manifest.prefix_ids, chunk_ids,
                              ChunkContext(options.tag(), ctx))
    changed = db.set_kv_keys(keys)
    db.set_neighbours(recorded)  # the server computes a missing chunk's KV after the same (retriever.chunk_keys)
    if changed:
        log.info("%d chunks have new neighbours or options: their KV is computed again", changed)
    return contexts


def _sweep_kv(db: ChunkDB, manifest: Manifest, kv_uris: Sequence[str], lm: LoadedModel) -> int:
    """Remove from the index's own KV folder every file no chunk of it reads: the KV of deleted and
    changed documents' chunks, and of keys a rekey or new neighbours replaced. Only the default
    store (``<out>/kv`` of an unsharded index) is swept: a store named by ``--kv-store`` or shared
    by shards may hold KV that other indexes read. Returns the files removed."""
    wanted = set()
    for c in db.iter_chunks():
        wanted.update((c.kv_key, _plain_key(manifest, c.token_ids)))  # its KV, and its plain copy where one is kept
    store = open_store(kv_uris, lm.fingerprint, lm.tokenizer_fingerprint)
    try:
        held = [k for keys in store.held_keys().values() for k in keys]
        return sum(store.delete(k) for k in held if k not in wanted)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def _precompute_plain_kv(engine: Engine, lm: LoadedModel, prefix_ids: Sequence[int], kv_uris: Sequence[str],
                         contexts: Sequence[_Context], config: IndexJobConfig,
                         stop: StopSignal) -> tuple[int, int, int]:
    """The plain KV of every chunk in `contexts` (those still to compute: NeighbourContext.KV) and of
    its neighbours (the context the neighbour pass reads), stored with `config.plain_kv_compression`
    (a chunk's own serves it first in a prompt: `NeighbourOptions.plain_first`); resumes from what
    the store holds. Returns (chunks, tokens, bytes)."""
    wanted = dict(nb for c in contexts for nb in (c.own, *c.neighbours))  # plain key -> token ids
    items = [KVItem(-1, key, ids) for key, ids in wanted.items()]
    if not items:
        return 0, 0, 0
    store = open_store(kv_uris, lm.fingerprint, lm.tokenizer_fingerprint, config.plain_kv_compression)
    try:
        writer = KVWriter(engine, store, prefix_ids)
        todo = writer.missing(items)
        totals = [0, 0, 0]
        label = "kv precompute (plain: the first chunk's, the neighbours' context)"
        with _bar(len(todo), label, config.progress) as bar:
            def on_done(batch: Sequence[KVItem], nbytes: int) -> None:
                totals[0] += len(batch)
                totals[1] += sum(len(it.token_ids) for it in batch)
                totals[2] += nbytes
                bar.update(len(batch))

            writer.run(list(batched(todo, config.kv_batch)), on_done, stop.is_set)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    stop.check()
    return totals[0], totals[1], totals[2]


def _precompute_kv(db: ChunkDB, pending: Sequence[tuple[int, str, tuple[int, ...]]], engine: Engine, lm: LoadedModel,
                   prefix_ids: Sequence[int], kv_uris: Sequence[str], config: IndexJobConfig, stop: StopSignal,
                   contexts: dict[int, _Context] | None = None) -> tuple[int, int, int]:
    """The KV of `pending` (`db.pending_kv()`). Returns (chunks computed, tokens computed, bytes written)."""
    contexts = contexts or {}
    tag = config.neighbours.tag() if config.neighbours.enabled else ""
    by_kv = config.neighbours.context is NeighbourContext.KV

    def item(row: int, key: str, ids: tuple[int, ...]) -> KVItem:
        ctx = contexts.get(row)
        if ctx is None:
            return KVItem(row, key, ids)
        if not by_kv:
            return KVItem(row, key, ids, ctx.ids, tag)
        return KVItem(row, key, ids, ctx.ids, tag, ctx.neighbours, config.neighbours.budget_tokens)

    pending = [item(row, key, ids) for row, key, ids in pending]
    if not pending:
        return 0, 0, 0
    store = open_store(kv_uris, lm.fingerprint, lm.tokenizer_fingerprint, config.kv_compression)
    try:
        writer = KVWriter(engine, store, prefix_ids)
        stored = {it.row for it in pending} - {it.row for it in writer.missing(pending)}
        db.set_kv_done(sorted(stored))  # written before a crash, not yet marked
        todo = [it for it in pending if it.row not in stored]
        totals = [0, 0, 0]
        with _bar(len(todo), "kv precompute", config.progress) as bar:
            def on_done(batch: Sequence[KVItem], nbytes: int) -> None:
                db.set_kv_done([it.row for it in batch])
                totals[0] += len(batch)
                totals[1] += sum(len(it.token_ids) for it in batch)
                totals[2] += nbytes
                bar.update(len(batch))

            batches = list(batched(todo, config.kv_batch))
            if config.runner is Runner.RAY and batches:  # nothing to do: no cluster to start
                with _ray_runner(config, prefix_ids, kv_uris, lm) as runner:
                    runner.run(batches, on_done, stop.is_set)
            else:
                writer.run(batches, on_done, stop.is_set)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    return totals[0], totals[1], totals[2]


def _kept_calibration(old: Manifest | None, db: ChunkDB, config: IndexJobConfig,
                      touched: bool) -> tuple[Calibration | None, float | None]:
    """The index's calibration, when it still holds: measured by this method and sample size, on
    chunks of which less than `config.recalibrate_after` have changed KV since (or none has; keys
    recorded at measurement, `ChunkDB.keys_changed_since_calibration`). An index calibrated before
    the keys were recorded keeps it only when this run changed nothing (`touched`). Returns (the
    calibration or None: measure again, the share of its chunks changed since or None)."""
    from ragkv.indexer.calibrate import METHOD

    cal = old.calibration if old is not None else None
    if cal is None or cal.method != METHOD or config.calibration_sets not in (None, cal.sets):
        return None, None  # none yet, or an older method's or another size's: measured again
    since = db.keys_changed_since_calibration()
    if since is None:
        return (None, None) if touched else (cal, None)
    then, changed = since
    share = changed / then
    if changed and share >= config.recalibrate_after:
        log.info("%d of the %d chunks calibration was measured on changed their KV since (%.0f%%, at least "
                 "--recalibrate-after %.0f%%): calibrating again", changed, then, 100 * share,
                 100 * config.recalibrate_after)
        return None, None
    return cal, share


def _calibrate(db: ChunkDB, manifest: Manifest, kv_uris: Sequence[str], engine: Engine, lm: LoadedModel,
               config: IndexJobConfig) -> Calibration | None:
    """Blend against full prefill on a sample of this index's chunk sets (`indexer.calibrate`), each
    chunk's KV read from the store as the server reads it; None when the corpus gives no set."""
    from ragkv.engine.kv.cache import ChunkKV
    from ragkv.indexer.calibrate import CalibrationSet, measure, sample_prompts, sample_size
    from ragkv.kvstore import hash_prefix
    from ragkv.retriever.chunk_keys import serving_keys
    from ragkv.types import Mode

    prefix_hash = hash_prefix(manifest.prefix_ids)

    rows, xb = db.all_vectors()
    records = db.chunks_by_rows([int(r) for r in rows])
    sets = []
    store = open_store(kv_uris, lm.fingerprint, lm.tokenizer_fingerprint)
    try:
        n_sets = config.calibration_sets or sample_size(len(rows))
        for prompt, question, kind in sample_prompts(xb, n_sets, lambda j: records[int(rows[j])].text):
            chunks = [records[int(rows[j])] for j in prompt]
            keys = serving_keys(chunks, Mode.BLEND, config.neighbours, prefix_hash, manifest.model_fp,
                                manifest.tokenizer_fp)  # the KV the server reads
            hits = [store.read(key) for key in keys]
            if any(h is None for h in hits):  # KV not stored
                continue
            sets.append(CalibrationSet(tuple(c.token_ids for c in chunks),
                                       tuple(ChunkKV.from_stored(h.entry, lm.device, lm.dtype) for h in hits if h),
                                       question, kind))
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    if not sets:
        log.info("no chunk set to calibrate on (fewer chunks than a set, or no name or number to ask of in the "
                 "seed chunks): the server will serve its default ratio")
        return None
    with _bar(len(sets), "calibrating (blend against full prefill)", config.progress) as bar:
        def progress(items):
            for it in items:
                yield it
                bar.update(1)

        return measure(engine, sets, progress=progress)


def _ray_runner(config: IndexJobConfig, prefix_ids: Sequence[int], kv_uris: Sequence[str],
               lm: LoadedModel) -> RayKVRunner:
    from ragkv.indexer.ray_runner import RayKVRunner, RayRunnerConfig

    ray_config = RayRunnerConfig(model=config.model, device=config.device, dtype=config.dtype,
                                 kv_uris=tuple(kv_uris), address=config.ray_address,
                                 workers=config.ray_workers, kv_compression=config.kv_compression)
    return RayKVRunner(ray_config, prefix_ids, lm.fingerprint, lm.tokenizer_fingerprint)
