"""worker_svc: one tensor-/pipeline-parallel rank of the model (vLLM's Worker + ModelRunner).

server.py         WorkerServicer on a synchronous gRPC server, a thread per RPC: each Execute
                  step runs inline on its stream's thread; model calls are serialised
convert.py        protobuf <-> the worker's own types (the only other `*_pb2` importer)
worker.py         Worker: describe, load_model (joins torch.distributed, picks the attention
                  backend for the block size, once), KV capacity, execute
model_runner.py   one step: state update -> inputs -> forward -> logits -> sample -> output
input_batch.py    per-request state across steps; vectorized step inputs
kv_cache.py       paged KV tensors per layer, null block (block 0), capacity arithmetic
attention/        backends: torch (reference), triton (our kernel), flash_attn (paged API)
layers/           embedding / LM head (vocab-parallel), linears (column/row-parallel,
                  fused qkv and gate_up), RMSNorm, rotary (llama3 scaling), activation
models/           Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) and the registry
weights.py        safetensors checkpoints (sharded via the index json), dtype choice
sampler.py        batched sampling; penalties.py, logprobs.py, prompt_logprobs.py,
                  sampling_metadata.py (per-request SamplerParams as columns, checked with
                  splitserve_contracts.sampling_rules)
distributed.py    TP groups and PP send/recv
"""
