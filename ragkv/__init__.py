"""ragkv: the public face. Client SDK, LangChain adapters, generated ragkv/v1 stubs, CLI.

This package must never import torch, transformers or FAISS at import time: a
client install has only grpcio and protobuf.
"""

from ragkv.errors import RagKVError

__all__ = ["RagKVError", "__version__"]
__version__ = "0.1.0"
