"""server: the grpc.aio service, health, reflection, metrics, auth and config wiring.

Composes retriever + kvstore + engine; the only place that maps RagKVError to
gRPC status codes.
"""
