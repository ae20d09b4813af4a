"""How `ragkv serve` searches: the settings' search mode, fusion and reranker as Retriever options.

Loads the cross-encoder once for every collection. Imports the retriever only when called.
"""

from __future__ import annotations

from typing import Any

from ragkv.server.settings import ServerSettings


def retriever_options(settings: ServerSettings) -> dict[str, Any]:
    """Keyword arguments of ``Retriever.open`` that ``settings`` implies.

    Raises:
        ValueError: the fusion settings are out of range.
        FileNotFoundError: ``settings.reranker`` holds no cross-encoder.
    """
    from ragkv.retriever.fusion import FusionConfig

    fusion = FusionConfig(method=settings.fusion, dense_weight=settings.dense_weight,
                          lexical_weight=settings.lexical_weight, candidates=settings.search_candidates)
    reranker = None
    if settings.reranker is not None:
        from ragkv.retriever.rerank import Reranker

        device = settings.device if settings.device != "auto" else "cpu"
        reranker = Reranker.load(settings.reranker, device=device)
    return {"default_mode": settings.default_search_mode, "fusion": fusion, "reranker": reranker,
            "faiss_device": settings.faiss_device}
