"""The public API key: the check and the gRPC interceptor."""
