"""Optional reranking: a sentence-transformers ``CrossEncoder`` from a local model folder.

The cross-encoder reads (question, chunk) pairs together, so it orders the fused
candidates better than either search alone, at the cost of one forward pass per
candidate. No weights ship with ragkv: point ``ragkv serve --reranker DIR`` at a
downloaded cross-encoder (e.g. ``cross-encoder/ms-marco-MiniLM-L6-v2`` saved with
``CrossEncoder(...).save(DIR)``). Never reaches the network: the folder must hold
the model and its tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


class Reranker:
    """Scores (question, text) pairs with a cross-encoder; higher is more relevant.

    Use ``Reranker.load(model_dir)``.
    """

    def __init__(self, model, model_dir: Path, batch_size: int) -> None:  # model: CrossEncoder
        self._model = model
        self.model_dir = model_dir  # the folder it was loaded from
        self.batch_size = batch_size  # pairs per forward pass

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "cpu", batch_size: int = 32,
             max_length: int = 512) -> Reranker:
        """Load the cross-encoder saved in ``model_dir``.

        Raises:
            FileNotFoundError: ``model_dir`` is not a folder with a ``config.json``.
        """
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"no cross-encoder at {model_dir} (no config.json): save one there with "
                f"sentence_transformers.CrossEncoder(NAME).save('{model_dir}')"
            )
        from sentence_transformers import CrossEncoder

        model = CrossEncoder(str(model_dir), device=device, max_length=max_length, local_files_only=True)
        return cls(model, model_dir, batch_size)

    def scores(self, question: str, texts: Sequence[str]) -> np.ndarray:
        """Relevance of each text to ``question``: ``[len(texts)]`` float32."""
        if not texts:
            return np.zeros(0, dtype=np.float32)
        out = self._model.predict([(question, t) for t in texts], batch_size=self.batch_size,
                                  show_progress_bar=False, convert_to_numpy=True)
        out = np.asarray(out, dtype=np.float32)
        return out.reshape(len(texts), -1)[:, -1]  # one logit per pair (the last label if several)


def tiny_cross_encoder_dir(dest: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-weight BERT cross-encoder (one label) to ``dest``, with the shipped
    MiniLM embedder's tokenizer: for tests and benchmarks of the reranking path, not for quality."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from ragkv.retriever.embedder import DEFAULT_EMBEDDER, resolve_embedder

    dest = Path(dest)
    tok = AutoTokenizer.from_pretrained(str(resolve_embedder(DEFAULT_EMBEDDER)))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, num_labels=1)
    BertForSequenceClassification(config).eval().save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    return dest
