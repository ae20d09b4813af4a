"""retriever: query embedding, FAISS search and chunk metadata.

Knows nothing of the engine or KV caches; never imports gRPC.
"""
