"""Engine: one loaded model and the operations the indexer and server call.

Not thread-safe: run one request at a time per Engine (the server serializes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from engine.blend import BlendMode, BlendOptions, BlendResult, run_prompt
from engine.decode import DecodeStream, SamplingParams
from engine.kv import ChunkKV
from engine.loading import LoadedModel
from engine.prefill import prefill_segment
from engine.prompt import DEFAULT_SYSTEM_PROMPT, PromptFormat

_PREFIX_MEMO_SIZE = 8  # distinct prefixes kept computed


class Engine:
    """The model runtime: prefill chunks, blend a prompt, decode."""

    def __init__(self, lm: LoadedModel, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> None:
        self.lm = lm
        self.prompt = PromptFormat.for_tokenizer(lm.tokenizer, system_prompt)
        self._prefixes: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()

    def prefix_kv(self, prefix_ids: Sequence[int]) -> ChunkKV:
        """The prefix's own KV (positions 0..P-1), computed once and reused."""
        key = tuple(int(i) for i in prefix_ids)
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            return self._prefixes[key]
        kv = prefill_segment(self.lm, None, key)
        self._prefixes[key] = kv
        if len(self._prefixes) > _PREFIX_MEMO_SIZE:
            self._prefixes.popitem(last=False)
        return kv

    def prefill_chunk(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int]) -> ChunkKV:
        """A chunk's KV computed after the shared prefix: K before RoPE, V, both [L, Hkv, T, D]."""
        prefix = self.prefix_kv(prefix_ids) if len(prefix_ids) else None
        return prefill_segment(self.lm, prefix, chunk_ids)

    def prefill_chunks(self, prefix_ids: Sequence[int], chunks: Sequence[Sequence[int]]) -> list[ChunkKV]:
        """`prefill_chunk` for many chunks sharing one prefix."""
        return [self.prefill_chunk(prefix_ids, ids) for ids in chunks]

    @torch.inference_mode()
    def full_prefill(self, ids: Sequence[int], reserve_tokens: int = 256) -> BlendResult:
        """Plain prefill of the whole prompt: the baseline every mode is measured against."""
        return run_prompt(self.lm, None, [], ids, BlendMode.FULL, reserve_tokens=reserve_tokens)

    @torch.inference_mode()
    def blend(
        self,
        prefix: ChunkKV,
        chunks: Sequence[ChunkKV],
        question_ids: Sequence[int],
        mode: BlendMode | str = BlendMode.BLEND,
        recompute_ratio: float = 0.15,
        options: BlendOptions | None = None,
        reserve_tokens: int = 256,
    ) -> BlendResult:
        """Run `[prefix][chunks][question]` in `mode`; see engine.blend for the modes."""
        opts = options or BlendOptions(recompute_ratio=recompute_ratio)
        return run_prompt(self.lm, prefix, chunks, question_ids, BlendMode(mode), opts, reserve_tokens)

    def decode(self, prompt: BlendResult, params: SamplingParams | None = None) -> DecodeStream:
        """Stream the answer's text pieces; the stream reports finish_reason and token_ids."""
        return DecodeStream(self.lm, prompt, params or SamplingParams())
