"""ragkv: the public face. Client SDK, LangChain adapters, generated ragkv/v1 stubs, CLI.

This package must never import torch, transformers or FAISS at import time: a
client install has only grpcio and protobuf.
"""

from typing import Any

from ragkv.errors import RagKVError

__all__ = ["AsyncRagClient", "Mode", "RagClient", "RagKVError", "RetryPolicy", "__version__"]
__version__ = "0.1.0"

_LAZY = {
    "RagClient": "ragkv.client",
    "AsyncRagClient": "ragkv.client",
    "RetryPolicy": "ragkv.retry",
    "Mode": "ragkv.types",
}


def __getattr__(name: str) -> Any:
    # The SDK loads grpc on first use, so `import ragkv` stays instant.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragkv' has no attribute {name!r}")
