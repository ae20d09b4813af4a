"""engine: the model runtime. Load (HF dir, hub id, GGUF), prefill, RoPE, blend, decode.

The engine knows nothing about storage, retrieval or gRPC: token ids and tensors in,
tensors and text out. It never imports kvstore, FAISS or grpc.

Shape legend used in every comment:
    L    decoder layers
    Hkv  KV heads (H = query heads)
    T    tokens of one segment (N = the whole prompt, S = the tokens being computed)
    D    head dim
    V    vocabulary size
"""

import os

# Every request allocates its KV cache and reads chunk files into fresh buffers (hundreds
# of MB): torch's CPU allocator backs blocks >= 2 MB with transparent huge pages when
# this is set, which halves the first-touch cost (about 6% of reuse TTFT on 8x512
# tokens). Read at torch's first large allocation; an explicit setting wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from engine.blend import BlendMode, BlendOptions, BlendResult, Selector
from engine.decode import DecodeStream, SamplingParams
from engine.fingerprint import Fingerprint
from engine.kv import ChunkKV, KVCache
from engine.loading import DEFAULT_MODEL, LoadedModel, load_model
from engine.prompt import PromptFormat
from engine.runtime import Engine

__all__ = [
    "DEFAULT_MODEL", "BlendMode", "BlendOptions", "BlendResult", "ChunkKV", "DecodeStream",
    "Engine", "Fingerprint", "KVCache", "LoadedModel", "PromptFormat", "SamplingParams", "Selector", "load_model",
]
