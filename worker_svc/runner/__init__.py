"""One step on a rank (vLLM's v1/worker model runner): the persistent batch, the KV cache, encoder, pooler, spec decode and warm-up."""
