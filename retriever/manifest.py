"""The manifest of an index: which models built it, with which settings, and its state.

It lives in ``manifest.json`` beside the chunk database and the FAISS file, and is
always replaced atomically (temp file + fsync + rename), so a crash never leaves a
half-written manifest.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ragkv.atomic import write_bytes
from ragkv.errors import IndexMismatchError, RagKVError
from ragkv.retriever.records import Fingerprint

MANIFEST_NAME = "manifest.json"
# a sharded index's per-shard folders beside its merged manifest (indexer.sharding.ShardSpec.dir_name())
SHARD_DIR = re.compile(r"shard-(\d{5})-of-(\d{5})")
MANIFEST_VERSION = 1
KV_DIR_NAME = "kv"  # the default disk tier of an index: INDEX/kv
_DISK = "disk:"

log = logging.getLogger(__name__)


class IndexState(enum.Enum):
    """Whether an index can be searched."""

    BUILDING = "building"  # a run started and has not finished (or was interrupted)
    COMPLETE = "complete"  # every chunk is embedded, has its KV, and the FAISS file matches


class VectorIndexKind(enum.Enum):
    """Which FAISS index holds the embeddings (chosen by size, see vector_index.py)."""

    FLAT_IP = "flat_ip"  # exact inner product
    HNSW_IP = "hnsw_ip"  # HNSW graph over inner product
    IVF_FLAT_IP = "ivf_flat_ip"  # inverted lists over inner product, trained on a GPU (vector_index.py)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """One shard of a corpus split across machines: documents whose id hash % count == index."""

    index: int  # this shard, 0 <= index < count
    count: int  # how many shards in all

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(
                f"shard {self.index}/{self.count} is invalid: need count >= 1 and "
                f"0 <= index < count, e.g. --shard 0/4"
            )

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        """Parse ``"i/N"``."""
        parts = text.split("/")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shard {text!r} is not of the form i/N, e.g. 0/4")
        return cls(int(parts[0]), int(parts[1]))

    def dir_name(self) -> str:
        """The subfolder of the output that holds this shard."""
        return f"shard-{self.index:05d}-of-{self.count:05d}"


@dataclass(frozen=True, slots=True)
class CalibratedSetting:
    """One blend setting's measured distance from full prefill on the index's own sample
    (`indexer.calibrate`): what `ragkv serve` predicts for it."""

    recompute_ratio: float  # share of chunk tokens recomputed
    selector: str  # the blend selector (engine.select.Selector's value)
    kl_mean: float  # mean next-token KL(full || blend) over the sample, in nats: the prediction
    kl_stderr: float  # its standard error over the sample (the spread)
    kl_max: float  # the worst set's KL
    top_token_agreement: float  # share of sets whose first token equals full prefill's
    seconds_median: float  # the blend's median prompt time on the sample (what "cheapest" compares)


@dataclass(frozen=True, slots=True)
class Calibration:
    """How far blend at each setting is from full prefill on this index, measured at index time on
    chunk sets of its own corpus with questions made from the chunks (`indexer.calibrate`)."""

    method: str  # how questions were made ("cloze": a sentence of a chunk with its key words blanked)
    seed: int  # the sample's seed: the same corpus gives the same sets, questions and choice
    sets: int  # chunk sets measured (the sample's size)
    chunks_per_set: int  # chunks in each set
    full_seconds_median: float  # full prefill's median prompt time on the sample
    settings: tuple[CalibratedSetting, ...]  # by recompute ratio, ascending

    def choose(self, kl_target: float) -> CalibratedSetting | None:
        """The cheapest setting whose predicted KL (mean over the sample) is at most `kl_target`;
        None when none is (serve full prefill)."""
        meets = [s for s in self.settings if s.kl_mean <= kl_target]
        return min(meets, key=lambda s: (s.recompute_ratio, s.seconds_median)) if meets else None

    def setting(self, ratio: float, selector: str = "query") -> CalibratedSetting | None:
        """The measured setting at `ratio` (within 1e-9) and `selector`, if calibration ran it."""
        return next((s for s in self.settings if abs(s.recompute_ratio - ratio) < 1e-9 and s.selector == selector),
                    None)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> Calibration | None:
        if not d:
            return None
        return cls(d["method"], int(d["seed"]), int(d["sets"]), int(d["chunks_per_set"]),
                   float(d["full_seconds_median"]), tuple(CalibratedSetting(**s) for s in d["settings"]))


@dataclass(frozen=True, slots=True)
class Manifest:
    """What an index was built with; the server checks it before serving."""

    model_spec: str  # the model as given to the indexer (path, hub id, or shipped name)
    model_fp: Fingerprint  # engine fingerprint of config + weights + tokenizer
    tokenizer_fp: Fingerprint  # engine fingerprint of the tokenizer alone
    embedder: str  # the sentence-transformers model as given (path or shipped name)
    embedder_fp: Fingerprint  # sha256 over the embedder's files
    embedding_dim: int  # width of the embedding vectors
    prefix_ids: tuple[int, ...]  # the shared prefix every chunk's KV was computed after
    chunk_size: int  # tokens per chunk at most
    chunk_overlap: int  # tokens shared by consecutive chunks at most
    # kvstore tiers the KV was written to: "disk:kv" is relative to the index folder (it moves
    # with it), "disk:/abs" an external folder the user named, "s3://b/p" absolute
    kv_uris: tuple[str, ...]
    kv_precomputed: bool  # False when the run skipped KV precompute (--no-kv)
    vector_index: VectorIndexKind  # the FAISS index type of the last build
    state: IndexState  # building or complete
    n_documents: int  # documents in the index
    n_chunks: int  # chunks in the index
    n_tokens: int  # LLM tokens over all chunks
    shard: ShardSpec | None  # the shard this index covers, None for a whole corpus
    created_at: float  # unix seconds when the index was first created
    updated_at: float  # unix seconds of the last change
    version: int = MANIFEST_VERSION  # manifest format version
    # the system prompt in the prefix (ragkv index --system-prompt); None: an index written
    # before it was recorded, built with the engine's DEFAULT_SYSTEM_PROMPT of its day
    system_prompt: str | None = None
    kv_compression: str = "none"  # how the KV files store K and V: none, int8, fp8, int4 or int2 (none: a manifest from before)
    # neighbour-conditioned KV (indexer.neighbours.NeighbourOptions.as_dict: m, budget_tokens,
    # choice, seed): each chunk prefilled after its m most similar chunks; None = plain KV
    neighbours: dict | None = None
    # sha256 of the FAISS file this build wrote: the server reads (and FAISS parses) only bytes
    # that match it; None = an index written before it was recorded (rerun `ragkv index` on it)
    faiss_sha256: str | None = None
    # blend's measured distance from full prefill at each setting on this corpus (`ragkv index
    # --calibrate`); None = not calibrated (an index from before, or --calibrate off): the server's default
    calibration: Calibration | None = None
    # how the plain copies of a neighbour index's chunks are stored (`ragkv index --neighbour-context
    # kv` keeps them beside the neighbour KV); None = as kv_compression (a manifest from before, or no copies)
    plain_kv_compression: str | None = None

    @property
    def plain_compression(self) -> str | None:
        """How the plain copies are stored, where the index keeps them (None: it keeps none). A
        manifest from before the record is taken to hold them in int8, `ragkv index`'s default."""
        if self.plain_kv_compression is not None:
            return self.plain_kv_compression
        kept = bool(self.neighbours) and self.neighbours.get("m", 0) > 0 and self.neighbours.get("context") == "kv"
        return "int8" if kept else None

    def check_model(self, model_fp: str, tokenizer_fp: str) -> None:
        """Raise IndexMismatchError unless the index was built for this model and tokenizer."""
        if model_fp != self.model_fp:
            raise IndexMismatchError(
                f"index was built for model {self.model_spec!r} (fingerprint {self.model_fp[:16]}) "
                f"but the model in use has fingerprint {model_fp[:16]}: serve the same model or "
                f"re-index with `ragkv index CORPUS --model ...`"
            )
        if tokenizer_fp != self.tokenizer_fp:
            raise IndexMismatchError(
                f"index was built with tokenizer {self.tokenizer_fp[:16]} but the model in use "
                f"has tokenizer {tokenizer_fp[:16]}: re-index with the serving model"
            )

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["vector_index"] = self.vector_index.value
        d["state"] = self.state.value
        d["prefix_ids"] = list(self.prefix_ids)
        d["kv_uris"] = list(self.kv_uris)
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        if d.get("version") != MANIFEST_VERSION:
            raise IndexMismatchError(
                f"index manifest version {d.get('version')!r} is not {MANIFEST_VERSION}: "
                f"re-index with this ragkv version"
            )
        d["vector_index"] = VectorIndexKind(d["vector_index"])
        d["state"] = IndexState(d["state"])
        d["prefix_ids"] = tuple(d["prefix_ids"])
        d["kv_uris"] = tuple(d["kv_uris"])
        d["shard"] = ShardSpec(**d["shard"]) if d.get("shard") else None
        d["calibration"] = Calibration.from_dict(d.get("calibration"))
        return cls(**d)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, never half."""
    write_bytes(path, text.encode("utf-8"))


def read_manifest(index_dir: Path) -> Manifest | None:
    """The manifest in ``index_dir``, or None when there is none yet."""
    path = Path(index_dir) / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        return Manifest.from_json(path.read_text("utf-8"))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise RagKVError(f"manifest {path} is unreadable ({exc}): delete the index and rebuild it") from exc


def write_manifest(index_dir: Path, manifest: Manifest) -> None:
    """Atomically write ``manifest`` into ``index_dir``."""
    atomic_write_text(Path(index_dir) / MANIFEST_NAME, manifest.to_json())


def portable_kv_uris(uris: Sequence[str], index_dir: Path, root: Path) -> tuple[str, ...]:
    """``uris`` as a manifest records them: a disk tier inside ``root`` (the index folder, or the
    folder that holds its shards) relative to ``index_dir``; anything else unchanged."""
    root = Path(root).resolve()
    out = []
    for uri in uris:
        if uri.startswith(_DISK):
            path = Path(uri[len(_DISK):]).expanduser().resolve()  # a relative path given is the caller's
            uri = _DISK + (os.path.relpath(path, Path(index_dir).resolve()) if path.is_relative_to(root)
                           else str(path))
        out.append(uri)
    return tuple(out)


def resolve_kv_uris(uris: Sequence[str], index_dir: Path) -> tuple[str, ...]:
    """The tiers a manifest names, with relative disk paths made absolute against ``index_dir``.

    An index written before KV locations were relative names its disk tier by the absolute path
    it was built at. When that path is gone but ``index_dir/kv`` exists (the index was copied or
    moved), the copy's own KV is used and the migration is logged.
    """
    index_dir = Path(index_dir).resolve()
    out = []
    for uri in uris:
        if uri.startswith(_DISK):
            path = Path(uri[len(_DISK):]).expanduser()
            if not path.is_absolute():
                path = Path(os.path.normpath(index_dir / path))
            elif not path.exists() and (index_dir / KV_DIR_NAME).is_dir():
                log.warning("index %s names KV folder %s, which does not exist; reading the index's own "
                            "%s instead (rerun `ragkv index` on it to record the relative path)",
                            index_dir, path, index_dir / KV_DIR_NAME)
                path = index_dir / KV_DIR_NAME
            elif not path.exists():
                log.warning("index %s names KV folder %s, which does not exist: every chunk's KV will be "
                            "computed on its first query (copy the KV there, or rebuild with `ragkv index`)",
                            index_dir, path)
            uri = f"{_DISK}{path}"
        out.append(uri)
    return tuple(out)
