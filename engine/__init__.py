"""engine: the model runtime. Load (HF dir, hub id, GGUF), prefill, RoPE, blend, decode.

The engine knows nothing about storage, retrieval or gRPC: token ids and tensors in,
tensors and text out. It never imports kvstore, FAISS or grpc.

Shape legend used in every comment:
    L    decoder layers
    Hkv  KV heads (H = query heads)
    T    tokens of one segment (N = the whole prompt, S = the tokens being computed)
    D    head dim
    V    vocabulary size

Importing the engine changes nothing in the process: the programs that run it (serve,
index, eval, bench) call `tune_host_allocator()` first (engine/kv/host_allocator.py).
"""

from ragkv.engine.blend import BlendOptions, BlendResult, Prompt, Selector
from ragkv.engine.decode import DecodeStream, SamplingParams
from ragkv.engine.focus import FocusOptions
from ragkv.engine.kv.cache import ChunkKV, KVCache, LayerReady
from ragkv.engine.kv.conversation import TreeConfig
from ragkv.engine.kv.host_allocator import tune_host_allocator
from ragkv.engine.model_loading import DEFAULT_MODEL, LoadedModel, load_model
from ragkv.engine.prompt import PromptFormat
from ragkv.engine.runtime import Engine
from ragkv.engine.select import Budget

__all__ = [
    "DEFAULT_MODEL", "Budget", "BlendOptions", "BlendResult", "ChunkKV", "DecodeStream",
    "Engine", "FocusOptions", "Prompt", "KVCache", "LayerReady", "LoadedModel", "PromptFormat", "SamplingParams",
    "Selector", "TreeConfig", "load_model", "tune_host_allocator",
]
