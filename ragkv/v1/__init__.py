"""Generated gRPC stubs of the ragkv.v1 API (see proto/ragkv/v1/)."""
