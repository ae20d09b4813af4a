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

from engine.memory import tune_host_allocator

tune_host_allocator()  # before torch's first large allocation: see engine/memory.py

from engine.blend import BlendMode, BlendOptions, BlendResult, Selector
from engine.select import Budget
from engine.decode import DecodeStream, SamplingParams
from engine.fingerprint import Fingerprint
from engine.kv import ChunkKV, KVCache, LayerReady
from engine.loading import DEFAULT_MODEL, LoadedModel, load_model
from engine.prompt import PromptFormat
from engine.runtime import Engine

__all__ = [
    "DEFAULT_MODEL", "BlendMode", "Budget", "BlendOptions", "BlendResult", "ChunkKV", "DecodeStream",
    "Engine", "Fingerprint", "KVCache", "LayerReady", "LoadedModel", "PromptFormat", "SamplingParams", "Selector", "load_model",
]
