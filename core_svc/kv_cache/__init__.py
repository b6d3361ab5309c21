"""The KV cache's bookkeeping (vLLM's KVCacheManager, BlockPool): blocks, prefix-cache hashes and the KV-cache events they raise."""
