"""The engine's KV-cache events as this frontend serves them: the mirror hub, its config and the ZMQ publisher."""
