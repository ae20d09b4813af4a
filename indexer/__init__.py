"""indexer: chunking, embedding, FAISS build and the resumable KV precompute job.

Composes engine + kvstore + retriever's index builder. Never imports server/ or gRPC.
"""
